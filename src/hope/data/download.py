"""The download stage: source documents -> filtered, deduplicated train/val JSONL.

One streaming pass over the source (see ``hope.data.sources``):

1. at most ``data.max_documents`` documents are *read* from the source (0: all);
2. each is stripped of surrounding whitespace; documents shorter than
   ``data.min_chars`` are dropped, and so are documents longer than
   ``data.max_chars`` (0: no limit) -- dropped, not truncated, because such
   outliers are mostly dumps and logs, and a cut mid-sentence is not text;
3. with ``data.dedup`` exact duplicates (same sha256 of the text) are dropped;
4. each survivor goes to ``val`` when a hash of ``(split_seed, text)`` falls
   below ``data.val_fraction``, else to ``train``. The split depends only on the
   text, never on order or on which other documents exist.

Outputs (all written atomically): ``train.jsonl``, ``val.jsonl`` (rows
``{"text": ...}``), ``manifest.json`` and the resolved ``config.yaml``.

Resume after an interruption (a kill, a lost connection): the split files grow as
``.<split>.jsonl.partial`` and every ``PROGRESS_EVERY`` documents read, once both are
flushed to disk, ``.progress.json`` records how many source documents were read, the
files' lengths and counts, beside the dedup keys (``.seen.npy``) and, for a streamed
Hugging Face dataset, its ``state_dict()``. A rerun with the same source and filters
truncates the partial files to those lengths, continues the streamed dataset from
that state (no shard is downloaded again) or else skips the documents already read,
and carries on; the result is byte for byte an uninterrupted run's (tested). A changed
source or filter starts over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from hope.config import Config, DataConfig, save_config
from hope.data.sources import check_local_texts, describe_source, iter_documents
from hope.errors import StageError
from hope.io import atomic_write, atomic_write_json, remove_stale_temps

log = logging.getLogger(__name__)
SPLITS = ("train", "val")


def is_val_document(text: str, split_seed: int, val_fraction: float) -> bool:
    """Deterministic split: a uniform number in [0, 1) drawn from the text's hash."""
    digest = hashlib.sha256(f"{split_seed}\x00{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


PROGRESS_EVERY = 100_000  # source documents between resume points
PROGRESS = ".progress.json"
SEEN = ".seen.npy"


class _AtomicJsonl:
    """A JSONL file written to ``.<name>.partial`` and renamed into place on success.

    Tracks rows, characters, utf-8 bytes of the texts and the file's sha256.
    ``resume``: the counts of a resume point; the partial file is cut to its length.
    """

    def __init__(self, path: Path, resume: dict[str, int] | None = None) -> None:
        self.path = path
        remove_stale_temps(path)
        self.tmp = path.with_name(f".{path.name}.partial")
        self.digest = hashlib.sha256()
        self.documents = self.chars = self.bytes = 0
        if resume is None:
            self.handle: io.BufferedRandom = open(self.tmp, "w+b")  # noqa: SIM115
            return
        self.handle = open(self.tmp, "r+b")  # noqa: SIM115  (held until commit/abort)
        self.handle.truncate(resume["offset"])
        while block := self.handle.read(1 << 20):
            self.digest.update(block)
        self.documents, self.chars, self.bytes = (
            resume["documents"], resume["chars"], resume["bytes"]
        )  # fmt: skip

    def mark(self) -> dict[str, int]:
        """Flush to disk; the counts a resume starts from."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        return {"offset": self.handle.tell(), "documents": self.documents,
                "chars": self.chars, "bytes": self.bytes}  # fmt: skip

    def write(self, text: str) -> None:
        line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8")
        self.handle.write(line)
        self.digest.update(line)
        self.documents += 1
        self.chars += len(text)
        self.bytes += len(text.encode("utf-8"))

    def commit(self) -> dict[str, Any]:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.chmod(self.tmp, 0o644)  # mkstemp makes files private; these are shared outputs
        os.replace(self.tmp, self.path)
        return {
            "file": self.path.name,
            "documents": self.documents,
            "chars": self.chars,
            "bytes": self.bytes,
            "sha256": self.digest.hexdigest(),
        }

    def close(self) -> None:
        self.handle.close()


class _SplitWriter:
    """Both split files; all renamed into place only if the whole pass succeeds. On
    failure the partial files stay for a resume (``.progress.json`` says how much of
    them counts)."""

    def __init__(self, out_dir: Path, resume: dict[str, Any] | None) -> None:
        self.files = {
            split: _AtomicJsonl(out_dir / f"{split}.jsonl", resume and resume["splits"][split])
            for split in SPLITS
        }

    def __enter__(self) -> dict[str, _AtomicJsonl]:
        return self.files

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            for f in self.files.values():
                f.close()


def _resume_key(cfg: DataConfig) -> str:
    """What the partial files depend on: the source and the filters."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "seq_len"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _read_progress(out_dir: Path, key: str) -> dict[str, Any] | None:
    """The resume point of an interrupted run of the same source and filters."""
    path = out_dir / PROGRESS
    partials = [out_dir / f".{split}.jsonl.partial" for split in SPLITS]
    if not path.is_file() or not all(p.is_file() for p in partials):
        return None
    progress = json.loads(path.read_text())
    if progress.get("key") != key:
        log.info("download: source or filters changed since the interrupted run; starting over")
        return None
    short = [
        s for s, p in zip(SPLITS, partials, strict=True)
        if p.stat().st_size < progress["splits"][s]["offset"]
    ]  # fmt: skip
    if short:
        log.warning("download: a partial file is shorter than its resume point; starting over")
        return None
    return progress


def _save_array(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as handle:  # a handle: np.save would add ".npy" to a name
        np.save(handle, array)


def _save_progress(
    out_dir: Path, key: str, counts: dict[str, int], files: dict[str, _AtomicJsonl],
    seen: set[bytes], source_state: dict[str, Any] | None,
) -> None:  # fmt: skip
    splits = {split: f.mark() for split, f in files.items()}  # on disk before the record
    keys = np.frombuffer(b"".join(sorted(seen)), dtype="V16") if seen else np.empty(0, "V16")
    atomic_write(out_dir / SEEN, lambda tmp: _save_array(tmp, keys))
    progress = {"key": key, "counts": counts, "splits": splits, "source_state": source_state}
    atomic_write_json(out_dir / PROGRESS, progress)


def _filter_and_split(
    cfg: DataConfig,
    files: dict[str, _AtomicJsonl],
    counts: dict[str, int],
    seen: set[bytes],
    checkpoint: Callable[[dict[str, Any] | None], None],
    source_state: dict[str, Any] | None,
) -> None:
    documents = iter_documents(cfg, source_state)
    state = getattr(documents, "state", None)  # a source that can say where it is
    if source_state is not None and state is not None:  # it starts where the run stopped
        if cfg.max_documents > 0:
            documents = itertools.islice(documents, cfg.max_documents - counts["read"])
    else:
        if cfg.max_documents > 0:
            documents = itertools.islice(documents, cfg.max_documents)
        documents = itertools.islice(documents, counts["read"], None)  # resumed: read already
    for raw in documents:
        counts["read"] += 1
        text = raw.strip()
        if len(text) < cfg.min_chars:
            counts["dropped_short"] += 1
            continue
        if cfg.max_chars > 0 and len(text) > cfg.max_chars:
            counts["dropped_long"] += 1
            continue
        if cfg.dedup:
            # 128 bits keep collisions negligible at half the memory of a full digest.
            key = hashlib.sha256(text.encode("utf-8")).digest()[:16]
            if key in seen:
                counts["dropped_duplicate"] += 1
                continue
            seen.add(key)
        split = "val" if is_val_document(text, cfg.split_seed, cfg.val_fraction) else "train"
        files[split].write(text)
        if counts["read"] % PROGRESS_EVERY == 0:
            checkpoint(None if state is None else state())
            log.info("read %d documents", counts["read"])


def run_download(cfg: Config, out_dir: Path) -> dict[str, Any]:
    """Collect, filter, deduplicate and split ``cfg.data.source``; return the manifest."""
    data = cfg.data
    if data.source == "local":  # a file that is not UTF-8 is named before anything is written
        check_local_texts(data.local_glob)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    key = _resume_key(data)
    resume = _read_progress(out_dir, key)
    counts = dict.fromkeys(("read", "dropped_short", "dropped_long", "dropped_duplicate"), 0)
    seen: set[bytes] = set()
    if resume is not None:
        counts = resume["counts"]
        seen = {bytes(k) for k in np.load(out_dir / SEEN)} if (out_dir / SEEN).is_file() else seen
        log.info("download: resuming after %d documents read", counts["read"])
    with _SplitWriter(out_dir, resume) as files:
        _filter_and_split(
            data, files, counts, seen,
            lambda at: _save_progress(out_dir, key, counts, files, seen, at),
            None if resume is None else resume.get("source_state"),
        )  # fmt: skip
        if files["train"].documents == 0:
            raise StageError(
                f"data.source={data.source}: no training documents left after filtering "
                f"({counts}); check data.min_chars / data.max_chars / the source"
            )
        if data.val_fraction > 0 and files["val"].documents == 0:
            raise StageError(
                f"data.val_fraction={data.val_fraction} put no document into validation "
                f"({files['train'].documents} documents in all); raise it or add data"
            )
        splits = {split: f.commit() for split, f in files.items()}
    for done in (PROGRESS, SEEN):
        (out_dir / done).unlink(missing_ok=True)
    manifest = {
        "source": describe_source(data),
        "filters": {
            "max_documents": data.max_documents,
            "min_chars": data.min_chars,
            "max_chars": data.max_chars,
            "dedup": data.dedup,
            "val_fraction": data.val_fraction,
            "split_seed": data.split_seed,
        },
        "counts": counts,
        "splits": splits,
    }
    atomic_write_json(out_dir / "manifest.json", manifest)
    save_config(cfg, out_dir / "config.yaml")
    log.info(
        "download: %s documents read, train %d docs / %d bytes, val %d docs / %d bytes (%.1f s)",
        counts["read"],
        splits["train"]["documents"],
        splits["train"]["bytes"],
        splits["val"]["documents"],
        splits["val"]["bytes"],
        time.perf_counter() - started,
    )
    return manifest


def iter_jsonl_texts(jsonl: Path) -> Iterator[str]:
    """Stream the texts of a ``{"text": ...}`` JSONL file written by this stage."""
    jsonl = Path(jsonl)
    if not jsonl.is_file():
        raise StageError(f"{jsonl} not found; run `python stages/download.py` first")
    with open(jsonl, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            try:
                yield json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise StageError(f"{jsonl}:{line_no}: not a {{'text': ...}} JSON row") from None

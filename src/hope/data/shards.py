"""The shard stage and its loader: tokenized splits as flat memmap token files.

Each split (``train``, ``val``) is the concatenation of its documents, each
followed by the tokenizer's EOS id, cut into files ``<split>_00000.bin``, ...
of at most ``SHARD_TOKENS`` tokens: flat little-endian ``uint16`` when the
vocabulary fits (<= 65536), else ``uint32``. ``manifest.json`` records the
tokenizer's sha256, vocab size, dtype, EOS id and, per shard, its token count
and sha256, so ``load_split`` can refuse stale, truncated or foreign shards.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hope.data.download import SPLITS, iter_jsonl_texts
from hope.data.tokenizer import load_tokenizer
from hope.errors import StageError
from hope.io import (
    atomic_write_json,
    no_space_error,
    remove_stale_temps,
    sha256_file,
    space_cause,
)

log = logging.getLogger(__name__)
SHARD_TOKENS = 2**27  # 256 MiB of uint16 per file
ENCODE_BATCH_DOCS = 512


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


class _ShardWriter:
    """Appends token arrays to ``<split>_NNNNN.bin`` files, rolling over at ``max_tokens``."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, max_tokens: int) -> None:
        self.out_dir, self.split, self.dtype, self.max_tokens = out_dir, split, dtype, max_tokens
        self.shards: list[dict[str, Any]] = []
        self._handle: Any = None
        self._tmp: Path | None = None
        self._tokens = 0
        self._digest = hashlib.sha256()

    def _open(self) -> None:
        fd, name = tempfile.mkstemp(prefix=f".{self.split}.", suffix=".tmp", dir=self.out_dir)
        self._handle, self._tmp = os.fdopen(fd, "wb"), Path(name)
        self._tokens, self._digest = 0, hashlib.sha256()

    def _close(self) -> None:
        assert self._handle is not None and self._tmp is not None
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        os.chmod(self._tmp, 0o644)  # mkstemp makes files private; shards are shared outputs
        os.replace(self._tmp, self.out_dir / name)
        self.shards.append(
            {"file": name, "tokens": self._tokens, "sha256": self._digest.hexdigest()}
        )
        self._handle = self._tmp = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._handle is None:
                self._open()
            take = min(tokens.size, self.max_tokens - self._tokens)
            blob = tokens[:take].tobytes()
            self._handle.write(blob)
            self._digest.update(blob)
            self._tokens += take
            tokens = tokens[take:]
            if self._tokens == self.max_tokens:
                self._close()

    def finish(self) -> list[dict[str, Any]]:
        if self._handle is not None:
            self._close()
        return self.shards

    def abort(self) -> None:
        if self._handle is not None and self._tmp is not None:
            self._handle.close()
            self._tmp.unlink(missing_ok=True)


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write_shards(
    tokenizer_model: Path,
    raw_dir: Path,
    out_dir: Path,
    shard_tokens: int = SHARD_TOKENS,
    num_threads: int = 1,
) -> dict[str, Any]:
    """Tokenize ``raw_dir/{train,val}.jsonl`` into ``out_dir`` shards; return the manifest."""
    started = time.perf_counter()
    sp = load_tokenizer(tokenizer_model)
    vocab_size, eos = sp.get_piece_size(), sp.eos_id()
    dtype = token_dtype(vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.bin"):  # a previous run may have had more shards
        stale.unlink()
    for split in SPLITS:  # and a killed one, a temp shard
        remove_stale_temps(out_dir / split)
    (out_dir / "manifest.json").unlink(missing_ok=True)
    splits: dict[str, Any] = {}
    for split in SPLITS:
        raw = Path(raw_dir) / f"{split}.jsonl"
        writer = _ShardWriter(out_dir, split, dtype, shard_tokens)
        documents = 0
        try:
            for batch in _batches(iter_jsonl_texts(raw), ENCODE_BATCH_DOCS):
                encoded = sp.encode(batch, num_threads=num_threads)
                # Every document ends with EOS, so documents never run into each other.
                lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
                flat = np.fromiter(
                    itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum())
                )
                writer.write(np.insert(flat, np.cumsum(lengths), eos))
                documents += len(batch)
            shards = writer.finish()
        except BaseException as err:
            writer.abort()
            full = space_cause(err)
            if full is not None:
                raise no_space_error(out_dir / f"{split}_*.bin", full) from None
            raise
        splits[split] = {
            "documents": documents,
            "tokens": sum(s["tokens"] for s in shards),
            "raw_sha256": sha256_file(raw),
            "shards": shards,
        }
    manifest = {
        "tokenizer_sha256": sha256_file(Path(tokenizer_model)),
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "eos_id": eos,
        "shard_tokens": shard_tokens,
        "splits": splits,
    }
    atomic_write_json(out_dir / "manifest.json", manifest)
    log.info(
        "shards: train %d tokens, val %d tokens, %s (%.1f s)",
        splits["train"]["tokens"],
        splits["val"]["tokens"],
        dtype.name,
        time.perf_counter() - started,
    )
    return manifest


class ShardedTokens:
    """Read-only view of a split: the concatenation of its shard arrays.

    ``digest`` identifies the content: from the shard manifest (its sha256s and the
    tokenizer's) when loaded from disk, else hashed from the arrays on first use."""

    def __init__(self, arrays: list[np.ndarray], digest: str | None = None) -> None:
        self.arrays = [a for a in arrays if a.size]
        sizes = np.array([a.size for a in self.arrays], dtype=np.int64)
        self.ends = np.cumsum(sizes)  # exclusive end offset of each array
        self.num_tokens = int(self.ends[-1]) if self.ends.size else 0
        self._digest = digest

    @property
    def digest(self) -> str:
        if self._digest is None:
            sha = hashlib.sha256()
            for array in self.arrays:
                sha.update(str(array.dtype).encode())
                sha.update(np.ascontiguousarray(array).tobytes())
            self._digest = sha.hexdigest()
        return self._digest

    def window(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens from global offset ``start`` as an int64 copy (may cross shards)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(
                f"window [{start}, {start + length}) outside the {self.num_tokens} tokens"
            )
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.ends, start, side="right"))
        while filled < length:
            begin = self.ends[shard] - self.arrays[shard].size
            offset = start + filled - int(begin)
            take = min(length - filled, self.arrays[shard].size - offset)
            out[filled : filled + take] = self.arrays[shard][offset : offset + take]
            filled += take
            shard += 1
        return out


def read_manifest(shard_dir: Path) -> dict[str, Any]:
    path = Path(shard_dir) / "manifest.json"
    if not path.is_file():
        raise StageError(f"shard manifest {path} not found; run `python stages/shard.py`")
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise StageError(f"shard manifest {path} is corrupt: {err}") from None
    return manifest


def load_split(
    shard_dir: Path, split: str, tokenizer_model: Path | None = None, verify_hash: bool = True
) -> ShardedTokens:
    """Memory-map one split after checking it against its manifest (and tokenizer)."""
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    if split not in manifest["splits"]:
        raise StageError(f"{shard_dir}/manifest.json has no split {split!r}")
    if tokenizer_model is not None:
        if not Path(tokenizer_model).is_file():
            raise StageError(
                f"tokenizer {tokenizer_model} is missing (the shards in {shard_dir} need "
                "it); rebuild it with `dvc repro tokenizer` or `python stages/tokenizer.py`"
            )
        if sha256_file(Path(tokenizer_model)) != manifest["tokenizer_sha256"]:
            raise StageError(
                f"shards in {shard_dir} were made with another tokenizer than {tokenizer_model} "
                "(sha256 differs); rerun `python stages/shard.py`"
            )
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    arrays: list[np.ndarray] = []
    for shard in manifest["splits"][split]["shards"]:
        path = shard_dir / shard["file"]
        if not path.is_file():
            raise StageError(f"shard {path} is missing; rerun `python stages/shard.py`")
        expected = shard["tokens"] * dtype.itemsize
        if path.stat().st_size != expected:
            raise StageError(
                f"shard {path} is corrupt: {path.stat().st_size} bytes, manifest says {expected}"
            )
        if verify_hash and sha256_file(path) != shard["sha256"]:
            raise StageError(f"shard {path} is corrupt: sha256 mismatch")
        arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["tokens"],)))
    identity = {"split": manifest["splits"][split], "tokenizer": manifest["tokenizer_sha256"]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return ShardedTokens(arrays, digest)

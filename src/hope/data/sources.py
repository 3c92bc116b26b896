"""Where raw documents come from: ``builtin``, ``hf`` or ``local`` (``data.source``).

Each source is a plain iterator of document strings, in a fixed order, so the
download stage can filter, deduplicate and split them in one streaming pass.

- ``builtin`` needs nothing but Python: the pydoc topic pages plus the
  docstrings of the standard library, read with ``ast`` (never imported: some
  modules have side effects, ``antigravity`` opens a browser).
- ``hf`` is ``datasets.load_dataset``; a name that is an existing local path is
  loaded directly, otherwise the hub must answer a TCP connect first, so a
  machine without network fails in seconds instead of hanging.
- ``local`` reads ``.txt`` (one document per file), ``.jsonl`` and ``.parquet``.
"""

from __future__ import annotations

import ast
import codecs
import glob
import json
import os
import socket
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

from hope.config import DataConfig
from hope.errors import StageError

# Directories of the stdlib tree that hold tests, fixtures or third-party code,
# not documentation; matched against every path component.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
HUB_TIMEOUT_S = 3.0
_DocNode = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
_TRUE = {"1", "true", "yes", "on"}
_PARQUET_BATCH_ROWS = 1024


def describe_source(cfg: DataConfig) -> dict[str, Any]:
    """What the manifest records about the source (enough to fetch it again)."""
    if cfg.source == "builtin":
        return {
            "kind": "builtin",
            "python": sys.version.split()[0],
            "parts": ["pydoc_data.topics", "stdlib docstrings"],
        }
    if cfg.source == "hf":
        return {
            "kind": "hf",
            "name": cfg.hf_name,
            "config": cfg.hf_config,
            "split": cfg.hf_split,
            "text_column": cfg.text_column,
            "streaming": cfg.streaming,
        }
    return {
        "kind": "local",
        "glob": cfg.local_glob,
        "files": len(local_files(cfg.local_glob)),
        "text_column": cfg.text_column,
    }


def iter_documents(cfg: DataConfig, resume_state: dict[str, Any] | None = None) -> Iterator[str]:
    """All raw documents of ``cfg.source`` in a fixed order (unfiltered, unlimited).

    A streamed Hugging Face dataset comes as a ``StreamedTexts``, which can say where it
    is (``state()``) and, given that ``resume_state``, starts there instead of at the
    first document; every other source starts at the first document."""
    if cfg.source == "builtin":
        return builtin_documents()
    if cfg.source == "hf":
        return hf_documents(cfg, resume_state)
    if cfg.source == "local":
        return local_documents(cfg.local_glob, cfg.text_column)
    raise StageError(f"data.source: unknown source {cfg.source!r}; use builtin, hf or local")


# ---------------------------------------------------------------- builtin


def stdlib_sources(stdlib: Path | None = None) -> list[Path]:
    """The stdlib's ``.py`` files outside test/third-party dirs, sorted by relative path."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return [root / rel for rel in sorted(found)]


def module_docstrings(source: bytes) -> str:
    """Module, class and function docstrings of one file, joined by blank lines."""
    with warnings.catch_warnings():
        # Old escape sequences in some stdlib files warn at parse time; harmless.
        warnings.simplefilter("ignore")
        tree = ast.parse(source)
    parts = [ast.get_docstring(node, clean=True) for node in _documented_nodes(tree)]
    return "\n\n".join(p.strip() for p in parts if p and p.strip())


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _documented_nodes(node: ast.AST) -> Iterator[_DocNode]:
    """Module, classes and functions in source order (``ast.walk`` is breadth-first)."""
    if isinstance(node, _DOCUMENTED):
        yield node
    for child in ast.iter_child_nodes(node):
        yield from _documented_nodes(child)


def builtin_documents(stdlib: Path | None = None) -> Iterator[str]:
    """pydoc topics (one document each, sorted by name) then one document per stdlib module."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]
    for path in stdlib_sources(stdlib):
        try:
            text = module_docstrings(path.read_bytes())
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, OSError):
            continue  # a few stdlib files are deliberately unparsable fixtures
        if text:
            yield text


# ---------------------------------------------------------------- hf


def _offline_env() -> str | None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]}"
    return None


def _hub_address() -> tuple[str, int]:
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    port = url.port or (80 if url.scheme == "http" else 443)
    return url.hostname or "huggingface.co", port


def check_hub_reachable(name: str, timeout: float = HUB_TIMEOUT_S) -> None:
    """Raise StageError quickly when the Hugging Face hub cannot be reached."""
    alternatives = (
        "use data.source=local with data.local_glob pointing at .txt/.jsonl/.parquet files, "
        "or data.source=builtin (Python's own documentation, no network)"
    )
    offline = _offline_env()
    if offline:
        raise StageError(
            f"data.source=hf needs the Hugging Face hub for {name!r}, but there is no network "
            f"access to the Hugging Face hub ({offline}); {alternatives}"
        )
    host, port = _hub_address()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise StageError(
            f"data.source=hf needs the Hugging Face hub for {name!r}, but there is no network "
            f"access to the Hugging Face hub ({host}:{port}: {err}); {alternatives}"
        ) from None


def _load_hf(cfg: DataConfig) -> Any:
    import datasets

    local = Path(cfg.hf_name)
    if local.is_file():
        builder = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
        kind = builder.get(local.suffix)
        if kind is None:
            raise StageError(f"data.hf_name: cannot load local file {local} (unknown extension)")
        # A single data file always forms the "train" split.
        return datasets.load_dataset(
            kind, data_files=str(local), split="train", streaming=cfg.streaming
        )
    if local.is_dir():
        # data.hf_config names hub configs; a local folder is read as it is.
        return datasets.load_dataset(str(local), split=cfg.hf_split, streaming=cfg.streaming)
    check_hub_reachable(cfg.hf_name)
    return datasets.load_dataset(
        cfg.hf_name, cfg.hf_config, split=cfg.hf_split, streaming=cfg.streaming
    )


class StreamedTexts(Iterator[str]):
    """The texts of a streamed (``IterableDataset``) Hugging Face dataset that can be
    resumed: ``state()`` is the dataset's ``state_dict()`` after the texts yielded so
    far, and a dataset given that state yields the next text (exact without shuffling;
    no shard is read again)."""

    def __init__(self, dataset: Any, column: str, resume_state: dict[str, Any] | None) -> None:
        if resume_state is not None:
            dataset.load_state_dict(resume_state)
        self.dataset, self.column = dataset, column
        self.rows = iter(dataset)

    def __next__(self) -> str:
        text = next(self.rows).get(self.column)
        return text if isinstance(text, str) else ""  # null rows count as too short

    def state(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.dataset.state_dict())


def hf_documents(cfg: DataConfig, resume_state: dict[str, Any] | None = None) -> Iterator[str]:
    """``text_column`` of a Hugging Face dataset, in dataset order (streamed: resumable)."""
    dataset = _load_hf(cfg)
    columns = dataset.column_names
    if columns is not None and cfg.text_column not in columns:
        raise StageError(
            f"data.text_column={cfg.text_column!r} is not a column of {cfg.hf_name}; "
            f"columns: {', '.join(columns)}"
        )
    if cfg.streaming:
        return StreamedTexts(dataset, cfg.text_column, resume_state)
    texts = (row.get(cfg.text_column) for row in dataset)
    return (text if isinstance(text, str) else "" for text in texts)


# ---------------------------------------------------------------- local


def local_files(pattern: str) -> list[Path]:
    if not pattern:
        raise StageError("data.source=local needs data.local_glob (e.g. 'corpus/**/*.txt')")
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise StageError(f"data.local_glob={pattern!r} matches no files")
    return files


def _jsonl_documents(path: Path, column: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise StageError(f"{path}:{line_no}: not valid JSON ({err})") from None
            if not isinstance(row, dict) or not isinstance(row.get(column), str):
                raise StageError(f"{path}:{line_no}: no string field {column!r} (data.text_column)")
            yield row[column]


def _parquet_documents(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a bad file
        raise StageError(f"{path}: not a readable parquet file ({err})") from None
    if column not in parquet.schema_arrow.names:
        raise StageError(
            f"{path}: no column {column!r} (data.text_column); "
            f"columns: {', '.join(parquet.schema_arrow.names)}"
        )
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[column]):
        # Null cells become "" so the download stage counts them as too short.
        yield from (t if isinstance(t, str) else "" for t in batch.column(0).to_pylist())


def _not_utf8(path: Path, err: UnicodeDecodeError, offset: int | None) -> StageError:
    """``offset``: where the decoded bytes start in the file (None: unknown)."""
    where = f"byte {offset + err.start}: " if offset is not None else ""
    return StageError(
        f"{path}: not UTF-8 text ({where}{err.reason}); convert it "
        "(e.g. `iconv -f latin1 -t utf-8`) or leave it out of data.local_glob"
    )


def check_local_texts(pattern: str, block: int = 1 << 20) -> None:
    """Every text file (.txt, .jsonl) matching ``pattern`` decodes as UTF-8: checked,
    one streamed read each, before the download stage writes anything, so a bad file
    is named at once rather than after part of the corpus was split."""
    for path in local_files(pattern):
        if path.suffix.lower() not in (".txt", ".jsonl"):
            continue
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(block)
                held = len(decoder.getstate()[0])  # a character's bytes cut by the block
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:
                    raise _not_utf8(path, err, offset - held) from None
                if not chunk:
                    break
                offset += len(chunk)


def local_documents(pattern: str, column: str = "text") -> Iterator[str]:
    """Documents from the files matching ``pattern`` (sorted paths)."""
    for path in local_files(pattern):
        suffix = path.suffix.lower()
        if suffix == ".txt":
            data = path.read_bytes()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as err:  # changed since check_local_texts
                raise _not_utf8(path, err, 0) from None
        elif suffix == ".jsonl":
            try:
                yield from _jsonl_documents(path, column)
            except UnicodeDecodeError as err:
                raise _not_utf8(path, err, None) from None
        elif suffix == ".parquet":
            yield from _parquet_documents(path, column)
        else:
            raise StageError(
                f"{path}: unknown file type {suffix!r} (data.local_glob={pattern!r}); "
                "expected .txt, .jsonl or .parquet"
            )

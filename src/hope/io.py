"""Atomic file writes and hashing: nothing half-written survives a kill."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hope.errors import StageError

# A full disk, a full quota, a file-size limit (ulimit -f, with SIGXFSZ ignored).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_space_error(path: Path, err: OSError) -> StageError:
    """The one-line error for a write that ran out of disk space (or quota)."""
    return StageError(
        f"{path}: no space left on the device while writing it ({err.strerror}); "
        "the partial file was removed and any previous version is intact: free space "
        "and rerun"
    )


def space_cause(err: BaseException) -> OSError | None:
    """The out-of-space ``OSError`` behind ``err``, if any: itself, or one it was raised
    from or while handling (``torch.save`` into a file object turns the file's
    ``OSError`` into a ``RuntimeError`` raised while handling it)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in NO_SPACE:
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def remove_stale_temps(target: Path) -> None:
    """Delete what killed writers of ``target`` left beside it: our temp names
    ``.<name>.<8 random chars>.tmp`` (files or folders, from ``tempfile``) and
    ``.<name>.old-<pid>`` folders. Only the target's own writer calls this (one writer
    per output: a DVC stage, rank 0, the checkpoint folder's lock), so no live write is
    touched; without it a killed run's litter would stay in (and change the hash of)
    the output folder."""
    parent = Path(target).parent
    if not parent.is_dir():
        return
    name = Path(target).name
    for stale in [*parent.glob(f".{name}.{'?' * 8}.tmp"), *parent.glob(f".{name}.old-*")]:
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temp file beside ``path``, fsync it, then rename over ``path``
    (first removing what a killed earlier write of ``path`` left)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; use the usual file mode
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        full = space_cause(err)
        if full is not None:
            raise no_space_error(path, full) from None
        if isinstance(err, PermissionError):
            raise StageError(f"{path}: not writable ({err.strerror}); fix the folder's "
                             "permissions and rerun") from None  # fmt: skip
        raise


def check_writable(folders: Iterable[Path]) -> None:
    """A file can be created in each folder (or, for one not made yet, in its nearest
    existing parent; nothing is left behind): a stage checks the folders it writes
    before its work, so a read-only one is named at once instead of after the work."""
    for folder in folders:
        existing = Path(folder).absolute()
        while not existing.is_dir() and existing != existing.parent:
            existing = existing.parent
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as err:
            raise StageError(
                f"{existing}: not writable ({err.strerror}); this stage writes {folder} "
                "there: fix its permissions (or free the disk) and rerun"
            ) from None


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def meta_path(metrics_path: Path) -> Path:
    """The records beside a metrics file: ``reports/eval.json`` -> ``eval_meta.json``."""
    return metrics_path.with_name(f"{metrics_path.stem}_meta.json")


def non_numbers(tree: Any, where: str = "") -> list[str]:
    """Dotted paths of every leaf of ``tree`` that is not a number or None (not measured
    here, e.g. MFU on a CPU): bools, strings and lists, which ``dvc metrics show/diff``
    cannot put in a table."""
    if isinstance(tree, dict):
        return [bad for key, sub in tree.items() for bad in non_numbers(sub, f"{where}{key}.")]
    if tree is None or (isinstance(tree, int | float) and not isinstance(tree, bool)):
        return []
    return [where.rstrip(".") or "<root>"]


def split_non_numbers(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(numbers, the rest) of a nested dict, both keeping the nesting (empty dicts
    dropped from the rest): e.g. a fitted curve's sample points beside its numbers."""
    numbers: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            sub_numbers, sub_rest = split_non_numbers(value)
            if sub_numbers or not value:
                numbers[key] = sub_numbers
            if sub_rest:
                rest[key] = sub_rest
        elif non_numbers(value):
            rest[key] = value
        else:
            numbers[key] = value
    return numbers, rest


def split_records(
    report: dict[str, Any], record_keys: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, records) of a report: ``record_keys`` (names, machine, config) move to
    the records."""
    metrics = {k: v for k, v in report.items() if k not in record_keys}
    return metrics, {k: report[k] for k in record_keys if k in report}


def write_metrics(
    path: Path,
    metrics: dict[str, Any],
    records: dict[str, Any],
    headline: dict[str, Any] | None = None,
) -> None:
    """A stage's numbers (``path``, numbers only), its records (machine, config, names,
    curves) in ``<stem>_meta.json`` beside it and, given, its ``headline`` figures
    (``hope.report.headline``) in ``metrics/<name>`` under the same folder: the file DVC
    shows and diffs. Records first, the headline last, so a kill between two writes
    never leaves numbers without the records they were measured under, nor a headline
    ahead of the numbers it summarises."""
    bad = non_numbers(metrics) + non_numbers(headline or {})
    if bad:
        raise ValueError(f"{path}: metrics must be numbers only; move {', '.join(bad)} to records")
    atomic_write_json(meta_path(path), records)
    atomic_write_json(path, metrics)
    if headline is not None:
        atomic_write_json(headline_path(path), headline)


def headline_path(path: Path) -> Path:
    """Where the headline of the report at ``path`` goes: ``<folder>/metrics/<name>``."""
    return path.parent / "metrics" / path.name

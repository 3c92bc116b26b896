"""docs/FAITHFULNESS.md points at code and tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEDGER = (ROOT / "docs/FAITHFULNESS.md").read_text()


def _references() -> list[tuple[str, str | None]]:
    """Backticked `path.py` or `path.py::name` references (paths as written in the ledger)."""
    refs = []
    for path, name in re.findall(r"`([\w/]+\.py)(?:::([\w.]+))?`", LEDGER):
        refs.append((path, name or None))
    return refs


def _resolve(path: str) -> Path:
    for base in (ROOT / "tests", ROOT / "src/hope"):
        if (base / path).exists():
            return base / path
    raise AssertionError(f"ledger names a missing file: {path}")


def test_every_reference_exists() -> None:
    refs = _references()
    assert len(refs) > 60
    for path, name in refs:
        text = _resolve(path).read_text()
        if name is not None:
            leaf = name.split(".")[-1]
            assert re.search(rf"\b{re.escape(leaf)}\b", text), f"{path}::{name} not found"


def test_continued_test_names_exist() -> None:
    """Cells like "`test_x.py::test_a`, `::test_b`" name tests in the file named last before."""
    for cell in LEDGER.split("|"):
        current = None
        for path, bare in re.findall(r"`(?:(test_\w+\.py)::\w+|::(test_\w+))`", cell):
            if path:
                current = path
                continue
            assert current is not None, cell
            assert f"def {bare}(" in (ROOT / "tests" / current).read_text(), bare


def test_every_test_reference_is_a_test_function() -> None:
    for path, name in _references():
        if path.startswith("test_") and name is not None:
            assert f"def {name}(" in (ROOT / "tests" / path).read_text(), f"{path}::{name}"

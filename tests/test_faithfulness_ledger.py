"""docs/FAITHFULNESS.md points at code and tests that exist."""

from __future__ import annotations

import ast
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


def _rows() -> list[tuple[str, str]]:
    """(code cell, label cell) of every ledger table row."""
    rows = []
    for line in LEDGER.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] != "code" and not set(cells[1]) <= set("-"):
            rows.append((cells[1], cells[3]))
    return rows


def _definitions(path: Path) -> dict[str, tuple[int, int]]:
    """Qualified name (`f`, `Class`, `Class.method`, `Class.field`) -> its lines, with
    the comment block right above it."""
    lines = path.read_text().splitlines()
    spans: dict[str, tuple[int, int]] = {}

    def visit(nodes: list[ast.stmt], prefix: str) -> None:
        for node in nodes:
            names: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            while start > 1 and lines[start - 2].strip().startswith("#"):
                start -= 1
            for name in names:
                spans[prefix + name] = (start, node.end_lineno or node.lineno)
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(path.read_text()).body, "")
    return spans


def _source(path: Path, name: str) -> str:
    spans = _definitions(path)
    matches = [q for q in spans if q == name or q.endswith("." + name)]
    assert matches, f"{path.name}::{name} is not a definition"
    start, end = spans[matches[0]]
    return "\n".join(path.read_text().splitlines()[start - 1 : end])


def test_code_of_a_deviation_row_says_so() -> None:
    """Reading the code alone must not suggest the paper's equation where the ledger
    records a deviation: the named definition states it (and points at the ledger)."""
    checked = 0
    for code, label in _rows():
        if "deviation" not in label:
            continue
        for path, name in re.findall(r"`([\w/]+\.py)::([\w.]+)", code):
            text = _source(_resolve(path), name)
            assert re.search(r"deviation", text, re.I), f"{path}::{name} hides its deviation"
            checked += 1
    assert checked >= 8


def test_every_ledger_citation_in_the_code_resolves_to_its_row() -> None:
    """A definition whose comments or docstring cite docs/FAITHFULNESS.md is named in
    a row, and calls itself faithful only where that row says faithful."""
    named: dict[tuple[str, str], str] = {}
    for code, label in _rows():
        for path, name in re.findall(r"`([\w/]+\.py)::([\w.]+)", code):
            named[(path, name.split(".")[-1])] = label
    citing = 0
    for path in sorted((ROOT / "src/hope").rglob("*.py")):
        rel = str(path.relative_to(ROOT / "src/hope"))
        lines = path.read_text().splitlines()
        spans = _definitions(path)
        for number, line in enumerate(lines, start=1):
            if "FAITHFULNESS.md" not in line:
                continue
            owners = [q for q, (a, b) in spans.items() if a <= number <= b]
            assert owners, f"{rel}:{number} cites the ledger outside any definition"
            innermost = min(owners, key=lambda q: spans[q][1] - spans[q][0])
            label = named.get((rel, innermost.split(".")[-1]))
            assert label is not None, f"{rel}:{number}: no ledger row names {innermost}"
            says_faithful = re.search(r"\bfaithful\b", line, re.I) is not None
            assert not says_faithful or label.startswith("faithful"), (rel, number, label)
            citing += 1
    assert citing >= 4

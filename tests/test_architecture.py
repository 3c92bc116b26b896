"""The package's shape: who may import whom, no import cycles, every cited spec
section present in the repository, the variant table complete (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "hope"

# Layer -> the layers it may import (its own included). Base modules import nothing of
# the package beyond other base modules; the config layer is torch-free dataclasses.
# The memories see only their own typed configs (hope.memory.config), never the model's.
BASE = {"hope.errors", "hope.io", "hope.layers"}
CONFIG = {"hope.config", "hope.config_sections", "hope.model.config"}
ALLOWED = {
    "base": {"base"},
    "config": {"base", "config", "hope.memory"},
    "hope.memory": {"base", "hope.memory", "hope.optim"},
    "hope.optim": {"base", "config", "hope.optim", "hope.memory"},
    "hope.model": {"base", "config", "hope.memory", "hope.optim", "hope.model"},
}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    if module in BASE:
        return "base"
    if module in CONFIG:
        return "config"
    for layer in ("hope.optim", "hope.memory", "hope.model"):
        if module == layer or module.startswith(layer + "."):
            return layer
    return module


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Package modules imported by ``path`` (``from hope.x import y`` counts as hope.x,
    or hope.x.y when that is a module). Imports under ``if TYPE_CHECKING`` are skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes: list[ast.AST] = list(tree.body) if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hope")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hope"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_layers_import_only_what_they_may() -> None:
    wrong = []
    for module, path in MODULES.items():
        layer = _layer(module)
        if layer not in ALLOWED:
            continue
        for target in _imports(path, top_level_only=False):
            if _layer(target) not in ALLOWED[layer]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_modules() -> None:
    graph = {
        m: {t for t in _imports(p, top_level_only=True) if t in MODULES and t != m}
        for m, p in MODULES.items()
    }
    # A package's __init__ importing its own modules is not a cycle of the graph we care
    # about; drop edges from a package to its children.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    assert not _cycles(graph)


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_check_sees_a_lazy_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from hope.train.loop import train\n    return train\n")
    assert _imports(module, top_level_only=False) == {"hope.train.loop"}
    assert _imports(module, top_level_only=True) == set()


# Modules behind the stages that never wrap a model for several processes: they must
# start without torch.distributed's FSDP, whose import costs each stage ~1 s.
NO_FSDP_MODULES = (
    "hope.eval.run", "hope.eval.zeroshot", "hope.eval.harness", "hope.eval.niah",
    "hope.eval.longctx", "hope.eval.continual", "hope.eval.recall", "hope.bench.run",
    "hope.report.bundle", "hope.infer",
)  # fmt: skip


def _loads_fsdp(modules: typing.Iterable[str]) -> bool:
    """Whether a fresh interpreter that imports ``modules`` has loaded FSDP."""
    code = f"import sys, {', '.join(modules)}; print('torch.distributed.fsdp' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return run.stdout.strip() == "True"


def test_only_training_loads_fsdp() -> None:
    assert not _loads_fsdp(NO_FSDP_MODULES)
    assert _loads_fsdp(["hope.train.loop"])  # training may wrap the model: it loads it


def _mechanism_sections() -> set[str]:
    text = (ROOT / "docs" / "MECHANISMS.md").read_text()
    return set(re.findall(r"^#+ (\d+(?:\.\d+)*)[. ]", text, flags=re.M))


def test_every_cited_mechanisms_section_exists() -> None:
    sections = _mechanism_sections()
    assert {"1", "2", "3", "8.1", "8.3"} <= sections
    missing = []
    for path in [
        *SRC.rglob("*.py"),
        *(ROOT / "stages").glob("*.py"),
        *(ROOT / "tests").glob("*.py"),
    ]:
        for cited in re.findall(r"MECHANISMS §(\d+(?:\.\d+)*)", path.read_text()):
            if cited not in sections:
                missing.append(f"{path.relative_to(ROOT)}: §{cited}")
    assert not missing, missing


def test_every_cited_doc_exists() -> None:
    missing = []
    for path in [*SRC.rglob("*.py"), *(ROOT / "stages").glob("*.py")]:
        for doc in re.findall(r"\bdocs/([A-Z_]+\.md)", path.read_text()):
            if not (ROOT / "docs" / doc).is_file():
                missing.append(f"{path.relative_to(ROOT)}: docs/{doc}")
    assert not missing, missing


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


def test_variant_table_is_the_variant_literal() -> None:
    from hope.model.config import Variant
    from hope.model.zoo import BUILDERS, VARIANTS

    assert tuple(BUILDERS) == VARIANTS == typing.get_args(Variant)

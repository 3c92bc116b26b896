"""Shared fixtures: a clean copy of the repository for end-to-end pipeline runs.

`make test` runs the suite on every core with pytest-xdist (`--dist loadfile`):
each worker is pinned to one torch thread, so the workers share the machine
without oversubscribing it, and each test file runs on one worker, so the
end-to-end pipeline tests share one `dvc repro` (the `dvc_repo` fixture).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import hope
from hope.memory.fast_state import map_tensors
from hope.model.lm import LanguageModel

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Set by pytest-xdist in its workers; more than one worker shares the cores.
PARALLEL = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1

# The run CI's `make repro` builds: the default params (tiny preset, hope) with a
# short training and a cut-down eval and bench, one torch thread per process.
# Everything else (data, tokenizer, model, optimizer, every stage) is the default.
CI_RUN = {
    ("train", "steps"): 30,
    # Four rows of 128 tokens: 30 steps still take the validation loss below a uniform
    # guess (7.76 measured, ln V = 8.32), at 0.67 s a step instead of 1.16 s with eight.
    ("train", "batch_size"): 4,
    ("train", "num_threads"): 1,
    ("train", "val_every"): 10,
    ("train", "checkpoint_every"): 10,
    ("eval", "max_batches"): 4,
    ("eval", "passkey_trials"): 4,
    ("bench", "variants"): ["transformer", "hope"],
    ("bench", "shapes"): ["tiny"],
    ("bench", "warmup"): 1,
    ("bench", "steps"): 2,
    ("bench", "num_threads"): 1,
    # The projection has its own tests (test_projection.py, test_bench.py).
    ("bench", "project_presets"): [],
    ("recall", "variants"): ["transformer", "hope"],
    ("recall", "steps"): 4,
    ("recall", "batch_size"): 4,
    ("recall", "eval_every"): 2,
    ("recall", "eval_sequences"): 16,
    ("recall", "num_threads"): 1,
    ("zeroshot", "items"): 16,
    ("niah", "lengths"): [160],
    ("niah", "depths"): [0.0, 1.0],
    ("niah", "trials"): 2,
    ("longctx", "length"): 512,
    ("longctx", "sequences"): 2,
    ("continual", "segments"): ["json", "csv"],
    ("continual", "write_tokens"): 128,
    ("continual", "probe_tokens"): 32,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files holding slow tests first, each file's tests in their own order. Under
    `--dist loadfile --no-loadscope-reorder` (Makefile) the workers start on the long
    files and fill in with the short ones, instead of one worker running a long file
    alone at the end while the others wait (the order is the same in every worker)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def _one_thread_per_worker() -> Iterator[None]:
    """Under xdist, every test starts (and leaves) its worker at one torch thread: a
    stage run in-process sets the params' count, which must not outlive the test."""
    if PARALLEL:
        torch.set_num_threads(1)
    yield
    if PARALLEL:
        torch.set_num_threads(1)


# The classic LM shell (final RMSNorm, every init std 0.02): an untrained model then
# predicts near-uniformly, which some tests use as a check of their computation. The
# default shell starts by predicting the token it reads (docs/FAITHFULNESS.md).
CLASSIC_SHELL = ("model.final_norm=true", "model.embed_init_std=null")

TINY_VOCAB = 64
# The mechanism tests' shape: two layers of dim 16, CMS periods 4/8, SMT chunks 2/4,
# Titans chunk 4 (``tiny_lm``; tests/test_graph_capture.py).
TINY_SHAPE = (
    "model.dim=16",
    "model.n_layers=2",
    "model.n_heads=2",
    f"tokenizer.vocab_size={TINY_VOCAB}",
    "model.cms_periods=[4, 8]",
    "model.smt_chunk=2",
    "model.smt_mem_chunk=4",
    "model.titans_chunk=4",
)


@pytest.fixture
def compile_without_codegen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory backend "compile" traced and differentiated as ``torch.compile`` does
    (dynamo, AOT autograd), but run without inductor's C++ code generation, which costs
    minutes per set of graphs on 2 cores. For tests of what the compiled path computes
    and where it is reached. Inductor's own kernels: the Titans memory's chunk step in
    every run (test_titans_memory.py), the SMT's too with HOPE_TEST_INDUCTOR=1 (set by
    scripts/gpu_check.sh)."""
    from hope.memory.ops import dispatch

    if os.environ.get("HOPE_TEST_INDUCTOR") == "1":
        return

    def traced(fn: Any) -> Any:
        return torch.compile(fn, dynamic=False, backend="aot_eager")

    monkeypatch.setattr(dispatch, "_compiled", functools.cache(traced))


def tiny_lm(variant: str = "hope", *extra: str, seed: int = 0) -> LanguageModel:
    """A float64 two-layer model of dim 16 for mechanism tests: CMS periods 4/8, SMT
    chunks 2/4, Titans chunk 4, and inner rates large enough that every write shows."""
    cfg = hope.load_config(
        None,
        [
            f"model.variant={variant}",
            *TINY_SHAPE,
            "model.cms_lr=1.0",
            "model.smt_eta_scale=0.05",
            "model.smt_retention_init=0.9",
            *extra,
        ],
    )
    torch.manual_seed(seed)
    return hope.build_model(cfg.model).to(torch.float64)


F64 = torch.float64


def rand64(*shape: int, seed: int = 1) -> torch.Tensor:
    """A float64 standard-normal tensor, a pure function of (shape, seed)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rand_tokens(batch: int, length: int, seed: int = 1, vocab: int = TINY_VOCAB) -> torch.Tensor:
    """Token ids [batch, length] drawn from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)


def state_leaves(state: Any, path: str = "state") -> list[tuple[str, Any]]:
    """Every leaf of a nested state (tensors and static ints alike), with its path."""
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        fields = dataclasses.fields(state)
        return [x for f in fields for x in state_leaves(getattr(state, f.name), f"{path}.{f.name}")]
    if isinstance(state, (list, tuple)):
        return [x for i, item in enumerate(state) for x in state_leaves(item, f"{path}[{i}]")]
    if isinstance(state, dict):
        return [x for k, item in state.items() for x in state_leaves(item, f"{path}[{k!r}]")]
    return [(path, state)]


def assert_states_close(a: Any, b: Any, atol: float) -> None:
    """Same structure, same static counts, tensors equal to ``atol`` (shapes included)."""
    left, right = state_leaves(a), state_leaves(b)
    assert [p for p, _ in left] == [p for p, _ in right]
    for (path, x), (_, y) in zip(left, right, strict=True):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape, path
            torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=path)
        else:
            assert x == y, (path, x, y)


def select_samples(state: Any, index: slice) -> Any:
    """The state of samples ``index`` (every tensor leaf has a leading batch axis)."""
    return map_tensors(state, lambda t: t[index])


def make_bundle(root: Path, *extra: str) -> Path:
    """A release bundle of a tiny (hope unless ``extra`` says otherwise) untrained model
    with a real 512-piece BPE tokenizer trained on 30 built-in documents, under ``root``
    (``root/raw`` holds the documents, ``root/ckpt`` the checkpoint)."""
    import json

    from hope.config import Config, load_config
    from hope.data.download import run_download
    from hope.data.tokenizer import train_tokenizer
    from hope.report.bundle import build_bundle
    from hope.train.checkpoint import save_checkpoint

    cfg = Config()
    cfg.data.max_documents = 30
    cfg.data.val_fraction = 0.2
    run_download(cfg, root / "raw")
    cfg = load_config(
        ROOT / "params.yaml",
        ["tokenizer.vocab_size=512", "tokenizer.model_type=bpe", "model.dim=16",
         "model.n_layers=1", "model.n_heads=2", "release.name=hope-front", "data.seq_len=32",
         *extra],
    )  # fmt: skip
    train_tokenizer(cfg.tokenizer, root / "raw" / "train.jsonl", root / "tok")
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    ckpt = root / "ckpt"
    save_checkpoint(ckpt, 3, {"model": model.state_dict(), "config": cfg.to_dict(), "step": 3})
    reports = root / "reports"
    reports.mkdir()
    (reports / "train.json").write_text(json.dumps({"steps": 3, "val_subset_loss": 5.5}))
    (reports / "train_meta.json").write_text(json.dumps({"runtime": {}}))
    evaluation = {"val": {"loss": 5.5, "ppl": 245.0, "tokens": 64}, "step": 3, "passkey": {}}
    (reports / "eval.json").write_text(json.dumps(evaluation))
    (reports / "eval_meta.json").write_text(json.dumps({"variant": cfg.model.variant}))
    return build_bundle(cfg, ckpt, root / "tok", reports, root / "release")


# The shape of the make_bundle model, as --set overrides for a stage run on its layout.
BUNDLE_SHAPE = ["tokenizer.vocab_size=512", "tokenizer.model_type=bpe", "model.dim=16",
                "model.n_layers=1", "model.n_heads=2", "data.seq_len=32"]  # fmt: skip


def make_pipeline_layout(root: Path, *extra: str) -> Path:
    """``root`` laid out as the pipeline leaves it before the evaluation stages
    (data/raw/val.jsonl, data/tokenizer/spm.model, models/checkpoints/ of the untrained
    make_bundle model, ``extra`` its overrides); returns ``root``."""
    make_bundle(root / "made", *extra)
    (root / "data/raw").mkdir(parents=True)
    (root / "data/tokenizer").mkdir(parents=True)
    shutil.copy(root / "made/raw/val.jsonl", root / "data/raw/val.jsonl")
    shutil.copy(root / "made/tok/spm.model", root / "data/tokenizer/spm.model")
    shutil.copytree(root / "made/ckpt", root / "models/checkpoints")
    return root


def stage_argv(*sets: str) -> list[str]:
    """Arguments of a stage run on make_pipeline_layout: params.yaml, the bundle's
    shape, then ``sets``."""
    return ["--params", str(ROOT / "params.yaml"), *(f"--set={s}" for s in [*BUNDLE_SHAPE, *sets])]


def set_params(repo: Path, values: Mapping[tuple[str, str], object]) -> None:
    """Set ``(section, key) -> value`` in the copy's params.yaml; every key must exist."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for (section, key), value in values.items():
        assert key in params[section], f"params.yaml lacks {section}.{key}"
        params[section][key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def pipeline_env(home: Path) -> dict[str, str]:
    """Environment for pipeline subprocesses: this venv first, offline, no telemetry."""
    env = dict(os.environ)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        DVC_NO_ANALYTICS="1",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        GIT_AUTHOR_NAME="ci",
        GIT_AUTHOR_EMAIL="ci@example.invalid",
        GIT_COMMITTER_NAME="ci",
        GIT_COMMITTER_EMAIL="ci@example.invalid",
        XDG_CACHE_HOME=str(home / "xdg-cache"),
        OMP_NUM_THREADS="1" if PARALLEL else env.get("OMP_NUM_THREADS", "2"),
    )
    return env


def copy_repo(dest: Path) -> Path:
    """Copy the tracked and untracked-but-not-ignored files, then commit them in a new repo."""
    dest.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    env = pipeline_env(dest)
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "snapshot"],
    ):
        subprocess.run(cmd, cwd=dest, env=env, check=True)
    # Keep DVC's machine-wide site cache inside the test folder.
    site = dest.parent / f"{dest.name}-dvc-site"
    run(["dvc", "config", "--local", "core.site_cache_dir", str(site)], dest)
    return dest


def run(cmd: list[str], cwd: Path, timeout: float = 2400) -> subprocess.CompletedProcess[str]:
    """Run a pipeline command; on timeout kill its whole process group (no orphan stages)."""
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=pipeline_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.communicate()
            raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode})\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def dvc_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository copy on which the README's main command has run once, on the
    params of :data:`CI_RUN` (shared by the slow tests)."""
    repo = copy_repo(tmp_path_factory.mktemp("dvc") / "repo")
    set_params(repo, CI_RUN)
    run(["git", "commit", "-qam", "CI run params"], repo)
    # The README's main command, pointed at the venv running these tests. `-o` keeps
    # make from re-running its install step (which would re-point this venv's
    # editable install at the temporary copy); CI's `make test` has just installed it.
    stamp = BIN.parent / ".installed"
    run(["make", "-o", str(stamp), "repro", f"VENV={BIN.parent}"], repo)
    return repo

"""Checkpoints: atomic ``step_{step:07d}.pt`` files, loadable with ``weights_only=True``,
or (``train.checkpoint_format=sharded``) ``step_{step:07d}/`` directories of per-rank
shards (``hope.train.sharded``); both kinds are listed, verified and loaded here.

Everything stored is a tensor, dict, list, int, float, str, bool or None, so
``torch.load(weights_only=True)`` can read it back without unpickling code. Each file
gets a ``.sha256`` beside it, written after it; a checkpoint whose bytes no longer
match (truncated, bit rot, tampered) or that cannot be read is skipped, with a
warning, for the newest intact one (``latest_intact``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from hope.config import Config, config_from_dict
from hope.errors import StageError
from hope.io import atomic_write, atomic_write_text, sha256_file
from hope.model.lm import LanguageModel
from hope.model.zoo import build_model
from hope.train import sharded

log = logging.getLogger("hope.train")
CHECKPOINT_RE = re.compile(r"^step_(\d{7,})(\.pt)?$")  # a file (.pt) or a sharded directory
FINGERPRINT_SECTIONS = ("data", "tokenizer", "model", "optim", "train")


# Knobs that change how a run is observed, not what it computes: changing them
# must not throw away a resumable checkpoint.
# Knobs that do not change what is trained (a resume may change them; the world size
# and micro-batch size change only the order of floating-point sums; a CUDA graph
# replays the eager step's kernels).
OBSERVATION_KNOBS = (
    "log_every", "checkpoint_every", "keep_checkpoints", "wandb_mode", "wandb_project",
    "nproc_per_node", "nnodes", "parallel", "checkpoint_format", "cuda_graph",
)  # fmt: skip


def config_fingerprint(cfg: Config) -> str:
    data = cfg.to_dict()
    tree = {section: data[section] for section in FINGERPRINT_SECTIONS}
    for knob in OBSERVATION_KNOBS:
        tree["train"].pop(knob)
    blob = json.dumps(tree, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:07d}.pt"


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoints in ``ckpt_dir``, files and sharded directories, oldest step first
    (temp files and staging directories are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in ckpt_dir.iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir() == (m.group(2) is None)
    ]
    return [p for _, p in sorted(found)]


def find_checkpoint(ckpt_dir: Path, step: int) -> Path | None:
    """The checkpoint of ``step`` (either kind), or None."""
    return next((p for p in list_checkpoints(ckpt_dir) if step_of(p) == step), None)


def step_of(path: Path) -> int:
    match = CHECKPOINT_RE.match(path.name)
    assert match is not None, path
    return int(match.group(1))


def remove_checkpoint(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
        digest_path(path).unlink(missing_ok=True)


def prune(ckpt_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and staging left by a crash."""
    paths = list_checkpoints(ckpt_dir)
    for old in paths[: max(len(paths) - keep, 0)]:
        remove_checkpoint(old)
    for stale in Path(ckpt_dir).glob(".step_*.staging"):
        shutil.rmtree(stale, ignore_errors=True)


SUPERSEDED = "superseded"  # where a changed run's predecessor is kept, inside ckpt_dir


def aside_path(ckpt_dir: Path, payload: dict[str, Any]) -> Path:
    """Where the run that wrote ``payload`` is kept when a changed config or data
    starts a fresh one: ``<ckpt_dir>/superseded/<its fingerprint>-step<its step>``
    (``-2``, ``-3``... if that run was set aside before)."""
    name = f"{payload.get('fingerprint', 'unknown')}-step{int(payload.get('step', 0))}"
    base = Path(ckpt_dir) / SUPERSEDED / name
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{name}-{n}")
    return path


def set_aside(ckpt_dir: Path, aside: Path, reports: list[Path]) -> None:
    """Move every checkpoint of ``ckpt_dir`` (with its digest) and the ``reports`` that
    exist into ``aside`` (the reports as laid out under the folder they share, e.g.
    ``train.json`` and ``metrics/train.json``): renames within one file system, nothing
    copied or deleted, so the earlier run can be resumed by moving its files back."""
    aside.mkdir(parents=True)
    for path in list_checkpoints(ckpt_dir):
        for part in (path, digest_path(path)):
            if part.exists():
                part.replace(aside / part.name)
    shared = Path(os.path.commonpath([r.parent for r in reports])) if reports else aside
    for report in reports:
        if report.is_file():
            target = aside / report.relative_to(shared)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(report, target)  # reports/ may be another file system


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    paths = list_checkpoints(ckpt_dir)
    return paths[-1] if paths else None


def capture_rng_state() -> dict[str, Any]:
    """Every RNG the run could touch, as tensors and plain numbers."""
    _, mt_keys, mt_pos, has_gauss, cached_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(mt_keys, dtype=np.int64)),
            "pos": int(mt_pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gauss),
        },
        "python": {
            "version": int(py_version),
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``capture_rng_state`` saved. The states are host bytes wherever the
    checkpoint was mapped: a resume on CUDA loads it onto the GPU, and the generators
    take CPU tensors only (the H200 run's resume failed there)."""
    state = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, state)
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py_state = state["python"]
    internal = tuple(int(v) for v in py_state["internal"].tolist())
    random.setstate((py_state["version"], internal, py_state["gauss_next"]))


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _save_to(payload: dict[str, Any], path: Path) -> None:
    """``torch.save`` through a Python file, so that a full disk surfaces as the file's
    ``OSError`` (ENOSPC, EFBIG) behind torch's ``RuntimeError``, which ``atomic_write``
    reports as such; saving to a path fails inside C++ streams with no errno."""
    with open(path, "wb") as handle:
        torch.save(payload, handle)


def save_checkpoint(ckpt_dir: Path, step: int, payload: dict[str, Any], keep: int = 2) -> Path:
    """Write ``step_{step:07d}.pt`` atomically and its sha256 beside it, then delete all
    but the newest ``keep``. A kill at any instant leaves every older checkpoint intact."""
    if keep < 1:
        raise ValueError(f"train.keep_checkpoints={keep} must be >= 1")
    path = checkpoint_path(ckpt_dir, step)
    atomic_write(path, lambda tmp: _save_to(payload, tmp))
    atomic_write_text(digest_path(path), f"{sha256_file(path)}  {path.name}\n")
    prune(ckpt_dir, keep)
    return path


def save_sharded(
    ckpt_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any] | None,
    keep: int = 2,
) -> Path:
    """``step_{step:07d}/`` through ``sharded.save`` (every rank; rank 0 passes
    ``train_state``), then, on rank 0, all but the newest ``keep`` checkpoints go."""
    if keep < 1:
        raise ValueError(f"train.keep_checkpoints={keep} must be >= 1")
    final = Path(ckpt_dir) / f"step_{step:07d}"
    sharded.save(final, model, optimizer, train_state)
    if train_state is not None:
        prune(ckpt_dir, keep)
    return final


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be trusted (its recorded sha256 differs), or None. A file
    without a digest (a kill between the two renames, or an older run) is judged by
    whether it loads."""
    if path.is_dir():
        return sharded.problem(path)
    digest = digest_path(path)
    if not digest.is_file():
        return None
    recorded = digest.read_text().split()[0] if digest.read_text().strip() else ""
    if recorded != sha256_file(path):
        return f"{path.name}: its bytes do not match the sha256 recorded when it was saved"
    return None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint's payload; a sharded one's model and optimizer stay on disk
    (``payload["sharded"]`` names the directory; ``state_dicts.load`` reads them)."""
    if (problem := checkpoint_problem(path)) is not None:
        raise StageError(f"{path}: corrupt checkpoint ({problem})")
    try:
        if path.is_dir():
            payload = {**sharded.read_train_state(path, map_location), "sharded": str(path)}
        else:
            payload = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise StageError(f"{path}: cannot read checkpoint: {err}") from None
    has_weights = isinstance(payload, dict) and ("model" in payload or "sharded" in payload)
    if not has_weights or "config" not in payload:
        raise StageError(f"{path}: not a training checkpoint (missing model/config)")
    return payload


def latest_intact(
    ckpt_dir: Path, map_location: str | torch.device = "cpu"
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads, and its payload; newer broken
    ones are skipped with a warning naming them. None when there is no checkpoint;
    a StageError listing every problem when none is intact."""
    problems = []
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            payload = load_checkpoint(path, map_location)
        except StageError as err:
            problems.append(str(err))
            log.warning("skipping %s", err)
            continue
        if problems:
            log.warning("falling back to %s, the newest intact checkpoint", path.name)
        return path, payload
    if problems:
        raise StageError(f"no intact checkpoint in {ckpt_dir}: {'; '.join(problems)}")
    return None


def load_model(
    ckpt_dir: Path, map_location: str | torch.device = "cpu", step: int | None = None
) -> tuple[LanguageModel, Config, int]:
    """Rebuild the model of the newest intact checkpoint (or the one of ``step``) from
    its config and weights."""
    if step is not None:
        path = find_checkpoint(Path(ckpt_dir), step)
        if path is None:
            kept = ", ".join(str(step_of(p)) for p in list_checkpoints(Path(ckpt_dir)))
            raise StageError(
                f"no checkpoint of step {step} in {ckpt_dir} (kept: {kept or 'none'}; "
                "train.checkpoint_every and train.keep_checkpoints decide which are kept)"
            )
        payload = load_checkpoint(path, map_location)
    else:
        found = latest_intact(Path(ckpt_dir), map_location)
        if found is None:
            raise StageError(f"no checkpoint (step_*) in {ckpt_dir}; run `python stages/train.py`")
        _, payload = found
    cfg = config_from_dict(payload["config"])
    model = build_model(cfg.model).to(map_location)
    if "sharded" in payload:
        sharded.load_weights(Path(payload["sharded"]), model)
    else:
        model.load_state_dict(payload["model"])
    model.eval()
    return model, cfg, int(payload["step"])

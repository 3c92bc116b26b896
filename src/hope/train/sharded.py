"""Sharded checkpoints (``train.checkpoint_format=sharded``): every rank writes its own
shards through torch.distributed.checkpoint, nothing is gathered on one host.

A checkpoint is the directory ``step_{step:07d}/``: DCP's files (``.metadata`` and one
``*.distcp`` per rank) with the model and optimizer state (names as
``get_state_dict`` gives them: FSDP2's DTensor shards, or whole tensors without
FSDP), ``train_state.pt`` (rank 0: step, scheduler, RNG, log rows, config; loadable
with ``weights_only=True``) and ``SHA256SUMS`` over all of them, written last.

Atomic: the ranks write into ``.step_{step:07d}.staging/``; rank 0 renames it to its
final name only once every rank has finished, so a crash mid-save leaves the older
checkpoints as they were (and the staging directory, removed by the next save).
DCP reshards on load, so a run resumes on any world size, FSDP or not; the release
reads the weights into a plain model on one process (``load_weights``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hope.io import sha256_file

TRAIN_STATE = "train_state.pt"
MANIFEST = "SHA256SUMS"


def staging_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.staging")


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call outside a process group that it assumes one process: so
    does this module, on purpose (one-process runs, eval, release)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _in_group():
        dist.barrier()


def save(
    final: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any] | None,
) -> None:
    """Every rank calls this (DCP's save is a collective); rank 0 passes
    ``train_state`` and publishes the directory."""
    staging = staging_dir(final)
    main = train_state is not None
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=staging, no_dist=not _in_group())
    _barrier()  # every rank's shards are on disk
    if main:
        torch.save(train_state, staging / TRAIN_STATE)
        sums = "".join(
            f"{sha256_file(p)}  {p.name}\n" for p in sorted(staging.iterdir()) if p.is_file()
        )
        (staging / MANIFEST).write_text(sums)
        _fsync_tree(staging)
        if final.exists():  # the same step saved again (a rewind)
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(final.parent)
    _barrier()


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be trusted (a file missing or changed since it was saved), or
    None."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"{folder.name}: no {MANIFEST} (not a finished sharded checkpoint)"
    for line in manifest.read_text().splitlines():
        digest, name = line.split("  ", 1)
        path = folder / name
        if not path.is_file():
            return f"{folder.name}: {name} is missing"
        if sha256_file(path) != digest:
            return f"{folder.name}: {name} does not match the sha256 recorded when it was saved"
    return None


def read_train_state(folder: Path, map_location: str | torch.device) -> dict[str, Any]:
    state = torch.load(folder / TRAIN_STATE, map_location=map_location, weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{folder / TRAIN_STATE}: not a training state")
    return state


def _saved_optimizer_state(optim_sd: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The optimizer template without the parameters the checkpoint has no state for:
    ``get_state_dict`` creates state for every parameter (a zero-lr step), while a
    parameter that never had a gradient has none in the saved run."""
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {
        fqn: values
        for fqn, values in optim_sd["state"].items()
        if all(f"optimizer.state.{fqn}.{key}" in saved for key in values)
    }
    return {**optim_sd, "state": state}


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: read the model and optimizer state into this run's (sharded or
    whole) tensors, whatever the world size that saved them."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": _saved_optimizer_state(optim_sd, folder)}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=folder, no_dist=not _in_group())
    set_model_state_dict(model, state["model"])
    # A parameter without saved state (it never had a gradient) starts without any,
    # as torch's own optimizer.load_state_dict does.
    options = StateDictOptions(strict=False)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def load_weights(folder: Path, model: nn.Module) -> None:
    """The model weights alone into a plain model on one process (eval, release)."""
    state = {"model": model.state_dict()}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    model.load_state_dict(state["model"])

"""The model and optimizer state a checkpoint holds: whole tensors in one file, whatever
the parallelism, so a run resumes on any world size and the release reads it as is.

Under ``train.parallel=ddp`` (and on one device) they are torch's own state dicts, the
optimizer's keyed by parameter index ("by_index"). Under ``fsdp`` the shards are
gathered through torch.distributed.checkpoint's state-dict API (``full_state_dict``,
rank 0 receives them on the CPU) and the optimizer state is keyed by parameter name
("by_name"), the layout that API loads back into sharded parameters. A checkpoint of
one layout resumes under the other: ``load`` converts through a plain copy of the
model and optimizer on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hope.train import sharded

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
LOAD_FULL = StateDictOptions(full_state_dict=True)


def _load_options(strict: bool = True) -> StateDictOptions:
    """Whole tensors in; under a process group they are split into each rank's shards
    (every rank read the same file; rank 0's copy is the one distributed). A parameter
    that never had a gradient has no AdamW state, which torch's own
    optimizer.load_state_dict accepts: so ``strict=False`` for the optimizer."""
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=group, strict=strict)


Rebuild = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]


def layout(by_name: bool) -> str:
    return "by_name" if by_name else "by_index"


def gather(
    model: nn.Module, optimizer: torch.optim.Optimizer, by_name: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts; ``by_name``: a collective every rank calls, after
    which rank 0 holds the whole tensors on the CPU (the others: empty dicts)."""
    if not by_name:
        return model.state_dict(), optimizer.state_dict()
    model_sd = get_model_state_dict(model, options=FULL)
    return model_sd, get_optimizer_state_dict(model, optimizer, options=FULL)


def load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    payload: dict[str, Any],
    by_name: bool,
    rebuild: Rebuild,
) -> None:
    """Load ``payload["model"]`` and ``payload["optimizer"]`` (of either layout), or a
    sharded checkpoint's (``payload["sharded"]``, every rank reads its own part)."""
    if "sharded" in payload:
        sharded.load(Path(payload["sharded"]), model, optimizer)
        return
    model_sd, optim_sd = payload["model"], payload["optimizer"]
    saved = payload.get("optimizer_layout", "by_index")
    if saved == layout(by_name) == "by_index":
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    if saved == "by_index":  # to names, through a plain copy (before the loads below,
        plain_model, plain_optim = rebuild()  # which may turn model_sd into shards)
        plain_model.load_state_dict(model_sd)
        plain_optim.load_state_dict(optim_sd)
        optim_sd = get_optimizer_state_dict(plain_model, plain_optim, options=LOAD_FULL)
    if by_name:
        set_model_state_dict(model, model_sd, options=_load_options())
    else:
        model.load_state_dict(model_sd)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=_load_options(strict=False))

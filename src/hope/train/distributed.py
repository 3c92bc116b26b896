"""Data parallelism on torch.distributed (DDP), started by torchrun.

Exact by construction: every memory's fast state is per sample, so a rank that trains
on its slice of the global batch computes exactly the gradients of those rows, and
DDP's averaged gradient is the whole batch's (equal rows per rank). The global batch
at step s is the same token rows whatever the world size or micro-batch size
(batches are a pure function of ``(train.seed, step)``; each rank takes its rows).

``python stages/train.py`` with ``train.nproc_per_node > 1`` re-launches itself through
``torch.distributed.run`` (``hope.train.launch``: one node, or one copy per node meeting
at a rendezvous); under an existing torchrun environment — ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK`` — it joins the process group instead. Rank 0 alone writes checkpoints and reports.

``train.parallel=fsdp``: FSDP2 (``fully_shard``) instead of DDP. Parameters, gradients
and AdamW state are sharded over the ranks at rest; each block is an FSDP unit (and each
memory's initial weights, kept gathered through the step: a fresh state holds views of
them), the model's ``shard_units``; HOPE's teach pass A gathers every block at once
(``LanguageModel.blocks_gathered``: its gradient is taken inside the forward;
docs/SCALING.md). bf16 comes from autocast as on one device, the parameters gathered
in their dtype and gradients reduced in it (fp32), unless ``train.fsdp_param_dtype=bf16``
gathers the blocks in bf16 (gradients still reduced in fp32; the memory inits and the
root stay fp32). Checkpoints are gathered to the same single file as ever
(``full_state_dict``), so a run resumes on any world size and the release reads it
unchanged; the optimizer state is stored by parameter name (``state_dicts``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.nn.parallel import DistributedDataParallel

from hope.config import Config
from hope.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch (``check_world`` made them equal)."""
        per_rank = batch_size // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def from_environment() -> DistEnv:
    """The torchrun environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    return DistEnv(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))


def check_world(cfg: Config, env: DistEnv) -> None:
    """Refuse what data parallelism cannot keep exact, naming the knob."""
    if not env.enabled:
        return
    batch = cfg.train.batch_size
    if batch % env.world_size:
        raise ConfigError(
            f"train.batch_size={batch} must be a multiple of the world size {env.world_size} "
            "(every rank trains the same number of rows of the global batch)"
        )
    micro = cfg.train.micro_batch_size
    if micro is not None and micro > batch // env.world_size:
        raise ConfigError(
            f"train.micro_batch_size={micro} exceeds the {batch // env.world_size} rows per "
            f"rank (train.batch_size={batch} over {env.world_size} processes)"
        )


def device_for(env: DistEnv, device: torch.device) -> torch.device:
    """On CUDA each rank takes its local GPU."""
    if env.enabled and device.type == "cuda":
        return torch.device("cuda", env.local_rank)
    return device


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device) -> Iterator[None]:
    """Join the process group for the duration of a run (NCCL on GPU, gloo on CPU)."""
    if not env.enabled or dist.is_initialized():
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class TrainingLoss(nn.Module):
    """``model.training_loss`` as a module's forward: what DDP wraps, so its reducer
    sees every forward (DDP hooks only ``forward``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.training_loss(tokens, targets)  # type: ignore[operator]


Wrapped = DistributedDataParallel | FSDPModule


def wrap(
    model: nn.Module,
    env: DistEnv,
    device: torch.device,
    parallel: str = "ddp",
    block_dtype: torch.dtype | None = None,
) -> Wrapped | None:
    """DDP or FSDP2 over ``TrainingLoss(model)``, or None for a single process. Build the
    optimizer after this: FSDP2 replaces the parameters by sharded DTensors.
    ``block_dtype`` (FSDP2 only; ``train.fsdp_param_dtype``): the blocks' parameters are
    gathered and computed in it, their gradients reduced in fp32."""
    if not env.enabled:
        return None
    if parallel == "fsdp":
        # One FSDP unit per block and per memory init (the model's ``shard_units``),
        # the rest in the root's. Parameters stay in their dtype (fp32; fp64 in tests)
        # unless ``block_dtype`` gathers the blocks' in bf16; bf16 compute is
        # autocast's, as on one device.
        # FSDP2 warns when a unit returns views (a fresh state's W0.expand, state
        # slices): an in-place op on one would skip its pre-backward hook. The states
        # are never edited in place; tests/test_distributed_variants.py checks every
        # variant against one process to 1e-10.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        # Inputs are not cast: a block's inputs include its fast state (fp32).
        blocks_policy = MixedPrecisionPolicy(
            param_dtype=block_dtype,
            reduce_dtype=None if block_dtype is None else torch.float32,
            cast_forward_inputs=False,
        )
        for unit in cast(Any, model).shard_units():
            policy = blocks_policy if unit.free_after_forward else MixedPrecisionPolicy()
            fully_shard(
                unit.module, reshard_after_forward=unit.free_after_forward, mp_policy=policy
            )
            for method in unit.methods:
                register_fsdp_forward_method(unit.module, method)
        root = TrainingLoss(model)
        fully_shard(root)
        return cast(FSDPModule, root)
    ids = [device.index] if device.type == "cuda" else None
    # Some configurations leave parameters out of a step's graph (a write whose chunk
    # ends with the sequence, write_grad=stopgrad, a static CMS in training): DDP must
    # look for them, or its reducer waits for gradients that never come.
    return DistributedDataParallel(TrainingLoss(model), device_ids=ids, find_unused_parameters=True)


def accumulating(wrapped: Wrapped | None, last: bool) -> contextlib.AbstractContextManager[None]:
    """Gradient accumulation: ranks synchronise gradients only at the last micro-batch."""
    if isinstance(wrapped, FSDPModule):
        wrapped.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if wrapped is not None and not last:
        return cast(contextlib.AbstractContextManager[None], wrapped.no_sync())
    return contextlib.nullcontext()


def is_sharded(wrapped: Wrapped | None) -> bool:
    return isinstance(wrapped, FSDPModule)


def all_reduce_sum(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum over ranks (a log-step collective; identity for one process)."""
    if env.enabled:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value

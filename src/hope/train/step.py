"""One optimizer step and one loss evaluation, with micro-batching and mixed precision.

``train_step`` is the whole training step (no host sync: the loss stays on the device);
``evaluate_loss`` the validation mean; both split a batch into micro-batches of rows.
``step_where`` applies an optimizer step only where a device flag says so (the
``train.nan_policy=skip`` step), again without reading the flag on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from hope.model.lm import LanguageModel
from hope.optim.groups import HybridOptimizer

if TYPE_CHECKING:
    from hope.train.distributed import Wrapped


def _accumulating(ddp: Wrapped | None, last: bool) -> contextlib.AbstractContextManager[None]:
    """``hope.train.distributed.accumulating``, that module loaded only with a wrapper:
    it imports torch.distributed's FSDP, ~0.6 s of every eval stage's start."""
    if ddp is None:
        return contextlib.nullcontext()
    from hope.train.distributed import accumulating

    return accumulating(ddp, last)


def autocast(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    # A CUDA graph cannot keep autocast's cache of cast weights between replays
    # (hope.train.graphed): recast inside a capture. A host query, no sync.
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=not capturing)


def micro_slices(rows: int, micro_batch: int | None) -> list[slice]:
    """Row slices of a batch of ``rows`` in micro-batches of ``micro_batch`` (the last may
    be smaller; None: one slice). Static Python ints: no device reads."""
    size = rows if micro_batch is None else micro_batch
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def train_step(
    model: LanguageModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_clip: float,
    amp_dtype: torch.dtype | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    micro_batch: int | None = None,
    ddp: Wrapped | None = None,
    skip_nonfinite: bool = False,
) -> torch.Tensor:
    """One optimizer step on batch (x, y) [B, T]; returns the detached loss, still on device.

    ``loss_fn(x, y)`` replaces ``model.training_loss`` (e.g. a loss on some positions only);
    either must be a mean over rows of equal weight. ``micro_batch``: gradient
    accumulation over row slices of that size, each weighted by its share of the rows,
    so the gradient is the whole batch's (fast state is per sample: the slices are
    independent) and only one slice's activations are alive at a time. ``ddp``: the
    DDP or FSDP2 wrapper of the loss (``hope.train.distributed``); gradients are
    averaged over ranks once, at the last slice. ``skip_nonfinite``: when the
    gradient norm is not finite, parameters and optimizer state stay as they were (the
    scheduler still advances) and the returned loss is NaN; decided on the device from
    the reduced gradients, so every rank skips together. ``scheduler``: stepped after
    the optimizer; None leaves it to the caller (a captured step: the learning rate
    must change outside the graph, ``hope.train.graphed``).
    """
    optimizer.zero_grad(set_to_none=True)
    rows = x.shape[0]
    total: torch.Tensor | None = None
    parts = micro_slices(rows, micro_batch)
    compute: Callable[..., torch.Tensor] = (
        cast(Any, ddp) if ddp is not None else (loss_fn or model.training_loss)
    )
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        with _accumulating(ddp, last):
            with autocast(x.device, amp_dtype):
                loss = compute(x[part], y[part])
            weight = (part.stop - part.start) / rows
            (loss * weight if weight != 1.0 else loss).backward()
        share = loss.detach() * weight
        total = share if total is None else total + share
    assert total is not None
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]  # (the check again, for mypy)
    norm = None
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if skip_nonfinite:
        if norm is None:
            norm = torch.nn.utils.get_total_norm(grads)
        ok = torch.isfinite(norm)
        step_where(optimizer, ok)
        total = torch.where(ok, total, torch.full_like(total, float("nan")))
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return total


def step_where(optimizer: torch.optim.Optimizer, ok: torch.Tensor) -> None:
    """``optimizer.step()`` where the 0-dim bool ``ok`` holds; otherwise parameters and
    tensor state are left exactly as they were. Fused Adam/AdamW skip on the device
    through their ``found_inf`` input (what torch's GradScaler uses); any other
    optimizer steps and is restored from a copy of its parameters and state (one
    extra copy's memory and traffic). Host-side counters of such an optimizer (M3's
    group step, like the lr schedule) still advance."""
    parts = optimizer.parts.values() if isinstance(optimizer, HybridOptimizer) else [optimizer]
    for part in parts:
        if isinstance(part, torch.optim.Adam) and part.defaults.get("fused"):
            part.found_inf = (~ok).to(torch.float32)  # type: ignore[attr-defined]
            try:
                part.step()
            finally:
                del part.found_inf  # type: ignore[attr-defined]
        else:
            _restoring_step(part, ok)


def _step_tensors(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    """Every parameter and tensor state of ``optimizer``, keyed by (param index, name)."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        found[(index, "")] = param
        for name, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                found[(index, name)] = value
    return found


@torch.no_grad()
def _restoring_step(optimizer: torch.optim.Optimizer, ok: torch.Tensor) -> None:
    saved = {key: t.clone() for key, t in _step_tensors(optimizer).items()}
    optimizer.step()
    for key, tensor in _step_tensors(optimizer).items():
        # State created by this very step starts from zeros (torch optimizers' init).
        before = saved.get(key)
        tensor.copy_(
            torch.where(ok, tensor, torch.zeros_like(tensor) if before is None else before)
        )


@torch.no_grad()
def evaluate_loss(
    model: LanguageModel,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    amp_dtype: torch.dtype | None,
    micro_batch: int | None = None,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mean CE per target token over the batches (the last may be smaller), on device;
    each batch in row slices of ``micro_batch`` (bounded memory, same value).
    ``compute``: the loss module to call (an FSDP2 root gathers its shards in its
    forward); default ``model.training_loss``."""
    compute = compute or model.training_loss
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    for x, y in batches:
        for part in micro_slices(x.shape[0], micro_batch):
            with autocast(device, amp_dtype):
                loss = compute(x[part].to(device), y[part].to(device))
            total += loss.double() * y[part].numel()
            count += y[part].numel()
    model.train(was_training)
    return total / max(1, count)


def rank_share_sums(
    model: LanguageModel,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    micro_batch: int | None,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """(sum of CE over target tokens, target tokens) of rank ``rank``'s share of every
    batch's rows, float64 on device: summed over ranks, the mean of ``evaluate_loss``.
    With ``compute`` (an FSDP2 root) every rank joins every forward's gathers, so a rank
    with no rows of a batch scores one row with weight 0."""
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in batches:
        share = micro_slices(x.shape[0], -(-x.shape[0] // world))
        idle = rank >= len(share)
        if idle and compute is None:
            continue
        part = slice(0, 1) if idle else share[rank]
        mean = evaluate_loss(model, [(x[part], y[part])], device, amp_dtype, micro_batch, compute)
        weight = 0 if idle else y[part].numel()
        total[0] += mean * weight
        total[1] += weight
    return total

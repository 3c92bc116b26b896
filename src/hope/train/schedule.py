"""Learning-rate schedule: linear warmup, then cosine decay to lr * min_lr_ratio."""

from __future__ import annotations

import math

import torch

from hope.config import OptimConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr used by optimizer step ``step`` (0-based).

    Warmup reaches 1.0 at step ``warmup_steps - 1``; the cosine ends at ``min_lr_ratio``
    at step ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def current_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> float:
    """The first param group's learning rate for the next step, as a host float, from
    the schedule's own state: the same value as the group's ``lr`` (LambdaLR sets it to
    base x factor), read without touching the device, also where it lives in a device
    tensor (``train.cuda_graph``, hope.train.graphed)."""
    return float(scheduler.base_lrs[0]) * scheduler.lr_lambdas[0](scheduler.last_epoch)

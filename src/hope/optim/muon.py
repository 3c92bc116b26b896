"""Muon hybrid outer optimizer: ``torch.optim.Muon`` on hidden matrices, AdamW on the rest.

MECHANISMS §6 ("None Linear Outputs": W <- W + NS(m(u)) is Muon). We wrap
``torch.optim.Muon`` (torch >= 2.9) rather than re-implementing it. Facts about
it that shape this module (torch 2.13):

- it accepts only exactly 2-D parameters (``ValueError`` otherwise), so >2-D
  matrices of the partition (e.g. conv kernels) are handed to AdamW here;
- momentum is an EMA, ``B <- mu B + (1 - mu) g``, with Nesterov ``g.lerp(B, mu)``
  by default; the quintic Newton–Schulz (a, b, c) = (3.4445, -4.775, 2.0315),
  5 steps, runs in bfloat16 on G / ||G||_F;
- weight decay is decoupled, ``theta *= 1 - lr * wd``; the step is
  ``lr * sqrt(max(1, rows / cols))`` ("original" lr adjustment);
- no ``.item()`` in its single-tensor path (it has no for-each path), so a
  step stays free of host syncs.

The two parts keep separate learning rates (``optim.muon_lr`` vs ``optim.lr``):
MECHANISMS §6 flags Ref's shared lr as risky, since an orthogonalised update
and an Adam update have unrelated scales.
"""

from __future__ import annotations

import torch
from torch import nn

from hope.config import OptimConfig
from hope.optim.groups import (
    HybridOptimizer,
    adamw_groups,
    partition_params,
    require_knobs,
)


def build_muon_hybrid(model: nn.Module, optim_cfg: OptimConfig) -> HybridOptimizer:
    """One optimizer: parts ``"muon"`` (2-D hidden matrices) and ``"adamw"`` (the rest)."""
    require_knobs(
        optim_cfg,
        {
            "muon_lr": optim_cfg.muon_lr >= 0.0,
            "muon_momentum": 0.0 <= optim_cfg.muon_momentum < 1.0,
            "muon_weight_decay": optim_cfg.muon_weight_decay >= 0.0,
        },
    )
    part = partition_params(model)
    muon_params = [(n, p) for n, p in part.matrix if p.ndim == 2]
    adamw_params = part.other + [(n, p) for n, p in part.matrix if p.ndim != 2]
    parts: dict[str, torch.optim.Optimizer] = {}
    if muon_params:
        parts["muon"] = torch.optim.Muon(
            [p for _, p in muon_params],
            lr=optim_cfg.muon_lr,
            weight_decay=optim_cfg.muon_weight_decay,
            momentum=optim_cfg.muon_momentum,
            nesterov=True,
        )
    groups = adamw_groups(adamw_params, optim_cfg.weight_decay, part.embedding_ids)
    if groups:
        parts["adamw"] = torch.optim.AdamW(
            groups,
            lr=optim_cfg.lr,
            betas=(optim_cfg.beta1, optim_cfg.beta2),
            eps=optim_cfg.eps,
            fused=True,  # as hope.optim.outer: no per-step .item() on step counters
        )
    if not parts:
        raise ValueError("build_muon_hybrid: the model has no trainable parameters")
    return HybridOptimizer(parts)

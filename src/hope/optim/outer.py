"""The outer (meta-parameter) optimizer: AdamW with decay only on matrices.

Weight decay applies to >=2-D weights that are not embeddings (the tied embedding
doubles as the LM head; decaying it shrinks the logits, as in nanoGPT/torchtitan).
Norm gains, biases and gates are left undecayed.
"""

from __future__ import annotations

import torch
from torch import nn

from hope.config import OptimConfig
from hope.errors import ConfigError
from hope.optim.groups import adamw_groups, embedding_ids, trainable_named
from hope.optim.m3 import build_m3_hybrid
from hope.optim.muon import build_muon_hybrid


def split_decay_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, undecayed) trainable parameters, each listed once (tied weights too)."""
    decay, no_decay = adamw_groups(trainable_named(model), 1.0, embedding_ids(model))
    return list(decay["params"]), list(no_decay["params"])


def build_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    groups = adamw_groups(trainable_named(model), cfg.weight_decay, embedding_ids(model))
    # fused: one kernel per step and, unlike the for-each path, no per-step `.item()`
    # on the step counters (keeps the training step free of host syncs).
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True
    )


def build_optimizer(model: nn.Module, optim_cfg: OptimConfig) -> torch.optim.Optimizer:
    if optim_cfg.name == "adamw":
        return build_adamw(model, optim_cfg)
    if optim_cfg.name == "muon":
        return build_muon_hybrid(model, optim_cfg)
    if optim_cfg.name == "m3":
        return build_m3_hybrid(model, optim_cfg)
    raise ConfigError(f"optim.name {optim_cfg.name!r} is not available; available: adamw, muon, m3")

"""The outer (meta-parameter) optimizer: AdamW with decay only on matrices.

Weight decay applies to >=2-D weights that are not embeddings (the tied embedding
doubles as the LM head; decaying it shrinks the logits, as in nanoGPT/torchtitan).
Norm gains, biases and gates are left undecayed.
"""

from __future__ import annotations

import torch
from torch import nn

from hope.config import ConfigError, OptimConfig
from hope.optim.m3 import build_m3_hybrid
from hope.optim.muon import build_muon_hybrid


def split_decay_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, undecayed) trainable parameters, each listed once (tied weights too)."""
    embedding_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    }
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():  # parameters() already de-duplicates shared tensors
        if not param.requires_grad:
            continue
        if param.dim() >= 2 and id(param) not in embedding_ids:
            decay.append(param)
        else:
            no_decay.append(param)
    return decay, no_decay


def build_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = split_decay_params(model)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
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
    raise ConfigError(
        f"optim.name {optim_cfg.name!r} is not available; available: adamw, muon, m3"
    )

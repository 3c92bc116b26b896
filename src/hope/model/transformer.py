"""Pre-norm transformer block (MECHANISMS §1, variant ``transformer``) and its builder."""

from __future__ import annotations

import torch
from torch import nn

from hope.layers import MLP, swiglu_hidden
from hope.memory.norm import RMSNorm
from hope.model.attention import CausalSelfAttention, KVCache
from hope.model.config import ModelConfig
from hope.model.lm import LanguageModel


class TransformerBlock(nn.Module):
    """x += Attn(N(x)); x += MLP(N(x)) (Ti §4.4: residual around every sub-layer)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = CausalSelfAttention(
            cfg.dim, cfg.n_heads, cfg.rope_base, cfg.qk_norm, cfg.norm_eps
        )
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg.dim, swiglu_hidden(cfg.dim, cfg.mlp_ratio), "swiglu")

    def init_state(self, batch_size: int, device: torch.device) -> KVCache:
        dtype = self.attn.qkv.weight.dtype
        return self.attn.init_state(batch_size, device, dtype)

    def forward(
        self, x: torch.Tensor, state: KVCache | None, pos: int
    ) -> tuple[torch.Tensor, KVCache]:
        attn_out, state = self.attn(self.attn_norm(x), state, pos)
        x = x + attn_out
        x = x + self.mlp(self.mlp_norm(x))
        return x, state


def build_transformer(cfg: ModelConfig) -> LanguageModel:
    blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
    return LanguageModel(cfg, blocks)

"""Causal multi-head self-attention with rotary positions and a KV cache for streaming."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hope.layers import rotary_tables
from hope.memory.norm import RMSNorm
from hope.memory.ops.dispatch import rotated
from hope.memory.pieces import PieceGrid


@dataclass
class KVCache:
    """Keys and values of every token seen so far in this context.

    ``valid`` [B, T_past] (bool) marks the cached keys each sample may still attend
    to; None = all of them. A per-sample reset (``LanguageModel.reset_state``) clears
    a sample's row, so its next tokens attend only to themselves and later tokens:
    with rotary scores depending on relative positions only, that is a fresh context.
    """

    k: torch.Tensor  # [B, H, T_past, D]
    v: torch.Tensor  # [B, H, T_past, D]
    valid: torch.Tensor | None = None  # [B, T_past] bool

    def reset_where(self, fresh: KVCache, reset_mask: torch.Tensor) -> KVCache:
        """Forget the cached keys of the samples with reset_mask [B] True."""
        del fresh  # a new context's cache is empty: nothing of it to copy
        batch, _, past, _ = self.k.shape
        if reset_mask.shape != (batch,):
            raise ValueError(
                f"reset mask shape {tuple(reset_mask.shape)} does not match batch {batch}"
            )
        valid = self.valid
        if valid is None:
            valid = torch.ones(batch, past, dtype=torch.bool, device=self.k.device)
        return KVCache(self.k, self.v, valid & ~reset_mask.to(torch.bool)[:, None])


def extend_valid(cache: KVCache | None, batch: int, length: int) -> torch.Tensor | None:
    """Key validity [B, past+T] after appending T new keys (always valid); None while no
    sample of the cache was ever reset (every key valid, the mask-free fast path)."""
    if cache is None or cache.valid is None:
        return None
    new = torch.ones(batch, length, dtype=torch.bool, device=cache.valid.device)
    return torch.cat((cache.valid, new), dim=1)


class CausalSelfAttention(nn.Module):
    def __init__(
        self,
        dim: int,
        n_heads: int,
        rope_base: float = 10000.0,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if dim % n_heads != 0:
            raise ValueError(f"dim={dim} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        if self.head_dim % 2 != 0:
            raise ValueError(f"head dim {self.head_dim} must be even for rotary embedding")
        self.rope_base = rope_base
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.out.residual_projection = True  # type: ignore[assignment]
        # Optional per-head RMSNorm of q and k (MECHANISMS §1 "q/k norm").
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        empty = torch.zeros(batch_size, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(k=empty, v=empty.clone())

    def project(
        self, x: torch.Tensor, cache: KVCache | None, pos: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """q [B, H, T, D] and k, v [B, H, past+T, D] (cache first), rotated; past.
        Key validity: ``extend_valid(cache, B, T)``."""
        batch, length, _ = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary_tables(self.head_dim, pos, length, self.rope_base, x.device, q.dtype)
        q, k = rotated(q, cos, sin), rotated(k, cos, sin)
        past = 0 if cache is None else cache.k.shape[2]
        if past > 0 and cache is not None:
            k = torch.cat((cache.k.to(k.dtype), k), dim=2)  # [B, H, past+T, D]
            v = torch.cat((cache.v.to(v.dtype), v), dim=2)
        return q, k, v, past

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, H, T, D] -> output projection of the merged heads [B, T, d]."""
        batch, _, length, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim))

    def forward(
        self, x: torch.Tensor, cache: KVCache | None, pos: int
    ) -> tuple[torch.Tensor, KVCache]:
        """x [B, T, d] at absolute positions pos..pos+T-1 -> (y [B, T, d], cache incl. x)."""
        q, k, v, past = self.project(x, cache, pos)
        valid = extend_valid(cache, x.shape[0], x.shape[1])
        if past > 0 or valid is not None:
            # Query i (absolute past+i) sees keys 0..past+i; a static mask, no host sync.
            key_pos = torch.arange(k.shape[2], device=x.device)
            query_pos = torch.arange(past, k.shape[2], device=x.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [T, past+T]
            if valid is not None:
                mask = mask & valid[:, None, None, :]  # [B, 1, T, past+T]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.merge_heads(y), KVCache(k=k, v=v, valid=valid)


def attend_within_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    pieces: PieceGrid,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention whose scores and values use sg(K), sg(V) for keys outside the
    query's piece: exactly the values of plain attention, gradients to K and V only
    from queries of the same piece. q [B, H, T, D]; k, v [B, H, past+T, D]; valid
    [B, past+T] (``extend_valid``) or None."""
    length, total = q.shape[2], k.shape[2]
    query = torch.arange(length, device=q.device)
    key = torch.arange(total, device=q.device) - past  # call index; < 0: earlier calls
    causal = key[None, :] <= query[:, None]  # [T, past+T]
    if valid is not None:
        causal = causal & valid[:, None, None, :]  # [B, 1, T, past+T]
    same = causal & (key[None, :] >= 0)
    same = same & (pieces.piece_ids(key)[None, :] == pieces.piece_ids(query)[:, None])
    scale = q.shape[-1] ** -0.5
    scores = torch.where(same, q @ k.transpose(-1, -2), q @ k.detach().transpose(-1, -2))
    scores = (scores * scale).masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    return torch.where(same, probs, zero) @ v + torch.where(same, zero, probs) @ v.detach()

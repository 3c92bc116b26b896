"""Attention with persistent memory tokens (Ti eq. 19) for the Titans variants.

Two masks over one set of projections (inherited from ``CausalSelfAttention``):

- ``forward``: causal sliding-window attention "SW-Attn*" of MAG/MAL (Ti §4.2-4.3,
  Fig. 3b). Query t sees the keys at t-W+1..t (W = ``window``, itself included),
  plus the N_p persistent tokens. A KV cache of the last W-1 tokens makes chained
  calls equal one call for any split.
- ``attend_segment``: MAC's segment attention Attn([P || h || S]) (Ti eqs. 21-23,
  Fig. 3a): query i of a segment sees P, the memory tokens h_0..h_i and the segment
  tokens S_0..S_i. h_j = M*(q(S_j)) is read with S_j's own query, so it is visible
  causally (j <= i), not fully: a fully visible h_j (j > i) would leak token j.

The persistent tokens P are learned model-space vectors sent through the same
q/k/v projection. They are never written into any memory. They carry no rotary
position: their scores use the un-rotated query, so every query sees P at the same
relative offset, however long the context (an always-visible "sink", Ti §3.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.layers import apply_rotary, rotary_tables
from hope.model.attention import CausalSelfAttention, KVCache, extend_valid


def sliding_window_mask(past: int, length: int, window: int, device: torch.device) -> Tensor:
    """Visibility [length, past+length] of keys at positions -past..length-1 (relative).

    Query i sees key j iff i-window < j <= i. Built from static ints + arange (no sync).
    """
    key_pos = torch.arange(-past, length, device=device)
    query_pos = torch.arange(length, device=device)
    offset = query_pos[:, None] - key_pos[None, :]
    return (offset >= 0) & (offset < window)


def segment_mask(length: int, device: torch.device) -> Tensor:
    """MAC's visibility [S, 2S] over [h || x]: query i sees h_j and x_j for j <= i."""
    causal = sliding_window_mask(0, length, length, device)  # [S, S] lower triangle
    return torch.cat((causal, causal), dim=1)


Rotary = tuple[Tensor, Tensor]  # cos, sin [T, D/2] (``hope.layers.rotary_tables``)
PersistentKV = tuple[Tensor, Tensor]  # P's keys [H, N_p, D] and values [1, H, N_p, D]


@dataclass(frozen=True)
class SegmentView:
    """One MAC segment's tokens as its attention sees them (tensors only, so a compiled
    segment step takes it without recompiling per segment)."""

    q: Tensor  # [B, H, S, D]
    q_rot: Tensor  # [B, H, S, D]
    k: Tensor  # [B, H, S, D], rotated
    v: Tensor  # [B, H, S, D]
    rotary: Rotary  # [S, D/2] each
    persistent: PersistentKV | None
    mask: Tensor  # [S, 2S] (``segment_mask``)


@dataclass(frozen=True)
class SegmentContext:
    """A MAC call's tokens as its segment attentions see them, split per segment (so
    backward joins the segments' gradients with one cat per tensor)."""

    q: Sequence[Tensor]
    q_rot: Sequence[Tensor]
    k: Sequence[Tensor]
    v: Sequence[Tensor]
    rotary: Sequence[Rotary]
    persistent: PersistentKV | None
    mask: Tensor  # [S, 2S] for a full segment

    def segment(self, index: int) -> SegmentView:
        length = self.q[index].shape[2]
        full = self.mask.shape[0] == length
        mask = self.mask if full else segment_mask(length, self.mask.device)
        return SegmentView(
            self.q[index], self.q_rot[index], self.k[index], self.v[index],
            self.rotary[index], self.persistent, mask,
        )  # fmt: skip


class PersistentAttention(CausalSelfAttention):
    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_persistent: int,
        window: int,
        rope_base: float = 10000.0,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__(dim, n_heads, rope_base, qk_norm, norm_eps)
        if n_persistent < 0:
            raise ValueError(f"model.titans_persistent={n_persistent} must be >= 0")
        if window < 1:
            raise ValueError(f"model.titans_window={window} must be >= 1")
        self.window = window
        # Unit scale, like the RMS-normalized tokens they sit beside.
        self.persistent = nn.Parameter(torch.randn(n_persistent, dim)) if n_persistent else None
        # Learned tokens [N_p, d], not a map between features: AdamW, not Muon/M3.
        self.vector_params = ("persistent",) if n_persistent else ()

    def rotary(self, pos: int, length: int, like: Tensor) -> Rotary:
        """cos, sin [length, D/2] for positions pos..pos+length-1 in ``like``'s dtype."""
        return rotary_tables(self.head_dim, pos, length, self.rope_base, like.device, like.dtype)

    def _heads(self, x: Tensor, rotary: Rotary) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, T, d] at the positions of ``rotary`` -> q, q rotated, k rotated, v;
        each [B, H, T, D]."""
        batch, length, _ = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary
        return q, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _key_value_heads(self, x: Tensor, rotary: Rotary | None) -> tuple[Tensor, Tensor]:
        """Keys (rotated when ``rotary`` is given) and values only, [B, H, T, D] each:
        the k and v rows of the fused projection (for tokens that are never queries)."""
        batch, length, dim = x.shape
        kv = F.linear(x, self.qkv.weight[dim:]).view(batch, length, 2, self.n_heads, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return (k, v) if rotary is None else (apply_rotary(k, *rotary), v)

    def _persistent_kv(self, dtype: torch.dtype) -> PersistentKV | None:
        """Keys/values of P -> (k [H, N_p, D], v [1, H, N_p, D]), un-rotated; None without P."""
        if self.persistent is None:
            return None
        k, v = self._key_value_heads(self.persistent.to(dtype)[None], None)
        return k[0], v

    def _attend(
        self,
        q: Tensor,
        q_rot: Tensor,
        k: Tensor,
        v: Tensor,
        visible: Tensor,
        persistent: PersistentKV | None,
    ) -> Tensor:
        """Softmax over [P || context]: q [B,H,T,D], k/v [B,H,K,D], visible [T, K] or
        [B, 1, T, K], P's keys and values (``_persistent_kv``) -> [B, T, d]."""
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.einsum("bhtd,bhkd->bhtk", q_rot, k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        values = v
        if persistent is not None:
            k_p, v_p = persistent
            p_scores = torch.einsum("bhtd,hpd->bhtp", q, k_p) * scale  # no rotary: position-free
            scores = torch.cat((p_scores, scores), dim=-1)
            values = torch.cat((v_p.expand(v.shape[0], -1, -1, -1), v), dim=2)
        # Softmax in at least fp32 (bf16 autocast), in fp64 for fp64 checks.
        work = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
        probs = torch.softmax(scores, dim=-1, dtype=work).to(v.dtype)
        y = torch.einsum("bhtk,bhkd->bthd", probs, values)
        return self.out(y.flatten(2))

    def forward(self, x: Tensor, cache: KVCache | None, pos: int) -> tuple[Tensor, KVCache]:
        """Sliding-window attention over [P || cache || x]; x [B, T, d] at pos.. -> y, cache."""
        length = x.shape[1]
        q, q_rot, k, v = self._heads(x, self.rotary(pos, length, x))
        if cache is not None and cache.k.shape[2] > 0:
            k = torch.cat((cache.k.to(k.dtype), k), dim=2)  # [B, H, past+T, D]
            v = torch.cat((cache.v.to(v.dtype), v), dim=2)
        past = k.shape[2] - length
        visible = sliding_window_mask(past, length, self.window, x.device)
        valid = extend_valid(cache, x.shape[0], length)
        if valid is not None:
            visible = visible & valid[:, None, None, :]  # [B, 1, T, past+T]
        y = self._attend(q, q_rot, k, v, visible, self._persistent_kv(q.dtype))
        # Only the last W-1 keys can be seen by a later query: the cache stays bounded.
        keep = min(self.window - 1, k.shape[2])
        start = k.shape[2] - keep
        kept_valid = None if valid is None else valid[:, start:]
        return y, KVCache(k=k[:, :, start:], v=v[:, :, start:], valid=kept_valid)

    def segment_context(self, x: Tensor, pos: int, segment: int) -> SegmentContext:
        """What MAC's segment attention needs of a call's tokens x [B, T, d] at positions
        pos.., built once per call: no memory read changes it."""
        rotary = self.rotary(pos, x.shape[1], x)
        heads = self._heads(x, rotary)
        q, q_rot, k, v = (t.split(segment, dim=2) for t in heads)
        cos, sin = (t.split(segment) for t in rotary)
        return SegmentContext(
            q, q_rot, k, v, list(zip(cos, sin, strict=True)),
            self._persistent_kv(x.dtype), segment_mask(segment, x.device),
        )  # fmt: skip

    def attend_segment(self, segment: SegmentView, memory_tokens: Tensor) -> Tensor:
        """MAC's segment attention Attn([P || h || S]) (Ti eq. 22) of one segment
        (``SegmentContext.segment``), its memory tokens h [B, S, d] -> y [B, S, d].

        h_j shares position pos+j with x_j, so the scores of query i with h_j and
        with x_j see the same relative distance.
        """
        k_h, v_h = self._key_value_heads(memory_tokens, segment.rotary)
        k = torch.cat((k_h, segment.k), dim=2)
        v = torch.cat((v_h, segment.v), dim=2)
        return self._attend(segment.q, segment.q_rot, k, v, segment.mask, segment.persistent)

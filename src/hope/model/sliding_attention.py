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

from hope.layers import rotary_tables
from hope.memory.ops.dispatch import resolve_backend, rotated
from hope.memory.ops.loop_shared import LoopLinear, LoopShare, share_across
from hope.memory.ops.segment_attention import (
    masked_attention,
    segment_attention,
    segment_keys,
    segment_visibility,
)
from hope.model.attention import CausalSelfAttention, KVCache, extend_valid


def sliding_window_mask(past: int, length: int, window: int, device: torch.device) -> Tensor:
    """Visibility [length, past+length] of keys at positions -past..length-1 (relative).

    Query i sees key j iff i-window < j <= i. Built from static ints + arange (no sync).
    """
    key_pos = torch.arange(-past, length, device=device)
    query_pos = torch.arange(length, device=device)
    offset = query_pos[:, None] - key_pos[None, :]
    return (offset >= 0) & (offset < window)


Rotary = tuple[Tensor, Tensor]  # cos, sin [T, D/2] (``hope.layers.rotary_tables``)
PersistentKV = tuple[Tensor, Tensor]  # P's keys [H, N_p, D] and values [1, H, N_p, D]


@dataclass(frozen=True)
class SegmentView:
    """One MAC segment's tokens as its attention sees them: tensors and maps of tensors
    only (under backend "compile" the same map objects for every segment), so a
    compiled segment step takes it without recompiling per segment."""

    q_rot: Tensor  # [B, H, S, D], rotated and scaled by 1/sqrt(D)
    k: Tensor  # [B, H, S, D], rotated
    v: Tensor  # [B, H, S, D]
    rotary: Rotary  # [S, D/2] each
    kv: LoopLinear  # the k and v rows [2d, d] of the fused projection
    out: LoopLinear  # W_o
    p_scores: Tensor | None  # [B, H, S, N_p]: scaled scores with P's keys
    p_values: Tensor | None  # [B, H, N_p, D]: P's values (expanded over the batch)
    hidden: Tensor  # [S, 2S]: ~``segment_visibility``, the pairs a query must not see


@dataclass(frozen=True)
class SegmentContext:
    """A MAC call's tokens as its segment attentions see them, split per segment (so
    backward joins the segments' gradients with one cat per tensor). What every segment
    shares is made once per call: the scaled queries and their scores with P, the
    hidden mask, and the segments' aliases of the k/v weight rows, W_o and P's values
    (``loop_shared.share_across``: backward takes each one's gradient once per call)."""

    q_rot: Sequence[Tensor]
    k: Sequence[Tensor]
    v: Sequence[Tensor]
    rotary: Sequence[Rotary]
    shared: Sequence[LoopShare]  # per segment: P's values, the k/v rows and W_o
    p_scores: Sequence[Tensor] | None
    hidden: Tensor  # [S, 2S] for a full segment

    def segment(self, index: int) -> SegmentView:
        length = self.q_rot[index].shape[2]
        full = self.hidden.shape[0] == length
        hidden = self.hidden if full else ~segment_visibility(length, self.hidden.device)
        p_scores = None if self.p_scores is None else self.p_scores[index]
        share = self.shared[index]
        (p_values,), (kv, out) = share.tensors, share.linears
        return SegmentView(
            self.q_rot[index], self.k[index], self.v[index], self.rotary[index],
            kv, out, p_scores, p_values, hidden,
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
        return q, rotated(q, cos, sin), rotated(k, cos, sin), v

    def _key_value_heads(
        self, x: Tensor, rotary: Rotary | None, rows: LoopLinear | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys (rotated when ``rotary`` is given) and values only, [B, H, T, D] each:
        the k and v rows of the fused projection (for tokens that are never queries;
        ``rows``: that map, when the caller shares it across several calls)."""
        batch, length, dim = x.shape
        kv_map = LoopLinear(self.qkv.weight[dim:], None) if rows is None else rows
        kv = kv_map(x).view(batch, length, 2, self.n_heads, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return (k, v) if rotary is None else (rotated(k, *rotary), v)

    def _persistent_kv(self, dtype: torch.dtype) -> PersistentKV | None:
        """Keys/values of P -> (k [H, N_p, D], v [1, H, N_p, D]), un-rotated; None without P."""
        if self.persistent is None:
            return None
        k, v = self._key_value_heads(self.persistent.to(dtype)[None], None)
        return k[0], v

    def _scaled(self, q: Tensor) -> Tensor:
        return q * (1.0 / math.sqrt(self.head_dim))

    @staticmethod
    def _persistent_scores(q_scaled: Tensor, persistent: PersistentKV | None) -> Tensor | None:
        """Scores [B, H, T, N_p] of the un-rotated scaled queries with P's keys (no rotary:
        position-free)."""
        if persistent is None:
            return None
        return torch.einsum("bhtd,hpd->bhtp", q_scaled, persistent[0])

    def _attend(
        self, q_rot: Tensor, k: Tensor, values: Tensor, hidden: Tensor, p_scores: Tensor | None
    ) -> Tensor:
        """W_o of ``masked_attention`` (softmax over [P || context]) -> [B, T, d]."""
        return self.out(masked_attention(q_rot, k, values, hidden, p_scores).flatten(2))

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
        persistent = self._persistent_kv(q.dtype)
        p_scores = self._persistent_scores(self._scaled(q), persistent)
        values = v
        if persistent is not None:
            values = torch.cat((persistent[1].expand(v.shape[0], -1, -1, -1), v), dim=2)
        y = self._attend(self._scaled(q_rot), k, values, ~visible, p_scores)
        # Only the last W-1 keys can be seen by a later query: the cache stays bounded.
        keep = min(self.window - 1, k.shape[2])
        start = k.shape[2] - keep
        kept_valid = None if valid is None else valid[:, start:]
        return y, KVCache(k=k[:, :, start:], v=v[:, :, start:], valid=kept_valid)

    def segment_context(self, x: Tensor, pos: int, segment: int) -> SegmentContext:
        """What MAC's segment attention needs of a call's tokens x [B, T, d] at positions
        pos.., built once per call: no memory read changes it."""
        rotary = self.rotary(pos, x.shape[1], x)
        q, q_rot, k, v = self._heads(x, rotary)
        persistent = self._persistent_kv(x.dtype)
        p_scores = self._persistent_scores(self._scaled(q), persistent)
        cos, sin = (t.split(segment) for t in rotary)
        # P's values per sample (a view): each segment's gradient stays per sample, and
        # the batch is summed once per call, by the expand's backward
        p_values = None if persistent is None else persistent[1].expand(x.shape[0], -1, -1, -1)
        # backend "compile" traces each segment's attention: plain parameters there.
        shared = share_across(
            len(cos), tensors=[p_values],
            linears=[(self.qkv.weight[x.shape[2]:], None), (self.out.weight, self.out.bias)],
            enabled=resolve_backend(None) != "compile",
        )  # fmt: skip
        return SegmentContext(
            self._scaled(q_rot).split(segment, dim=2), k.split(segment, dim=2),
            v.split(segment, dim=2), list(zip(cos, sin, strict=True)), shared,
            None if p_scores is None else p_scores.split(segment, dim=2),
            ~segment_visibility(segment, x.device),
        )  # fmt: skip

    def attend_segment(self, segment: SegmentView, memory_tokens: Tensor) -> Tensor:
        """MAC's segment attention Attn([P || h || S]) (Ti eq. 22) of one segment
        (``SegmentContext.segment``), its memory tokens h [B, S, d] -> y [B, S, d].

        h_j shares position pos+j with x_j, so the scores of query i with h_j and
        with x_j see the same relative distance.
        """
        if resolve_backend(None) == "fused" and self.k_norm is None:
            # one operator each way: h's keys rotated inside, the mask implicit, and
            # h W_kv's gradient one tensor
            kv = segment.kv(memory_tokens)  # [B, S, 2d]
            y = segment_attention(segment.q_rot, kv, *segment.rotary, segment.k, segment.v,
                                  segment.p_scores, segment.p_values)  # fmt: skip
            return segment.out(y.flatten(2))
        k_h, v_h = self._key_value_heads(memory_tokens, segment.rotary, segment.kv)
        k, values = segment_keys(k_h, v_h, segment.k, segment.v, segment.p_values)
        y = masked_attention(segment.q_rot, k, values, segment.hidden, segment.p_scores)
        return segment.out(y.flatten(2))

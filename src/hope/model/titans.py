"""Titans baselines (Ti §3-4; MECHANISMS §1 "Titans-only"): LMM, MAL, MAG, MAC blocks.

Every block is pre-norm with residuals around each sub-layer (Ti §4.4) and ends
with x += MLP(N(x)). The long-term memory is ``NeuralMemory`` (Ti eqs. 12-18,
read before write at chunk granularity); P is the persistent memory (Ti eq. 19),
used by the attention only and never written into the memory (the memory's own
meta-learned initial state already plays the role of "memory before any token").

- ``titans_lmm`` (Ti §4.3 "Memory Without Attention"): x += LMM(N(x)).
- ``titans_mal`` (Ti eqs. 29-31, H3-style layering): x += LMM(N(x)); x += SWA*(N(x)).
- ``titans_mag`` (Ti eqs. 26-28): x += W(N(SWA*(N(x))) * sigmoid(N(LMM(N(x))))).
- ``titans_mac`` (Ti eqs. 21-25), per segment s of S = ``titans_chunk`` tokens:
  h = W_o M*_{s-1}(q(seg)); y = Attn([P || h || seg]); M_s = write(M_{s-1}, y);
  o = W(N(y) * sigmoid(N(M*(y)))); x += o.

Streaming: the block state is the memory state (+ the SWA KV cache of the last
``titans_window``-1 tokens for MAG/MAL). The memory keeps a partial chunk pending
until a later call completes it, so LMM/MAG/MAL calls chained at any split, token by
token included, equal one call. MAC continues a context only at segment boundaries
(multiples of ``titans_chunk``): its segment attention has no cache of a partial
segment, and it refuses other splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.layers import MLP, swiglu_hidden
from hope.memory.deep_mlp import DeepFastWeights
from hope.memory.norm import RMSNorm
from hope.memory.ops.dispatch import compiled, resolve_backend, unit_rows
from hope.memory.ops.loop_shared import LoopLinear, LoopNorm, share_across
from hope.memory.residual_mlp import FastWeights
from hope.memory.titans_memory import MemoryProjection, NeuralMemory, NeuralMemoryState
from hope.model.attention import KVCache
from hope.model.config import ModelConfig
from hope.model.lm import LanguageModel
from hope.model.sliding_attention import PersistentAttention, SegmentView


@dataclass
class TitansState:
    """Per-block fast state: memory weights + momentum (+ conv tail), SWA cache."""

    memory: NeuralMemoryState
    cache: KVCache | None = None  # [B, H, <= W-1, D] for MAG/MAL


@dataclass(frozen=True)
class _SegmentShare:
    """One MAC segment's aliases of the block's parameters that every segment uses
    (``loop_shared.share_across``): the retrieval's W_o, the norms of h and of the
    write's input, the memory's projections."""

    retrieve_out: LoopLinear
    h_norm: LoopNorm
    write_norm: LoopNorm
    memory: MemoryProjection


class GatedCombine(nn.Module):
    """o = W (N(y) * sigmoid(N(m))): Ti §4.2 "normalize ... followed by a non-linearity",
    and §4.4 "normalization and gating ... before the final output projection"."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm_y = RMSNorm(dim, eps)
        self.norm_m = RMSNorm(dim, eps)
        self.out = nn.Linear(dim, dim, bias=False)
        self.out.residual_projection = True  # type: ignore[assignment]

    def forward(self, y: Tensor, m: Tensor) -> Tensor:
        return self.out(self.norm_y(y) * torch.sigmoid(self.norm_m(m)))


def _attention(cfg: ModelConfig) -> PersistentAttention:
    return PersistentAttention(
        cfg.dim, cfg.n_heads, cfg.titans_persistent, cfg.titans_window,
        cfg.rope_base, cfg.qk_norm, cfg.norm_eps,
    )  # fmt: skip


class _TitansBlock(nn.Module):
    """Shared parts: the memory, the closing MLP, state construction."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.memory = NeuralMemory(cfg.titans_memory_config())
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg.dim, swiglu_hidden(cfg.dim, cfg.mlp_ratio), "swiglu")

    def init_state(self, batch_size: int, device: torch.device) -> TitansState:
        memory = self.memory.init_state(batch_size, device)
        attn = self._sliding_attention()
        if attn is None:
            return TitansState(memory)
        cache = attn.init_state(batch_size, device, attn.qkv.weight.dtype)
        return TitansState(memory, cache)

    def _sliding_attention(self) -> PersistentAttention | None:
        """The SWA whose KV cache is carried between calls (MAG/MAL); None otherwise."""
        return None

    def _mlp(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.mlp_norm(x))


class TitansLMMBlock(_TitansBlock):
    """x += LMM(N(x)); x += MLP(N(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.memory_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.memory.w_o.residual_projection = True  # type: ignore[assignment]

    def forward(self, x: Tensor, state: TitansState, pos: int) -> tuple[Tensor, TitansState]:
        m, memory = self.memory(self.memory_norm(x), state.memory)
        return self._mlp(x + m), TitansState(memory)


class TitansMALBlock(TitansLMMBlock):
    """Memory as a layer (Ti eqs. 29-31): x += LMM(N(x)); x += SWA*(N(x)); x += MLP(N(x)).

    Deviation (docs/FAITHFULNESS.md): the memory reads and writes x, not x~ = [p || x]
    (eq. 29); the persistent tokens reach the sliding-window attention only.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = _attention(cfg)

    def _sliding_attention(self) -> PersistentAttention:
        return self.attn

    def forward(self, x: Tensor, state: TitansState, pos: int) -> tuple[Tensor, TitansState]:
        m, memory = self.memory(self.memory_norm(x), state.memory)
        x = x + m
        y, cache = self.attn(self.attn_norm(x), state.cache, pos)
        return self._mlp(x + y), TitansState(memory, cache)


class TitansMAGBlock(_TitansBlock):
    """Memory as a gate (Ti eqs. 26-28): both branches read N(x); x += gate(SWA*, LMM).

    Deviation (docs/FAITHFULNESS.md): the persistent tokens reach the attention only,
    not M([P || x]); the memory's meta-learned initial state plays their role there.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = _attention(cfg)
        self.gate = GatedCombine(cfg.dim, cfg.norm_eps)

    def _sliding_attention(self) -> PersistentAttention:
        return self.attn

    def forward(self, x: Tensor, state: TitansState, pos: int) -> tuple[Tensor, TitansState]:
        x_n = self.norm(x)
        y, cache = self.attn(x_n, state.cache, pos)
        m, memory = self.memory(x_n, state.memory)
        return self._mlp(x + self.gate(y, m)), TitansState(memory, cache)


class TitansMACBlock(_TitansBlock):
    """Memory as a context (Ti eqs. 21-25); one Python iteration per segment, none per token.

    The memory chunk equals the segment (both are ``titans_chunk``), so one
    ``NeuralMemory`` call per segment reads M_{s-1} and writes the segment's y.
    Eq. 25 reads the updated M_s*(y); reading it for token i would expose y_j,
    j > i, of the same segment, so the gate read uses M_{s-1} (read before write),
    and h_j is visible causally (to queries >= j): both a deviation from eqs. 21/25
    read literally, which would leak future tokens (docs/FAITHFULNESS.md).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.segment = cfg.titans_chunk
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # W_Q of eq. 21 (SiLU + per-head L2 norm as the memory's own queries, Ti §4.4).
        self.retrieve_q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.h_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = _attention(cfg)
        self.write_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.gate = GatedCombine(cfg.dim, cfg.norm_eps)

    def retrieval_queries(self, x_n: Tensor) -> Tensor:
        """Memory queries [B, H, T, d_h] of x_n [B, T, d] (W_Q of Ti eq. 21; SiLU and
        per-head L2 norm as the memory's own queries, Ti §4.4)."""
        batch, length, dim = x_n.shape
        heads = self.memory.n_heads
        q = F.silu(self.retrieve_q(x_n)).view(batch, length, heads, dim // heads)
        return unit_rows(q).transpose(1, 2)

    def retrieve(
        self,
        queries: Tensor,
        fast: FastWeights | DeepFastWeights,
        w_o: nn.Module | LoopLinear | None = None,
    ) -> Tensor:
        """h = W_o M*(q) [B, S, d] for queries [B, H, S, d_h] with the given memory
        weights (Ti eq. 21); ``w_o``: a segment's share of the memory's W_o."""
        batch, heads, length, d_head = queries.shape
        read = self.memory.read(fast, queries, token_major=True)  # [B, S, H, d_h] beneath
        w_o = self.memory.w_o if w_o is None else w_o
        return w_o(read.transpose(1, 2).reshape(batch, length, heads * d_head))

    def _mix(
        self,
        queries: Tensor,
        fast: FastWeights | DeepFastWeights,
        segment: SegmentView,
        share: _SegmentShare,
    ) -> Tensor:
        """y [B, S, d] of one segment: Attn([P || h || S]) with h = W_o M*_{s-1}(q(S)),
        M_{s-1} = ``fast``, the memory before this segment's write (Ti eqs. 21-22)."""
        h = self.retrieve(queries, fast, share.retrieve_out)
        return self.attn.attend_segment(segment, share.h_norm(h))

    def _segment_shares(self, copies: int, batch: int) -> list[_SegmentShare]:
        """Each segment's aliases of the parameters every segment uses, their gradients
        taken once per call; backend "compile" traces a segment: plain parameters there."""
        backend = resolve_backend(None)
        enabled = backend != "compile"
        norms = [(norm.weight, norm.eps) for norm in (self.h_norm, self.write_norm)]
        shared = share_across(
            copies, linears=[(self.memory.w_o.weight, None)], norms=norms, enabled=enabled,
            defer_norms=backend == "fused",
        )  # fmt: skip
        # per-sample conv weights where the fused heads operator takes them
        memory = self.memory.projections(copies, enabled, batch if backend == "fused" else None)
        return [
            _SegmentShare(share.linears[0], share.norms[0], share.norms[1], projection)
            for share, projection in zip(shared, memory, strict=True)
        ]

    def forward(self, x: Tensor, state: TitansState, pos: int) -> tuple[Tensor, TitansState]:
        if pos % self.segment:
            raise ValueError(
                f"titans_mac continues a context only at multiples of model.titans_chunk="
                f"{self.segment}; this call starts at position {pos}"
            )
        x_n = self.norm(x)
        # Everything no memory read changes is computed once per call (the segments'
        # attention queries, keys and values, the retrieval queries, P, the mask), so
        # one Python iteration runs only what depends on M_{s-1}.
        context = self.attn.segment_context(x_n, pos, self.segment)
        queries = self.retrieval_queries(x_n).split(self.segment, dim=2)
        # backend "compile": each segment's retrieval and attention as one compiled graph
        # (the memory's own chunk step is compiled by the memory).
        mix = TitansMACBlock._mix
        if resolve_backend(None) == "compile":
            mix = compiled(mix)
        memory, ys, reads = state.memory, [], []
        shares = self._segment_shares(len(queries), x.shape[0])
        for index, (q, share) in enumerate(zip(queries, shares, strict=True)):
            y = mix(self, q, memory.memory, context.segment(index), share)
            # reads M_{s-1}, writes y; the reads' output projection runs once, below
            y_n = share.write_norm(y)
            m, memory = self.memory.read_write(y_n, memory, projection=share.memory)
            ys.append(y)
            reads.append(m)
        m = self.memory.project_reads(torch.cat(reads, dim=2))
        out = self.gate(torch.cat(ys, dim=1), m)  # per token: once
        return self._mlp(x + out), TitansState(memory)


def _build(cfg: ModelConfig, block: type[nn.Module]) -> LanguageModel:
    return LanguageModel(cfg, nn.ModuleList(block(cfg) for _ in range(cfg.n_layers)))


def build_titans_lmm(cfg: ModelConfig) -> LanguageModel:
    return _build(cfg, TitansLMMBlock)


def build_titans_mal(cfg: ModelConfig) -> LanguageModel:
    return _build(cfg, TitansMALBlock)


def build_titans_mag(cfg: ModelConfig) -> LanguageModel:
    return _build(cfg, TitansMAGBlock)


def build_titans_mac(cfg: ModelConfig) -> LanguageModel:
    return _build(cfg, TitansMACBlock)

"""Continuum Memory System (NL §3, eqs. 30–31; MECHANISMS §2, §8.3).

A level is an MLP a → W_out·gelu(W_in·a) whose weights in force for sample b are
θ0 + Δ_b: θ0 meta parameters (outer optimizer), Δ_b fast deltas, zero at context
start and written under stop-grad, so ∂L/∂θ0 = ∂L/∂(θ0 + Δ) (first-order MAML).

Writes (NL eq. 31): at each boundary of level ℓ (every C tokens)
    Δ ← α Δ − η Opt(Σ_{t∈chunk} ∇_θ ℓ_t),   ℓ_t(θ) = ⟨MLP_θ(a_t), sg(δ_t)⟩,
with gradients at the chunk-start weights and δ_t = ∂L/∂(level output) of the summed
per-token CE (given by the caller). The per-token gradients are rank-1 and are only
ever summed (never materialised per token):
    G_out = Σ_t δ_t h_tᵀ,   G_in = Σ_t (W_outᵀ δ_t ⊙ gelu′(z_t)) a_tᵀ.

Equal given the same δ (tests, float64):
- ``CMSLevel.teach_forward`` (``teach_pass`` pass B), in one of two forms:
  materialised: one scan over chunks for the deltas Δ_n in force during chunk n
  (built from chunks < n only), then one batched read with per-chunk weights
  θ0 + sg(Δ_n); dual (``cms_dual``, linear inner rules): the same read as
  block-causal linear attention over earlier chunks, Δ_n never materialised;
- ``naive_online_level`` (oracle, ``exact_online``): chunk by chunk, read with the
  current Δ, then write with that chunk's δ.

Streaming: each level keeps a pending buffer (inputs, δ, surprise scores of tokens
not yet written) that persists across calls; an update fires whenever ≥ C tokens
are pending and pops exactly C; a partial chunk waits for a later call. All counts
are static Python ints (no device syncs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hope.memory.cms_state import ChunkDeltas, ChunkLayout, LevelState, fresh_zeros
from hope.memory.ops.cms_dual import dual_teach_read
from hope.memory.ops.cms_scan import scan_chunk_deltas
from hope.memory.surprise import chunk_gate, token_mask, token_scores
from hope.optim.inner import InnerRule

Layout = Literal["chain", "independent"]
ReadForm = Literal["auto", "dual", "materialized"]


class CMSLevel(nn.Module):
    """One CMS level: meta MLP θ0 = (W_in [h, d], W_out [d, h]) read as θ0 + Δ_b."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        period: int,
        rule: InnerRule,
        *,
        surprise_threshold: float | None = None,
        surprise_metric: str = "l2",
        init_std: float = 0.02,
        read_form: ReadForm = "auto",
        adaptive_lr: bool = False,
        read_block: int = 0,
    ) -> None:
        super().__init__()
        if period < 1 or hidden < 1:
            raise ValueError(f"CMSLevel: period and hidden must be >= 1 (got {period}, {hidden})")
        self.dim, self.hidden, self.period = dim, hidden, period
        self.rule = rule
        self.surprise_threshold = surprise_threshold
        self.surprise_metric = surprise_metric
        if read_form not in ("auto", "dual", "materialized"):
            raise ValueError(
                f"CMSLevel: read_form must be auto|dual|materialized, got {read_form!r}"
            )
        if read_form == "dual" and not rule.linear:
            raise ValueError(f"CMSLevel: the dual read needs a linear inner rule, not {rule!r}")
        if read_form == "dual" and adaptive_lr:
            raise ValueError("CMSLevel: the dual read has no graph through Δ; adaptive_lr needs it")
        self.read_form = read_form
        if read_block < 0:
            raise ValueError(f"CMSLevel: read_block must be >= 0, got {read_block}")
        self.read_block = level_read_block(read_block, period)
        self.w_in = nn.Parameter(torch.randn(hidden, dim) * init_std)
        self.w_out = nn.Parameter(torch.randn(dim, hidden) * init_std)
        # Data-dependent learning rate η_t = η · 2σ(w·a_t + b) (NL eq. 31's η_t^(ℓ));
        # zero init: η_t = η, the fixed-rate level, until the outer loop moves it.
        self.adaptive_lr = adaptive_lr
        self.lr_gate_weight = nn.Parameter(torch.zeros(dim)) if adaptive_lr else None
        self.lr_gate_bias = nn.Parameter(torch.zeros(())) if adaptive_lr else None

    def init_state(
        self, batch_size: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> LevelState:
        """Fresh context: Δ = 0, momentum 0, nothing pending."""
        device = self.w_in.device if device is None else device
        dtype = torch.float32 if dtype is None else dtype

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        def fast_zeros(*shape: int) -> Tensor:  # Δ and momenta: reads may skip them
            return fresh_zeros(*shape, device=device, dtype=dtype)

        d, h = self.dim, self.hidden
        momentum = self.rule.uses_momentum

        def mom_init(out_dim: int, in_dim: int) -> Tensor | None:
            shape = self.rule.momentum_shape(out_dim, in_dim)
            return fast_zeros(batch_size, *shape) if momentum else None

        return LevelState(
            delta_in=fast_zeros(batch_size, h, d),
            delta_out=fast_zeros(batch_size, d, h),
            mom_in=mom_init(h, d),
            mom_out=mom_init(d, h),
            pending_inputs=zeros(batch_size, 0, d),
            pending_teach=zeros(batch_size, 0, d),
            pending_scores=zeros(batch_size, 0),
            updates=torch.zeros(batch_size, device=device),
        )

    def lr_factors(self, x_norm: Tensor) -> Tensor:
        """η_t / η = 2σ(w·a_t + b) per token [..., T] of the level inputs a [..., T, d]
        (adaptive_lr). The inputs are constants here, as in every write: the outer
        gradient reaches the gate's own parameters only."""
        assert self.lr_gate_weight is not None and self.lr_gate_bias is not None
        a = x_norm.detach()
        logit = a @ self.lr_gate_weight.to(a.dtype) + self.lr_gate_bias.to(a.dtype)
        return 2.0 * torch.sigmoid(logit)

    def _fast(self, delta: Tensor, dtype: torch.dtype) -> Tensor:
        """Δ as read: sg(Δ) for a fixed rate. With adaptive_lr, Δ is built from constant
        inputs, δ and θ0 (all detached in the write) and in-graph rates η_t, so keeping
        its graph trains the rate gate and nothing else (docs/FAITHFULNESS.md)."""
        return (delta if self.adaptive_lr else delta.detach()).to(dtype)

    def _read(self, inputs: Tensor, delta_in: Tensor | None, delta_out: Tensor | None) -> Tensor:
        """MLP with weights θ0 + sg(Δ); inputs [..., C, d], deltas [..., h, d] / [..., d, h].

        sg(Δ) makes the meta-gradient first-order, ∂L/∂θ0 = ∂L/∂(θ0 + Δ): a deviation
        MECHANISMS §2 prescribes (docs/FAITHFULNESS.md)."""
        pre = inputs @ self.w_in.t()
        if delta_in is not None:
            pre = pre + inputs @ self._fast(delta_in, inputs.dtype).transpose(-1, -2)
        hidden = F.gelu(pre)
        out = hidden @ self.w_out.t()
        if delta_out is not None:
            out = out + hidden @ self._fast(delta_out, inputs.dtype).transpose(-1, -2)
        return out

    def forward(
        self,
        x_norm: Tensor,
        state: LevelState | None = None,
        chunk_deltas: ChunkDeltas | None = None,
    ) -> Tensor:
        """Read y [B, T, d] from the normalised input x_norm [B, T, d].

        No state: the meta MLP θ0. A state: its current Δ for every token (pass A /
        one online chunk). ``chunk_deltas``: chunk n of the call's layout uses its own
        θ0 + Δ_n in one batched matmul (pass B). Never writes.
        """
        if chunk_deltas is None:
            if state is None or state.carries_nothing():  # θ0 + 0: no Δ matmuls
                return self._read(x_norm, None, None)
            return self._read(x_norm, state.delta_in, state.delta_out)
        batch, length, dim = x_norm.shape
        n_chunks, chunk, offset = (
            chunk_deltas.delta_in.shape[1],
            chunk_deltas.chunk,
            chunk_deltas.offset,
        )
        pad = n_chunks * chunk - offset - length
        if pad < 0 or pad >= chunk:
            raise ValueError(
                f"chunk_deltas cover {n_chunks} chunks; they do not fit {length} tokens"
            )
        # Pending tokens were read in an earlier call; zero rows keep the chunk layout.
        padded = F.pad(x_norm, (0, 0, offset, pad)).view(batch, n_chunks, chunk, dim)
        out = self._read(padded, chunk_deltas.delta_in, chunk_deltas.delta_out)
        return out.reshape(batch, n_chunks * chunk, dim)[:, offset : offset + length]

    def _scores(
        self, teach: Tensor, token_loss: Tensor | None, token_entropy: Tensor | None
    ) -> Tensor:
        if self.surprise_threshold is None:
            return teach.new_zeros(teach.shape[:2])
        return token_scores(self.surprise_metric, teach, token_loss, token_entropy)

    def _layout(
        self,
        x_norm: Tensor,
        teach: Tensor,
        state: LevelState,
        token_loss: Tensor | None,
        token_entropy: Tensor | None,
    ) -> ChunkLayout:
        """The call's tokens after the P pending ones, padded into chunks, with gates."""
        if x_norm.shape != teach.shape:
            raise ValueError(f"inputs {tuple(x_norm.shape)} and teach {tuple(teach.shape)} differ")
        if x_norm.shape[1] < 1:
            raise ValueError("chunk_deltas: the call has no tokens (T = 0)")
        chunk, offset = self.period, state.pending
        total = offset + x_norm.shape[1]
        n_read = -(-total // chunk)  # chunks holding call tokens
        n_full = total // chunk
        remainder = total - n_full * chunk
        n_fire = n_full  # a partial last chunk stays pending until a later call

        teach = teach.detach()
        scores = self._scores(teach, token_loss, token_entropy)  # [B, T]
        mask = token_mask(scores, self.surprise_threshold)
        if mask is not None:
            teach = teach * mask[..., None]
        if self.adaptive_lr:
            # Σ_t η_t ∇ℓ_t = η Σ_t ∇ℓ_t(a_t, (η_t/η)·δ_t): every rule's gradient sums
            # are linear in δ_t (the erase term of dgd has no δ and keeps η′).
            teach = teach * self.lr_factors(x_norm).to(teach.dtype)[..., None]
        inputs_all = torch.cat([state.pending_inputs, x_norm.detach().to(teach.dtype)], dim=1)
        teach_all = torch.cat([state.pending_teach, teach], dim=1)
        scores_all = torch.cat([state.pending_scores, scores], dim=1)

        pad = n_read * chunk - total
        batch, dim = teach.shape[0], teach.shape[2]
        scores_c = F.pad(scores_all, (0, pad)).view(batch, n_read, chunk)
        gates = None
        if n_fire:
            gates = chunk_gate(scores_c[:, :n_fire], self.surprise_threshold)
        keep = remainder
        return ChunkLayout(
            inputs=F.pad(inputs_all, (0, 0, 0, pad)).view(batch, n_read, chunk, dim),
            teach=F.pad(teach_all, (0, 0, 0, pad)).view(batch, n_read, chunk, dim),
            gates=gates,
            n_fire=n_fire,
            offset=offset,
            pending_inputs=inputs_all[:, total - keep :],
            pending_teach=teach_all[:, total - keep :],
            pending_scores=scores_all[:, total - keep :],
        )

    @staticmethod
    def _advance(final: LevelState, layout: ChunkLayout) -> LevelState:
        """The state after the call: written Δ (``final``), new pending buffer, counters."""
        n_fire = layout.n_fire
        gates = layout.gates
        fired = gates.sum(dim=1).to(final.updates.dtype) if gates is not None else n_fire
        return replace(
            final,
            pending_inputs=layout.pending_inputs,
            pending_teach=layout.pending_teach,
            pending_scores=layout.pending_scores,
            updates=final.updates + fired,
            boundaries=final.boundaries + n_fire,
        )

    def chunk_deltas(
        self,
        x_norm: Tensor,
        teach: Tensor,
        state: LevelState,
        *,
        token_loss: Tensor | None = None,
        token_entropy: Tensor | None = None,
    ) -> tuple[ChunkDeltas, LevelState]:
        """Write the call's tokens: the deltas in force per chunk and the new state.

        x_norm, teach δ [B, T, d] (both treated as constants); token_loss,
        token_entropy [B, T] (the surprise metric's inputs). Chunk 0 starts with the P
        pending tokens of ``state``.
        """
        layout = self._layout(x_norm, teach, state, token_loss, token_entropy)
        return self._materialised(layout, state)

    def _materialised(
        self, layout: ChunkLayout, state: LevelState
    ) -> tuple[ChunkDeltas, LevelState]:
        """The per-chunk weight stacks of a laid-out call, and the new state."""
        # Graph through the scan only for the rate gate (adaptive_lr; see _fast).
        with torch.set_grad_enabled(self.adaptive_lr and torch.is_grad_enabled()):
            w_in, w_out = (w.detach().to(layout.inputs.dtype) for w in (self.w_in, self.w_out))
            deltas_in, deltas_out, final = scan_chunk_deltas(w_in, w_out, self.rule, layout, state)
        n_read = layout.inputs.shape[1]
        in_force = ChunkDeltas(
            torch.stack(deltas_in[:n_read], dim=1),
            torch.stack(deltas_out[:n_read], dim=1),
            layout.offset,
            self.period,
        )
        return in_force, self._advance(final, layout)

    def write(
        self, x_norm: Tensor, teach: Tensor, state: LevelState, **kwargs: object
    ) -> LevelState:
        """Only the state update of ``chunk_deltas`` (exact_online writes after a read)."""
        return self.chunk_deltas(x_norm, teach, state, **kwargs)[1]  # type: ignore[arg-type]

    def uses_dual_read(self, layout: ChunkLayout) -> bool:
        """The read form of this call (``read_form``, or ``prefers_dual_read`` for auto)."""
        if self.read_form != "auto":
            return self.read_form == "dual"
        if self.adaptive_lr or not self.rule.linear:
            return False
        return prefers_dual_read(layout.inputs.shape[2], layout.n_fire, self.hidden, self.dim)

    def teach_forward(
        self,
        x_norm: Tensor,
        teach: Tensor,
        state: LevelState,
        *,
        token_loss: Tensor | None = None,
        token_entropy: Tensor | None = None,
    ) -> tuple[Tensor, LevelState]:
        """Pass B of ``teach_pass``: the read through θ0 + sg(Δ_n) per chunk, Δ_n built
        from (x_norm, δ), and the written state. Two forms with the same values: the
        dual read (``cms_dual``) or per-chunk weight stacks then one batched read.

        A call longer than ``read_block`` tokens that may read dually is read as that
        many calls of one block each, the state carried between them (ending each block
        on a period boundary): a block's dual read scores only its own written tokens
        and reads the earlier ones through Δ at its start. The same values (the chunks
        and the Δ in force at each are the same; float64 tests); its score work grows
        with the block, not the call."""
        blocks = self._read_blocks(x_norm.shape[1], state.pending)
        if len(blocks) > 1:  # each block is one call of a single block
            outs = []
            for piece in blocks:
                out, state = self.teach_forward(
                    x_norm[:, piece], teach[:, piece], state,
                    token_loss=None if token_loss is None else token_loss[:, piece],
                    token_entropy=None if token_entropy is None else token_entropy[:, piece],
                )  # fmt: skip
                outs.append(out)
            return torch.cat(outs, dim=1), state
        layout = self._layout(x_norm, teach, state, token_loss, token_entropy)
        if not self.uses_dual_read(layout):
            deltas, new_state = self._materialised(layout, state)
            return self(x_norm, chunk_deltas=deltas), new_state
        out, (d_in, d_out, m_in, m_out) = dual_teach_read(
            self.w_in, self.w_out, self.rule, x_norm, layout, state
        )
        final = replace(state, delta_in=d_in, delta_out=d_out, mom_in=m_in, mom_out=m_out)
        return out, self._advance(final, layout)

    def _read_blocks(self, length: int, pending: int) -> list[slice]:
        """The call's tokens in dual-read blocks: each but the last ends on a multiple of
        ``read_block`` from the first pending token (one block when the level cannot
        read dually or the call fits)."""
        dual_possible = self.rule.linear and not self.adaptive_lr
        if self.read_form == "materialized" or not dual_possible:
            return [slice(0, length)]
        return dual_read_blocks(length, pending, self.read_block)


def level_read_block(read_block: int, period: int) -> int:
    """A level's dual-read block: ``read_block`` tokens rounded down to whole periods,
    at least one; 0 (the whole call) stays 0."""
    return max(period, read_block // period * period) if read_block else 0


def dual_read_blocks(length: int, pending: int, size: int) -> list[slice]:
    """A call of ``length`` tokens after ``pending`` buffered ones in blocks of ``size``
    (0: one block): every block but the last ends on a multiple of ``size`` counted
    from the first pending token."""
    if not size:
        return [slice(0, length)]
    cuts = list(range(size - pending, length, size))
    return [slice(a, b) for a, b in zip([0, *cuts], [*cuts, length], strict=True)]


def prefers_dual_read(chunk: int, n_fire: int, hidden: int, dim: int) -> bool:
    """Auto read form of a linear-rule level: the dual read when its [L, F] score
    matrices (F = n_fire·C written tokens) are no larger than the materialised
    per-chunk weight stacks [n, h, d], i.e. n_fire·C² <= h·d."""
    return n_fire * chunk * chunk <= hidden * dim

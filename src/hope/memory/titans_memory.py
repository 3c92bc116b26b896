"""Titans neural long-term memory (LMM; Ti §3.1-3.2, eqs. 12-18; MECHANISMS §1).

x [B, T, d] -> q, k, v = SiLU(x W) -> causal depthwise conv -> heads, with q
and k L2-normalized. The memory is a per-head 2-layer MLP M(z) = z + W1 gelu(W2 z)
(depth L_M = 2, residual as in all Titans blocks, Ti §4.4) whose weights are
per-sample fast state. Inner loss ||M(k_t) - v_t||^2 (Ti eq. 12); update

  S_t = eta_t S_{t-1} - theta_t grad,   M_t = (1 - alpha_t) M_{t-1} + S_t   (eqs. 13-14)

with data-dependent gates eta, alpha = sigmoid(linear(x)) per head and token.
Deviation (stabiliser): theta_t = theta_max sigmoid(linear(x_t)) / max(1, lambda_t),
lambda_t >= the Gauss-Newton curvature of the memory at k_t and theta_max per chunk
from the coupling of the chunk's keys and hidden activations, so a chunk of C stale
gradients never overshoots (``ops/chunk_rates.py``: ``chunk_step_cap``).
Chunked training (Ti eqs. 16-18): every gradient of a chunk of
``titans_chunk`` tokens is taken at the chunk-start weights; momentum and decay
across its tokens are applied in closed form (``ops/chunk.py``).

Retrieval y_t = M*(q_t) (eq. 15) uses the chunk-start weights: read before
write at chunk granularity, so y_t never depends on tokens >= its chunk start
through the memory (strictly causal; titans-pytorch instead lets a chunk's
last token read its own chunk's write).

Streaming: the tokens of a partial final chunk are read at once (with the weights of
their chunk's start) and kept as a pending chunk (their keys, values and gates) that
the next call completes and writes. So chained calls equal one call at any split,
token by token included, in outputs and in states (tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.memory.chunk_loop import LoopPolicy, chunk_sizes, run_chunks
from hope.memory.config import TitansMemoryConfig
from hope.memory.conv import CausalDepthwiseConv, causal_depthwise
from hope.memory.deep_mlp import (
    DeepFastWeights,
    DeepMemoryInit,
    deep_apply,
    deep_factors,
    deep_momentum_write,
    naive_deep_write,
)
from hope.memory.fast_state import where_samples
from hope.memory.ops.dispatch import (
    chunk_rates,
    compiled,
    momentum_write,
    resolve_backend,
    unit_rows,
)
from hope.memory.ops.loop_shared import LoopLinear, share_across
from hope.memory.ops.titans_heads import split_projected, titans_heads
from hope.memory.residual_mlp import (
    FastWeights,
    MemoryInit,
    chunk_pass,
    mlp_apply,
    stacked_apply,
)

# Gate values at init (the paper gives none): theta at half its cap (a
# fraction of ``ops.chunk_rates.chunk_step_cap``), a long surprise momentum eta ~ 0.9 and a slow
# forgetting alpha ~ 0.005 per token.
_GATE_INIT = {"theta": 0.5, "eta": 0.9, "alpha": 0.005}


@dataclass
class PendingChunk:
    """The tokens of a partial chunk: already read, written once their chunk completes."""

    k: Tensor  # [B, H, P, d_h], P < chunk
    v: Tensor  # [B, H, P, d_h]
    theta: Tensor  # [B, H, P]
    eta: Tensor  # [B, H, P]
    alpha: Tensor  # [B, H, P]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def parts(self) -> tuple[Tensor, ...]:
        return (self.k, self.v, self.theta, self.eta, self.alpha)

    def select(self, index: slice) -> PendingChunk:
        return PendingChunk(*(t[index] for t in self.parts()))

    def reset_where(self, fresh: PendingChunk, reset_mask: Tensor) -> PendingChunk:
        """Per-sample reset. The chunk phase is batch-wide, so a reset sample keeps the
        pending length with zero keys, values and gates: zero steps (no write), zero
        momentum carry (a fresh momentum is zero) and no decay (alpha = 0)."""
        return PendingChunk(
            *(where_samples(reset_mask, torch.zeros_like(t), t) for t in self.parts())
        )


@dataclass
class NeuralMemoryState:
    """Per-sample fast state: weights, surprise momentum (m1/m2, or the momenta of a
    memory of depth != 2), conv tail, the pending partial chunk."""

    memory: FastWeights | DeepFastWeights
    conv_tail: Tensor | None  # [B, W-1, 3d]
    pending: PendingChunk
    chunks_done: int = 0  # chunks written so far (static, for write_grad windows)

    def select(self, index: slice) -> NeuralMemoryState:
        tail = None if self.conv_tail is None else self.conv_tail[index]
        pending = self.pending.select(index)
        return NeuralMemoryState(self.memory.select(index), tail, pending, self.chunks_done)


@dataclass(frozen=True)
class MemoryProjection:
    """The memory's inputs' map x -> [x W_qkv | x W_g + b] [B, T, 3d + 3H] (Ti §4.4; one
    matmul each way for both) and the conv's weight [3d, W] (None without a conv).
    ``NeuralMemory.projections`` shares them across the iterations of a caller's loop."""

    inputs: LoopLinear
    conv: Tensor | None  # or per sample [B, 3d, W]


@dataclass(frozen=True)
class _Carry:
    """The chunk loop's carry (``chunk_loop``): the fast weights and the chunk count."""

    fast: FastWeights | DeepFastWeights
    chunks_done: int

    def detach_memories(self) -> _Carry:
        return _Carry(self.fast.detach(), self.chunks_done)


class NeuralMemory(nn.Module):
    def __init__(self, cfg: TitansMemoryConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.policy = LoopPolicy(cfg.write_grad, cfg.write_grad_window, cfg.checkpoint_chunks)
        self.n_heads, self.d_head = cfg.n_heads, cfg.dim // cfg.n_heads
        self.w_qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        # The conv window is shared with SMT (one knob for "local conv on inputs").
        self.conv = (
            CausalDepthwiseConv(3 * cfg.dim, cfg.conv_window, cfg.init_std)
            if cfg.conv_window > 0
            else None
        )
        self.gates = nn.Linear(cfg.dim, 3 * cfg.n_heads)
        # Three scalar gates per head (θ, η, α), not a hidden map: AdamW, not Muon/M3.
        self.vector_params = ("gates.weight",)
        nn.init.normal_(self.gates.weight, std=cfg.init_std)
        self.init_extra_parameters()
        hidden = cfg.expansion * self.d_head
        # Depth L_M (Ti §3.1): 2 runs the two-layer fast path of residual_mlp; any other
        # depth the general one of deep_mlp (equal at L_M = 2, tests).
        self.depth = cfg.depth
        self.init: MemoryInit | DeepMemoryInit = (
            MemoryInit(cfg.n_heads, self.d_head, hidden, self.d_head, cfg.init_std)
            if self.depth == 2
            else DeepMemoryInit(cfg.n_heads, self.d_head, hidden, self.depth, cfg.init_std)
        )
        self.w_o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        nn.init.normal_(self.w_o.weight, std=cfg.init_std)

    def init_extra_parameters(self) -> None:
        """Gate biases; also rerun by ``LanguageModel.reset_parameters``, which zeroes biases."""
        with torch.no_grad():
            bias = [math.log(p / (1 - p)) for p in _GATE_INIT.values()]
            self.gates.bias.copy_(torch.tensor(bias).repeat_interleave(self.n_heads))

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None
    ) -> NeuralMemoryState:
        if device is not None and torch.device(device) != self.w_o.weight.device:
            raise ValueError(
                f"init_state device {device} != module device {self.w_o.weight.device}"
            )
        tail = None if self.conv is None else self.conv.init_tail(batch_size)
        # torch.zeros, not new_zeros: under per-block FSDP units w_o is a sharded DTensor.
        dtype, device = self.w_o.weight.dtype, self.w_o.weight.device
        empty = torch.zeros(batch_size, self.n_heads, 0, self.d_head, dtype=dtype, device=device)
        gates = torch.zeros(batch_size, self.n_heads, 0, dtype=dtype, device=device)
        pending = PendingChunk(empty, empty.clone(), gates, gates.clone(), gates.clone())
        return NeuralMemoryState(self.init.init_state(batch_size), tail, pending, 0)

    def projections(
        self, copies: int, enabled: bool = True, batch: int | None = None
    ) -> list[MemoryProjection]:
        """One ``MemoryProjection`` per iteration of a caller's loop of ``copies`` calls,
        each parameter's gradient taken once for the loop (``loop_shared``). With
        ``batch`` the conv weight comes per sample (expanded, a view): ``hope::titans_heads``
        then hands back per-sample gradients, summed over the batch once per call."""
        conv: Tensor | None = None if self.conv is None else self.conv.weight
        if conv is not None and batch is not None:
            conv = conv.expand(batch, *conv.shape)
        shared = share_across(copies, [conv], [self._joined_map()], enabled=enabled)
        return [MemoryProjection(share.linears[0], share.tensors[0]) for share in shared]

    def _joined_map(self) -> tuple[Tensor, Tensor]:
        """W_qkv and the gates' map as one: weight [3d + 3H, d], bias [3d + 3H] (zero
        for the qkv rows). Two launches per call, where the maps apart cost a matmul
        and an add per call each way."""
        weight = torch.cat([self.w_qkv.weight, self.gates.weight])
        bias = F.pad(self.gates.bias, (self.w_qkv.weight.shape[0], 0))
        return weight, bias

    def _project(
        self,
        x: Tensor,
        tail: Tensor | None,
        backend: str,
        projection: MemoryProjection | None = None,
    ) -> tuple[list[Tensor], Tensor | None]:
        """[q, k, v] heads [B, H, T, d_h] (Ti §4.4: SiLU, conv, L2-norm q and k) and the
        gates theta, eta, alpha [B, H, T] of x [B, T, d], with the conv's new tail."""
        batch, seq, dim = x.shape
        if projection is None:
            conv = None if self.conv is None else self.conv.weight
            projection = MemoryProjection(LoopLinear(*self._joined_map()), conv)
        projected = projection.inputs(x)  # [B, T, 3d + 3H]
        if backend == "fused" and projection.conv is not None:
            # Dense heads and gates from one operator each way (``ops/titans_heads.py``):
            # the fused operators' kernels take a chunk of them without a copy.
            assert tail is not None
            *parts, tail = titans_heads(projected, tail, projection.conv, self.n_heads)
            return parts, tail
        pre, gate_pre = split_projected(projected, self.n_heads)
        qkv = F.silu(pre)
        if projection.conv is not None:
            assert tail is not None
            qkv, tail = causal_depthwise(qkv, tail, projection.conv)
        gate_values = torch.sigmoid(gate_pre)  # [B, T, 3H]
        if backend == "fused":  # dense heads and gates, one copy each per call
            rows = qkv.reshape(batch, seq, 3, self.n_heads, self.d_head)
            q, k, v = rows.permute(2, 0, 3, 1, 4).contiguous().unbind(0)
            gate_heads = gate_values.view(batch, seq, 3, self.n_heads).permute(2, 0, 3, 1)
            gates = gate_heads.contiguous().unbind(0)
            return [unit_rows(q, backend), unit_rows(k, backend), v, *gates], tail
        q, k, v = (t.reshape(batch, seq, self.n_heads, self.d_head) for t in qkv.split(dim, dim=-1))
        parts = [unit_rows(t, backend).transpose(1, 2) for t in (q, k)] + [v.transpose(1, 2)]
        return parts + list(gate_values.transpose(1, 2).split(self.n_heads, 1)), tail

    def forward(
        self, x: Tensor, state: NeuralMemoryState | None = None, backend: str | None = None
    ) -> tuple[Tensor, NeuralMemoryState]:
        """x [B, T, d] -> (y [B, T, d], new state); never mutates parameters."""
        reads, state = self.read_write(x, state, backend)
        return self.project_reads(reads), state

    def project_reads(self, reads: Tensor) -> Tensor:
        """y = W_o M*(q) [B, T, d] of the reads M*(q) [B, H, T, d_h] (Ti eq. 15's output
        projection). Linear per token, so reads of several calls can be projected at once."""
        batch, heads, length, d_head = reads.shape
        return self.w_o(reads.transpose(1, 2).reshape(batch, length, heads * d_head))

    def read_write(
        self,
        x: Tensor,
        state: NeuralMemoryState | None = None,
        backend: str | None = None,
        projection: MemoryProjection | None = None,
    ) -> tuple[Tensor, NeuralMemoryState]:
        """``forward`` before the output projection: x [B, T, d] -> (the reads M*(q)
        [B, H, T, d_h], new state); ``projection``: this call's share of the maps
        (``projections``), the modules' own when None."""
        batch, seq, _ = x.shape
        if state is None:
            state = self.init_state(batch)
        backend = resolve_backend(backend)
        (q, k, v, *gates), tail = self._project(x, state.conv_tail, backend, projection)
        # The write stream is [pending | new]; reads are of the new tokens only.
        held = state.pending.length
        stream = [k, v, *gates]
        if held:
            stream = [
                torch.cat((old, new), dim=2)
                for old, new in zip(state.pending.parts(), stream, strict=True)
            ]
        # Chunk j reads q's tokens [first_j, first_j + size_j) of this call and writes the
        # stream's tokens up to held + first_j + size_j (chunk 0 from the pending ones).
        # Plain slices: a split would add a gradient-assembly op per part in backward.
        sizes = chunk_sizes(held, seq, self.cfg.chunk)
        complete = held + seq - (held + seq) % self.cfg.chunk  # stream tokens written
        firsts = [sum(sizes[:j]) for j in range(len(sizes))]
        # (first call token, size) of each whole chunk; a partial last one is only read.
        chunks = [(f, n) for f, n in zip(firsts, sizes, strict=True) if held + f + n <= complete]
        # backend "compile": the whole chunk step (read, curvature, factors, write) in
        # one compiled graph, its write on the plain closed form.
        chunk_step = (
            compiled(NeuralMemory._chunk_step) if backend == "compile" else NeuralMemory._chunk_step
        )
        write_backend = "torch" if backend == "compile" else backend

        def step(carry: _Carry, first: int, size: int) -> tuple[_Carry, Tensor]:
            lo = 0 if first == 0 else held + first
            k_c, v_c, theta_c, eta_c, alpha_c = (t[:, :, lo : held + first + size] for t in stream)
            q_c = q[:, :, first : first + size]
            fast, read = chunk_step(
                self, carry.fast, q_c, k_c, v_c, theta_c, eta_c, alpha_c, write_backend
            )
            return _Carry(fast, carry.chunks_done + 1), read

        carry, reads = run_chunks(
            step, _Carry(state.memory, state.chunks_done), chunks, self.policy
        )
        fast = carry.fast
        if complete < held + seq:  # the partial chunk: read now, written by a later call
            reads.append(self.read(fast, q[:, :, max(complete - held, 0) :]))
        pending = PendingChunk(*(t[:, :, complete:] for t in stream))
        out = reads[0] if len(reads) == 1 else torch.cat(reads, dim=2)
        return out, NeuralMemoryState(fast, tail, pending, carry.chunks_done)

    def _chunk_step(
        self,
        fast: FastWeights | DeepFastWeights,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        theta: Tensor,
        eta: Tensor,
        alpha: Tensor,
        backend: str | None,
    ) -> tuple[FastWeights | DeepFastWeights, Tensor]:
        """Read M(q) at the chunk-start state, then write the chunk (Ti eqs. 13-14);
        q, k, v [B, H, C, d_h], gates [B, H, C]."""
        if isinstance(fast, DeepFastWeights):
            return self._deep_chunk_step(fast, q, k, v, theta, eta, alpha, backend)
        # One MLP pass over [k | q]: the reads M(q), and at the keys the inner-gradient
        # factors, the curvature and the chunk's kernel bound (Ti eq. 12's target v).
        fused = resolve_backend(backend) == "fused"
        step = chunk_pass(fast.w1, fast.w2, None, k, q, "l2", True, target=v, fused=fused)
        # Inner step theta_t of Ti eq. 13 as theta_max * sigmoid(.) / max(1, lambda_t):
        # a deviation that keeps the chunked write stable (``chunk_rates.chunk_step_cap``).
        # w_s once: the cap reads it detached, the write differentiates through it.
        keep, weights, rate = chunk_rates(theta, eta, alpha, step.curvature, step.coupling, backend)
        fast = momentum_write(
            fast, k, v, rate, eta, keep, objective="l2", residual=True, backend=backend,
            end_weights=weights, factors=step.factors,
        )  # fmt: skip
        assert step.read is not None
        return fast, step.read

    @staticmethod
    def _deep_chunk_step(
        fast: DeepFastWeights,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        theta: Tensor,
        eta: Tensor,
        alpha: Tensor,
        backend: str | None,
    ) -> tuple[DeepFastWeights, Tensor]:
        """``_chunk_step`` for a memory of depth != 2 (``deep_mlp``), with the same capped
        inner step: a deviation (docs/FAITHFULNESS.md, ``chunk_rates.chunk_step_cap``)."""
        read = deep_apply(fast.weights, q)
        factors = deep_factors(fast.weights, k, v)
        keep, weights, step = chunk_rates(
            theta, eta, alpha, factors.curvature, factors.coupling, backend
        )
        if resolve_backend(backend) == "naive":
            return naive_deep_write(fast, k, v, step, eta, keep), read
        return deep_momentum_write(fast, factors, step, eta, keep, weights), read

    def read(
        self,
        fast: FastWeights | DeepFastWeights,
        q: Tensor,
        backend: str | None = None,
        token_major: bool = False,
    ) -> Tensor:
        """M(q) [B, H, T, d_h] with the given fast weights (any depth); one operator each
        way under ``fused`` (``stacked_apply`` of the one member), over a [B, T, H, d_h]
        buffer with ``token_major`` (so merging the heads per token is a view)."""
        if isinstance(fast, DeepFastWeights):
            return deep_apply(fast.weights, q)
        if resolve_backend(backend) == "fused":
            return stacked_apply(fast.w1, fast.w2, q, True, 0, 1, True, token_major)
        return mlp_apply(fast.w1, fast.w2, q, residual=True)

"""The state of a self-modifying Titans layer and how its memories are stacked.

``SMTState`` is the per-sample fast state (``memory/smt.py``); ``Generated`` the
chunk-start generation of a run of tokens (NL-arXiv eq. 83), kept pending between
calls until its chunk completes. A ``MemoryGroup`` is a set of memories written at
the same times from the same chunk, stacked along the head axis so one batched MLP
call serves them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.memory.fast_state import where_samples
from hope.memory.ops.dispatch import bounded_step, compiled
from hope.memory.ops.generation import smt_generation
from hope.memory.ops.smt_write import smt_write
from hope.memory.pieces import PieceGrid
from hope.memory.residual_mlp import FastWeights, Residual, stacked_apply


@dataclass
class Generated:
    """Chunk-start generation of C tokens (NL-arXiv eq. 83)."""

    k: Tensor  # [B, H, C, d_h]
    v: Tensor  # [B, H, C, d_h]
    q: Tensor  # [B, H, C, d_h]
    eta: Tensor  # [B, H, C]
    alpha: Tensor  # [B, H, C]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def select(self, index: slice) -> Generated:
        return Generated(*(getattr(self, f)[index] for f in FIELDS))

    def reset_where(self, fresh: Generated, reset_mask: Tensor) -> Generated:
        """Per-sample reset of pending tokens. The chunk phase is batch-wide, so a reset
        sample keeps the pending length with neutral tokens: zero key, value and step
        (eta), retention alpha = 1, so they write nothing."""

        def neutral(t: Tensor, value: float) -> Tensor:
            return where_samples(reset_mask, torch.full_like(t, value), t)

        return Generated(
            neutral(self.k, 0.0), neutral(self.v, 0.0), neutral(self.q, 0.0),
            neutral(self.eta, 0.0), neutral(self.alpha, 1.0),
        )  # fmt: skip


@dataclass
class SMTState:
    """Per-sample fast state of one SMT layer (tensors have a leading B)."""

    memories: dict[str, FastWeights]
    conv_tail: Tensor | None  # [B, W-1, d]
    partial: Generated  # the tokens of a partial C_o chunk (read, not yet written)
    mem_pending: Generated  # complete C_o chunks since M_mem's last write
    chunks_done: int = 0  # C_o chunks written so far (a static count, for truncation)

    def select(self, index: slice) -> SMTState:
        tail = None if self.conv_tail is None else self.conv_tail[index]
        mems = {n: m.select(index) for n, m in self.memories.items()}
        return SMTState(
            mems, tail, self.partial.select(index), self.mem_pending.select(index),
            self.chunks_done,
        )  # fmt: skip


@dataclass(frozen=True)
class MemoryGroup:
    """Memories whose fast weights are stacked along the head axis, [B, G*H, ...].

    Members share each chunk's k, v, eta, alpha, so one batched call serves all of
    them. Stacked W1 rows are padded with zeros to the widest member: the padded
    outputs and targets are 0, so their error is 0 and the rows stay 0 (exact).
    M_mem, when present, is the last member.
    """

    names: tuple[str, ...]
    residuals: tuple[bool, ...]  # per member: M(z) = z + W1 gelu(W2 z)?
    outs: tuple[int, ...]  # per member d_out

    @property
    def key(self) -> str:
        return "+".join(self.names)

    @property
    def width(self) -> int:
        return max(self.outs)

    @property
    def generators(self) -> tuple[str, ...]:
        """Members that generate k, v, q, eta, alpha (eq. 83): all but M_mem."""
        return tuple(n for n in self.names if n != "mem")


FIELDS = ("k", "v", "q", "eta", "alpha")
ChunkInputs = tuple[Tensor, Tensor | None]  # a chunk's x~ [B, H, C, d_h] and x~ W_q


def join_generated(pending: list[Generated]) -> Generated:
    """The C_o chunks since M_mem's last write as one C_m chunk."""
    return Generated(*(torch.cat([getattr(g, f) for g in pending], dim=2) for f in FIELDS))


def detach_generated(gen: Generated) -> Generated:
    return Generated(*(getattr(gen, f).detach() for f in FIELDS))


def bounded_eta(eta: Tensor, coupling: Tensor, backend: str | None = None) -> Tensor:
    """eta_t / (1 + rho): the inner step of eq. 88 with an overshoot bound.

    A chunk applies C gradients taken at its start state (eq. 90). Where its keys
    and hidden activations share directions these add up: linearised, the writes
    move M(k) by -2 J diag(eta) J^T e, and past rho = ``overshoot_ratio`` = 1 they
    overshoot, the self-generated targets v_hat = M(v) then growing with them
    (seen as NaN after ~100 outer steps of the tiny preset). Dividing by 1 + rho
    (rho from the chunk's own ``chunk_kernel_bound``, without a graph) keeps the
    ratio below 1 and leaves eta unchanged while rho << 1. A deviation;
    docs/FAITHFULNESS.md. Tokens with eta = 0 do not enter rho.
    """
    return bounded_step(coupling, eta, backend)


def generate_stacked(
    fast: FastWeights,
    group: MemoryGroup,
    residual: Residual,
    xc: Tensor,
    query: Tensor | None,
    alpha_bias: Tensor,
    eta_scale: float,
    with_graph: bool,
) -> Generated:
    """Eq. 83 (``SelfModifyingTitans._generate``) from one stacked group holding every
    generating memory as its first members, under the memory backend ``fused``: their
    outputs on xc [B, H, C, d_h] in one ``hope::memory_apply``, the normalisations and
    gates in one ``hope::smt_generation``. ``query``: xc W_q, or None when M_q generates
    q. ``with_graph``: whether the memories' outputs keep their graph (x W_q's does)."""
    with torch.set_grad_enabled(torch.is_grad_enabled() and with_graph):
        raw = stacked_apply(fast.w1, fast.w2, xc, residual, 0, len(group.generators), True)
    query = None if query is None else query.to(raw.dtype)
    bias = alpha_bias.to(raw.dtype)
    return Generated(*smt_generation(raw, query, bias, eta_scale))  # type: ignore[misc]


def fused_group_write(
    fast: FastWeights, gen: Generated, residual: Residual, dot: bool, read: bool
) -> tuple[FastWeights, Tensor | None]:
    """``SelfModifyingTitans._write`` of the default rule (preconditioned DGD without
    momentum) as one ``hope::smt_write``, in the fast state's dtype: the pass, the
    bounded step and the write of every member of the group, and the reads of all
    members when ``read``."""
    scale = residual.reshape(-1) if isinstance(residual, Tensor) else None
    k, v, eta, alpha = (t.to(fast.w1.dtype) for t in (gen.k, gen.v, gen.eta, gen.alpha))
    q = gen.q.to(fast.w1.dtype) if read else None
    out = smt_write(fast.w1, fast.w2, k, v, q, eta, alpha, scale, residual is True, dot)
    return fast.with_weights(*out[:4]), out[4] if read else None


def stack_group(mems: dict[str, FastWeights], group: MemoryGroup) -> FastWeights:
    """Members' states concatenated along the head axis: [B, G*H, ...], W1 and m1
    padded with zero rows to the group's widest d_out."""
    if len(group.names) == 1:
        return mems[group.names[0]]
    parts = [mems[n] for n in group.names]

    def rows(t: Tensor) -> Tensor:
        return F.pad(t, (0, 0, 0, group.width - t.shape[-2]))

    return FastWeights(
        torch.cat([rows(p.w1) for p in parts], dim=1),
        torch.cat([p.w2 for p in parts], dim=1),
        torch.cat([rows(p.m1) for p in parts], dim=1),
        torch.cat([p.m2 for p in parts], dim=1),
    )


def unstack_group(fast: FastWeights, group: MemoryGroup, n_heads: int) -> dict[str, FastWeights]:
    if len(group.names) == 1:
        return {group.names[0]: fast}
    pieces = [t.split(n_heads, dim=1) for t in (fast.w1, fast.w2, fast.m1, fast.m2)]
    out = {}
    for i, (name, d_out) in enumerate(zip(group.names, group.outs, strict=True)):
        w1, w2, m1, m2 = (p[i] for p in pieces)
        out[name] = FastWeights(w1[..., :d_out, :], w2, m1[..., :d_out, :], m2)
    return out


@dataclass
class ChunkCarry:
    """What the chunk loop carries from one C_o chunk to the next."""

    stacks: dict[str, FastWeights]  # each group's stacked state, by group key
    pending: list[Generated]  # C_o chunks generated since M_mem's last write
    pending_len: int
    chunks_done: int  # C_o chunks written so far (truncation windows)
    partial: Generated | None  # a partial C_o chunk (read, written once complete)
    live_from: int = 0  # pass A: first token whose contributions the memories hold in graph
    # ``pending`` as one fused step left it: rows [B, H, P, 3, d_h] (k, v, q) and gates
    # [B, H, P, 2] (eta, alpha); None once anything else changed it (smt_fused.py)
    packed: tuple[Tensor, Tensor] | None = None
    bias: Tensor | None = None  # b_alpha [B, H] as the last fused step carried it

    def copy(self) -> ChunkCarry:
        return ChunkCarry(
            dict(self.stacks), list(self.pending), self.pending_len, self.chunks_done,
            self.partial, self.live_from, self.packed, self.bias,
        )  # fmt: skip

    def detach_memories(self) -> ChunkCarry:
        """Write-gradient truncation: the memories leave the graph (``chunk_loop``)."""
        out = self.copy()
        out.stacks = {key: m.detach() for key, m in self.stacks.items()}
        return out

    def cut_at(self, start: int) -> ChunkCarry:
        """Teach pass A's piece cut: all the carry holds leaves the graph; live from
        token ``start``."""
        out = self.detach_memories()
        out.pending = [detach_generated(g) for g in self.pending]
        out.partial = None if self.partial is None else detach_generated(self.partial)
        out.live_from, out.packed = start, None
        return out


@dataclass(frozen=True)
class CallPlan:
    """What every chunk step of one forward call shares."""

    plan: tuple[MemoryGroup, ...]
    flush: MemoryGroup  # the group holding M_mem, written every C_m tokens
    backend: str  # of each write; "torch" inside a compiled step
    seq: int
    pieces: PieceGrid | None
    # SelfModifyingTitans._generate / ._write, or their torch.compile'd forms
    generate: Callable[..., Generated]
    write: Callable[..., tuple[FastWeights, Tensor | None]]
    # smt_frozen.frozen_segment (or its compiled form): M_mem's reads inside a segment
    segment: Callable[..., tuple[Tensor, FastWeights | None]]
    # b_alpha as [B, H] when complete chunks run as one ``hope::smt_step`` (smt_fused.py)
    step_bias: Tensor | None = None

    @classmethod
    def build(
        cls,
        plan: tuple[MemoryGroup, ...],
        backend: str,
        seq: int,
        pieces: PieceGrid | None,
        steps: tuple[Callable[..., Generated], Callable[..., Any], Callable[..., Any]],
    ) -> CallPlan:
        """``steps``: the generation, the write and the frozen-segment read."""
        flush = next(g for g in plan if "mem" in g.names)
        generate, write, segment = steps
        if backend != "compile":
            return cls(plan, flush, backend, seq, pieces, generate, write, segment)
        # Compile the chunk step's generation and writes (fused memory pass,
        # factors, curvature and closed-form update in one graph each), not only
        # the closed form (alone, that was no faster on a 2-core CPU).
        return cls(
            plan, flush, "torch", seq, pieces, compiled(generate), compiled(write),
            compiled(segment),
        )  # fmt: skip

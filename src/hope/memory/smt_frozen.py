"""Frozen-base reads of the SMT's M_mem inside a write chunk (MECHANISMS §8.2; opt-in).

With ``model.smt_read_chunk`` = R < C (C = ``smt_chunk`` = ``smt_mem_chunk``), a
write chunk of C tokens is a segment: every memory generates and takes its inner
gradients at the segment-start state, as for any chunk (eqs. 83, 88), but M_mem is
read every R tokens at the state its writes of the segment's earlier tokens reached
(eq. 94, read before write at R-token granularity). That is the token recurrence of
eq. 88 with the gradients frozen at the segment start: titans-pytorch's parallel
form, here with the SMT's DGD write. R = C is the exact chunked SMT.

The state before read chunk f is the segment's write restricted to its first
b = f·R tokens. All boundaries are computed at once, as copies along the head axis of
one write in which copy f masks the tokens t >= b (eta_t = 0, alpha_t = 1: they
neither write nor decay, so each masked closed form equals the write of the prefix).
The overshoot bound of each copy sees only its prefix (masked steps are 0), so a read
depends on earlier tokens only and a segment streamed over several calls reads what
one call reads. Per segment: one batched write and one batched read instead of C/R
sequential chunk steps (fewer kernel launches), for C/R + 1 copies of the write's
arithmetic.

Outer-gradient cuts are per read (``ReadSpan``): under ``write_grad=stopgrad`` a read
past the segment start sees its state without a graph (as a read after a detached
write); in teach pass A a read keeps the paths from tokens of its own piece only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils._python_dispatch import _disable_current_modes

from hope.memory.config import SMTConfig
from hope.memory.ops.dispatch import dgd_write
from hope.memory.ops.stacking import repeat_heads
from hope.memory.pieces import PieceGrid
from hope.memory.residual_mlp import (
    FastWeights,
    GradFactors,
    Objective,
    Residual,
    chunk_pass,
    mlp_apply,
)
from hope.memory.smt_state import CallPlan, Generated, bounded_eta


@dataclass(frozen=True)
class ReadSpan:
    """Tokens [lo, hi) of a segment that read the state at offset ``bound`` (a multiple
    of R). The writes of tokens before ``cut`` reach that state without a graph, and
    ``base_graph`` says whether the segment-start state keeps its graph."""

    bound: int
    lo: int
    hi: int
    cut: int = 0
    base_graph: bool = True


def read_spans(
    first: int,
    length: int,
    read_chunk: int,
    stopgrad: bool = False,
    pieces: PieceGrid | None = None,
    at: int = 0,
    live_from: int = 0,
) -> tuple[ReadSpan, ...]:
    """The reads of the segment tokens [first, length).

    ``pieces`` (teach pass A): ``at`` is the call index of segment token 0 and
    ``live_from`` the first call token whose contributions the segment-start state
    holds in graph (``chunk_loop``; >= ``at`` when it holds none). A read keeps the
    paths from the earlier tokens of its own piece. Where the segment-start state
    holds graph from another piece (and so do the inputs generated from it), the
    read's state is detached whole: those within-piece paths are lost too (part of the
    mode's deviation, docs/FAITHFULNESS.md)."""
    spans = []
    for bound in range(first - first % read_chunk, length, read_chunk):
        lo, hi = max(bound, first), min(bound + read_chunk, length)
        runs = [(lo, hi)] if pieces is None else _piece_runs(lo, hi, pieces, at)
        for a, z in runs:
            cut, base = (bound, False) if stopgrad and bound > 0 else (0, True)
            if pieces is not None:
                piece = pieces.piece_of(at + a)
                if live_from < at and pieces.piece_of(live_from) != piece:
                    cut, base = bound, False
                else:  # tokens of earlier pieces write without a graph
                    piece_start = piece * pieces.size - pieces.offset - at
                    cut = max(cut, min(max(piece_start, 0), bound))
            spans.append(ReadSpan(bound, a, z, cut, base))
    return tuple(spans)


def _piece_runs(lo: int, hi: int, pieces: PieceGrid, at: int) -> list[tuple[int, int]]:
    """[lo, hi) (segment offsets) cut where a piece of the call's grid ends."""
    runs, a = [], lo
    while a < hi:
        end = (pieces.piece_of(at + a) + 1) * pieces.size - pieces.offset - at
        runs.append((a, min(hi, end)))
        a = min(hi, end)
    return runs


def _on_device(values: list[int] | list[bool], device: torch.device) -> Tensor:
    """A small constant tensor on ``device``, read only: uploaded once per (values,
    device) and cached, so a step reads no host tensor (a CUDA graph can capture it,
    hope.train.graphed). The upload is copied without waiting for the device
    (``torch.tensor(..., device=cuda)`` would synchronise the step's stream) and is a
    one-time cost, hidden from dispatch modes (launch counts do not depend on it)."""
    return _device_constant(tuple(values), device)


@functools.lru_cache(maxsize=256)  # span layouts x devices: a few per shape
def _device_constant(values: tuple[int | bool, ...], device: torch.device) -> Tensor:
    with _disable_current_modes():
        return torch.tensor(values).to(device, non_blocking=True)


def _prefix_gates(eta: Tensor, alpha: Tensor, bounds: list[int]) -> tuple[Tensor, Tensor]:
    """eta, alpha [B, H, L] -> [B, n*H, L], copy j restricted to tokens < bounds[j]."""
    batch, heads, length = eta.shape
    position = torch.arange(length, device=eta.device)
    limit = _on_device(bounds, eta.device)
    inside = (position < limit[:, None])[None, :, None, :]  # [1, n, 1, L]
    eta_m = torch.where(inside, eta.unsqueeze(1), torch.zeros_like(eta).unsqueeze(1))
    alpha_m = torch.where(inside, alpha.unsqueeze(1), torch.ones_like(alpha).unsqueeze(1))
    copies = len(bounds) * heads
    return eta_m.reshape(batch, copies, length), alpha_m.reshape(batch, copies, length)


def _detach_where(t: Tensor, mask: Tensor, copies: int) -> Tensor:
    """t [B, n*H, ...] (n copies along the head axis): where ``mask`` holds (it
    broadcasts against [B, n, H, ...]), the values without their graph."""
    shaped = t.reshape(t.shape[0], copies, -1, *t.shape[2:])
    return torch.where(mask, shaped.detach(), shaped).reshape(t.shape)


@dataclass
class _WriteInputs:
    """One batched DGD write's inputs, copies stacked along the head axis."""

    base: list[Tensor]  # w1, w2, m1, m2
    k: Tensor
    target: Tensor
    factors: list[Tensor]  # e, a, d, pre
    eta: Tensor
    alpha: Tensor
    coupling: Tensor

    def join(self, other: _WriteInputs) -> _WriteInputs:
        def cat(a: Tensor, b: Tensor) -> Tensor:
            return torch.cat([a, b], dim=1)

        return _WriteInputs(
            [cat(a, b) for a, b in zip(self.base, other.base, strict=True)],
            cat(self.k, other.k), cat(self.target, other.target),
            [cat(a, b) for a, b in zip(self.factors, other.factors, strict=True)],
            cat(self.eta, other.eta), cat(self.alpha, other.alpha),
            cat(self.coupling, other.coupling),
        )  # fmt: skip


def _read_copies(whole: _WriteInputs, gen: Generated, spans: tuple[ReadSpan, ...]) -> _WriteInputs:
    """M_mem's write restricted to each span's prefix (``whole``: M_mem's own inputs,
    [B, H, ...]), with each span's graph cuts."""
    n, length, device = len(spans), gen.length, gen.k.device
    k, target, *factors = (repeat_heads(t, n) for t in (whole.k, whole.target, *whole.factors))
    base = [repeat_heads(t, n) for t in whole.base]
    eta, alpha = _prefix_gates(gen.eta, gen.alpha, [c.bound for c in spans])
    if any(c.cut for c in spans):  # tokens before a copy's cut write without a graph
        cut = _on_device([c.cut for c in spans], device)
        early = (torch.arange(length, device=device) < cut[:, None])[None, :, None, :]
        k, target, *factors = (
            _detach_where(t, early.unsqueeze(-1), n) for t in (k, target, *factors)
        )
        eta, alpha = (_detach_where(t, early, n) for t in (eta, alpha))
    if not all(c.base_graph for c in spans):
        cut_base = _on_device([not c.base_graph for c in spans], device)
        base = [_detach_where(t, cut_base.view(1, n, 1, 1, 1), n) for t in base]
    return _WriteInputs(base, k, target, factors, eta, alpha, repeat_heads(whole.coupling, n))


def frozen_segment(
    fast: FastWeights,
    gen: Generated,
    spans: tuple[ReadSpan, ...],
    complete: bool,
    read_chunk: int,
    objective: Objective,
    precondition: bool,
    backend: str,
    residual: Residual = True,
    members: int = 1,
) -> tuple[Tensor, FastWeights | None]:
    """The reads of ``spans`` and, when ``complete``, the memories' state after the
    segment.

    A deviation (a throughput mode; docs/FAITHFULNESS.md gives its measured quality
    cost): the exact SMT re-takes every gradient and generation at each C_o chunk.

    ``fast``: a stack of ``members`` memories at the segment start [B, members*H, ...]
    (``smt_state.stack_group``, ``residual`` its flags), M_mem last; ``gen``: the
    segment's L tokens generated so far. One batched write holds M_mem's read copies
    and, when ``complete``, the whole stack's write. Returns the reads
    [B, H, tokens of the spans, d_h] in span order and the stack's state (None while
    the segment is partial).
    """
    heads = gen.k.shape[1]
    step = chunk_pass(
        fast.w1, fast.w2, gen.v, gen.k, None, objective, residual,
        fused=backend == "fused", members=members,
    )  # fmt: skip
    fac = step.factors
    stack = _WriteInputs(
        [fast.w1, fast.w2, fast.m1, fast.m2],
        repeat_heads(step.keys, fast.w1.shape[1] // step.keys.shape[1]), step.target,
        [fac.e, fac.a, fac.d, fac.pre], repeat_heads(gen.eta, members),
        repeat_heads(gen.alpha, members), step.coupling,
    )  # fmt: skip
    mem = _WriteInputs(*(_last_heads(getattr(stack, f.name), heads) for f in fields(stack)))
    inputs = _read_copies(mem, gen, spans)
    if complete:
        inputs = inputs.join(stack)
    states = dgd_write(
        FastWeights(*inputs.base), inputs.k, inputs.target,
        bounded_eta(inputs.eta, inputs.coupling, backend), inputs.alpha, objective=objective,
        residual=residual, precondition=precondition,
        momentum=0.0, backend=backend, factors=GradFactors(*inputs.factors),
    )  # fmt: skip
    reads_n = len(spans) * heads
    # Each span's queries, padded to R tokens: one batched read for all copies.
    queries = [F.pad(gen.q[:, :, c.lo : c.hi], (0, 0, 0, read_chunk - c.hi + c.lo)) for c in spans]
    out = mlp_apply(states.w1[:, :reads_n], states.w2[:, :reads_n], torch.cat(queries, 1), True)
    parts = out.split(heads, dim=1)
    reads = torch.cat([o[:, :, : c.hi - c.lo] for o, c in zip(parts, spans, strict=True)], 2)
    if not complete:
        return reads, None
    last = (states.w1, states.w2, states.m1, states.m2)
    return reads, FastWeights(*(t[:, reads_n:] for t in last))


def segment_reads(
    cfg: SMTConfig,
    loop: CallPlan,
    held: tuple[FastWeights, Residual],
    gen: Generated,
    at: tuple[int, int, int],
    complete: bool = False,
) -> tuple[Tensor, FastWeights | None]:
    """M_mem's reads of the segment's new tokens and, when ``complete``, the stack's
    state after the segment (``frozen_segment``). ``held``: the stack holding M_mem
    (``loop.flush``: all memories, or M_mem alone in the naive oracle) and its
    residual flags; ``at``: (segment offset and call index of the first new token, the
    carry's ``live_from``)."""
    read_chunk = cast(int, cfg.read_chunk)
    first, start, live_from = at
    spans = read_spans(
        first, gen.length, read_chunk, cfg.write_grad == "stopgrad", loop.pieces,
        start - first, live_from,
    )  # fmt: skip
    fast, residual = held
    return loop.segment(
        fast, gen, spans, complete, read_chunk, cfg.objective, cfg.precondition,
        loop.backend, residual, len(loop.flush.names),
    )  # fmt: skip


def _last_heads(t: Tensor | list[Tensor], heads: int) -> Any:
    """M_mem's part of a stacked tensor (or list of them): its last ``heads`` heads."""
    if isinstance(t, list):
        return [x[:, -heads:] for x in t]
    return t[:, -heads:]

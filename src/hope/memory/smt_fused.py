"""The SMT's chunk step as one operator, ``hope::smt_step`` (memory backend ``fused``).

Under the SMT's default rule (preconditioned DGD without momentum, reads at the
chunk-start state) a complete C_o chunk is the generation (eq. 83), the write of every
memory written every C_o tokens (eqs. 84, 88), M_mem's read (eq. 94) and, when
C_m > C_o, M_mem's pending tokens and its write once they make C_m: one launch each way
(``memory/ops/smt_step.py``). The step's outputs carry M_mem's state, the pending
tokens and b_alpha to the next step, so each is one step's input and autograd sums no
gradients between steps. Teach pass A's piece cuts act on the carry between steps
(``chunk_loop``). Partial chunks take the per-operator path; both paths write M_mem
from the same pending tokens (``write_pending`` is the per-operator one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from hope.memory.ops.smt_step import smt_step
from hope.memory.ops.smt_walk import smt_walk
from hope.memory.pieces import PieceGrid
from hope.memory.smt_state import (
    CallPlan,
    ChunkCarry,
    ChunkInputs,
    Generated,
    MemoryGroup,
    join_generated,
)

if TYPE_CHECKING:
    from hope.memory.residual_mlp import FastWeights
    from hope.memory.smt import SelfModifyingTitans


def write_pending(
    smt: SelfModifyingTitans, carry: ChunkCarry, gen: Generated, loop: CallPlan
) -> None:
    """Adds a written C_o chunk to M_mem's pending ones and, once they make C_m tokens,
    writes M_mem from them as one chunk (in place in ``carry``)."""
    carry.pending.append(gen)
    carry.pending_len += gen.length
    carry.packed = None
    if carry.pending_len == smt.cfg.mem_chunk:
        pending, flush = carry.pending, loop.flush
        joined = pending[0] if len(pending) == 1 else join_generated(pending)
        carry.stacks[flush.key] = loop.write(
            smt, carry.stacks[flush.key], flush, joined, loop.backend
        )[0]
        carry.pending, carry.pending_len = [], 0


def _packed(carry: ChunkCarry, work: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """The pending tokens as ``hope::smt_step`` takes them (rows, gates), or None."""
    if not carry.pending:
        return None
    if carry.packed is not None:
        return carry.packed
    gen = join_generated(carry.pending)
    rows = torch.stack((gen.k, gen.v, gen.q), dim=3).to(work)
    return rows, torch.stack((gen.eta, gen.alpha), dim=-1).to(work)


class _Operands(NamedTuple):
    """What ``hope::smt_step`` and ``hope::smt_walk`` take from the carry."""

    group: MemoryGroup  # the written stack: the generators first, M_mem last when C_o = C_m
    fast: FastWeights
    mem: FastWeights | None  # M_mem apart (C_o < C_m), else None
    scale: Tensor | None
    residual: bool
    bias: Tensor  # b_alpha [B, H]: the call's, or the copy the last step carried


def _operands(
    smt: SelfModifyingTitans, carry: ChunkCarry, loop: CallPlan, bias: Tensor
) -> _Operands:
    group, flush = loop.plan[0], loop.flush
    fast = carry.stacks[group.key]
    residual = smt._residual(group)
    scale = residual.reshape(-1) if isinstance(residual, Tensor) else None
    mem = None if group is flush else carry.stacks[flush.key]
    carried = bias.to(fast.w1.dtype) if carry.bias is None else carry.bias
    return _Operands(group, fast, mem, scale, residual is True, carried)


def fused_chunk_step(
    smt: SelfModifyingTitans, carry: ChunkCarry, xq: ChunkInputs, loop: CallPlan, bias: Tensor
) -> tuple[ChunkCarry, Tensor]:
    """One complete C_o chunk (``SelfModifyingTitans._chunk_step``) through
    ``hope::smt_step``; ``carry`` is the step's own copy, updated in place. ``bias``:
    b_alpha expanded to [B, H] once per call (the first step's input; later steps take
    the copy the previous one carried)."""
    xc, query = xq
    group, fast, mem, scale, residual, bias = _operands(smt, carry, loop, bias)
    flush, work = loop.flush, fast.w1.dtype
    pending = None if mem is None else _packed(carry, work)
    writes_mem = mem is not None and carry.pending_len + xc.shape[2] == smt.cfg.mem_chunk
    out = smt_step(
        fast.w1, fast.w2, xc.to(work), None if query is None else query.to(work),
        None if mem is None else mem.w1, None if mem is None else mem.w2, bias, scale,
        *(pending or (None, None)), residual, smt.cfg.objective == "dot",
        smt.cfg.eta_scale, len(group.generators), writes_mem,
    )  # fmt: skip
    carry.stacks[group.key] = fast.with_weights(*out[:4])
    carry.bias = out[11]  # b_alpha carried: the next step's input, not a second use of this one
    if mem is not None and writes_mem:
        carry.stacks[flush.key] = mem.with_weights(*out[7:11])
        carry.pending, carry.pending_len, carry.packed = [], 0, None
    elif mem is not None:
        carry.stacks[flush.key] = mem.with_weights(out[7], out[8], mem.m1, mem.m2)  # carried
        rows, gates = out[4], out[5]
        carry.pending = [Generated(*rows.unbind(3), *gates.unbind(-1))]
        carry.pending_len, carry.packed = rows.shape[2], (rows, gates)
    carry.chunks_done += 1
    return carry, out[6]


def fused_walk(
    smt: SelfModifyingTitans,
    carry: ChunkCarry,
    chunks: Sequence[tuple[int, ChunkInputs]],
    loop: CallPlan,
    inputs: Callable[[int, int], ChunkInputs],
    pieces: PieceGrid | None,
    keep: bool,
) -> tuple[ChunkCarry, Tensor] | None:
    """``chunks`` as one ``hope::smt_walk`` (the chunk loop's walk, ``chunk_loop``), or
    None unless they are whole periods of M_mem's write of complete chunks, none
    pending, and, with teach pass A's ``pieces``, start a piece whose length is whole
    periods. ``inputs(start, tokens)``: the call's x~ and x~ W_q [B, H, tokens, d_h]
    from token ``start`` on (``span_views``), read in place. ``keep``: the walk keeps what its
    backward reads, else reruns its forward there."""
    cfg, size = smt.cfg, smt.cfg.chunk
    period = 1 if loop.plan[0] is loop.flush else cfg.mem_chunk // size
    whole = all(xq[0].shape[2] == size for _, xq in chunks)
    if loop.step_bias is None or carry.partial is not None or carry.pending_len:
        return None
    if not chunks or not whole or len(chunks) % period:
        return None
    start = chunks[0][0]
    cut = 0 if pieces is None else pieces.size // size
    if pieces is not None:
        aligned = pieces.size % size == 0 and (start + pieces.offset) % pieces.size == 0
        if not aligned or cut % period:
            return None
        if pieces.piece_of(carry.live_from) != pieces.piece_of(start):
            carry = carry.cut_at(start)
    x, query = inputs(start, len(chunks) * size)
    group, fast, mem, scale, residual, bias = _operands(smt, carry, loop, loop.step_bias)
    work = fast.w1.dtype
    out = smt_walk(
        fast.w1, fast.w2, x.to(work), None if query is None else query.to(work),
        None if mem is None else mem.w1, None if mem is None else mem.w2, bias, scale,
        residual, cfg.objective == "dot", cfg.eta_scale, len(group.generators), size,
        period, cut, keep,
    )  # fmt: skip
    carry = carry.copy()
    carry.stacks[group.key] = fast.with_weights(*out[:4])
    carry.bias = out[9]
    if mem is not None:
        carry.stacks[loop.flush.key] = mem.with_weights(*out[5:9])
        carry.pending, carry.pending_len, carry.packed = [], 0, None
    if pieces is not None:  # live from the last piece's start, as its cut left it
        last = chunks[-1][0]
        carry.live_from = max(carry.live_from, last - (last + pieces.offset) % pieces.size)
    carry.chunks_done += len(chunks)
    return carry, out[4]


def span_views(inputs: ChunkInputs) -> Callable[[int, int], ChunkInputs]:
    """Views of the call's x~ and x~ W_q [B, H, T, d_h] over [start, start + tokens): the
    tensors themselves for the whole call, one piece of a split of the call into spans
    of that length when it starts one (one gradient join for all of them in backward,
    not a zero-filled slice and a sum per walk), else a slice."""
    splits: dict[int, list[ChunkInputs]] = {}

    def view(start: int, tokens: int) -> ChunkInputs:
        x, query = inputs
        if start == 0 and tokens == x.shape[2]:
            return x, query
        if start % tokens:
            span = slice(start, start + tokens)
            return x[:, :, span], None if query is None else query[:, :, span]
        if tokens not in splits:
            parts = [t.split(tokens, dim=2) for t in (x, query) if t is not None]
            splits[tokens] = [
                (p[0], p[1] if len(p) > 1 else None) for p in zip(*parts, strict=True)
            ]
        return splits[tokens][start // tokens]

    return view

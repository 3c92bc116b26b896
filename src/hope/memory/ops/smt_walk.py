"""A run of the SMT's complete chunk steps as one operator (backend ``fused``):
``hope::smt_walk`` and its backward.

``hope::smt_step`` (``smt_step.py``) is one C_o chunk each way; at the pilot chunking
a 4K row is 512 of them per layer and pass, each a kernel launch forward, backward and
again in the checkpointed recompute. This operator walks N chunks (whole periods of
M_mem's write, starting with none pending: R = C_m / C_o chunks each) from one carry:

  forward: chunk after chunk, each chunk step reading the state the last one wrote;
  backward: every chunk's input state (kept by the forward, or the forward again:
  what activation checkpointing of the same segment would rerun), then the chunk
  steps' backwards from the last chunk to the first, each chunk's output gradients
  the next one's input gradients.

By default only the inputs are saved for backward, so a walk is one checkpointed
segment of the chunk loop (``chunk_loop``): the same values and gradients as the
segment's chunk steps, in one launch each way on CUDA (``triton_walk.py``) instead of
3N. With ``keep`` the forward keeps every chunk's input state instead (as the chunk
steps' own graph would) and the backward does not rerun it. With ``cut`` = K no
gradient crosses from a chunk to the next one's state after every K chunks: teach
pass A's piece cuts (MECHANISMS §8.3b), K chunks a piece; b_alpha's carried copy is
not cut, as ``ChunkCarry.cut_at`` leaves it. Elsewhere the chunk steps' PyTorch forms
in a loop, which is this operator's reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.memory.ops.smt_step import smt_step_backward_reference, smt_step_reference

# w1, w2 (the written stack), x, query [B, H, N*C, I], r1, r2 (M_mem apart, or None),
# alpha_bias [B, H], scale: as ``smt_step`` takes them for the walk's first chunk
WalkInputs = tuple[Tensor | None, ...]
# W1', W2', inc1, inc2 of the stack after the last chunk; the reads [B, H, N*C, O];
# M_mem's W1', W2', inc1, inc2 after its last write (empty when it is in the stack);
# alpha_bias carried; then, with ``keep``, what the backward reads (``KEPT``), else empty
WalkResult = tuple[  # sixteen tensors, as the operator's schema states them
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
]  # fmt: skip
WalkOptions = tuple[bool, bool, float, int, int, int]  # + chunk C, period R (chunks)
# The kept forward: chunk c's input stack [N, B, G*H, O, M] and [N, B, G*H, M, I] and
# M_mem [N, B, H, O, M] and [N, B, H, M, I] (slot 0 unused: chunk 0's are the inputs),
# and its rows and gates, dense [B, H, P + C, 3, I] and [B, H, P + C, 2] from the start
# of slot c of [N, B*H*C_m*3*I] and [N, B*H*C_m*2]
KEPT = 6
# a chunk step's inputs and flush flag, and the rows and gates it output
StepRecord = tuple[tuple[Tensor | None, ...], bool, Tensor, Tensor]
StepCall = tuple[tuple[Tensor | None, ...], bool]  # a chunk step's inputs and flush flag


def _chunk(t: Tensor | None, c: int, size: int) -> Tensor | None:
    return None if t is None else t[:, :, c * size : (c + 1) * size]


def _walk(
    inputs: WalkInputs, options: WalkOptions, records: list[StepRecord] | None = None
) -> tuple[Tensor, ...]:
    """The chunk steps one after another; ``records`` collects each step's inputs."""
    w1, w2, x, query, r1, r2, bias, scale = inputs
    residual, dot, eta_scale, generators, size, period = options
    assert x is not None and bias is not None
    pending: tuple[Tensor | None, Tensor | None] = (None, None)
    reads: list[Tensor] = []
    out: tuple[Tensor, ...] = ()
    for c in range(x.shape[2] // size):
        flush = r1 is not None and c % period == period - 1
        step = (w1, w2, _chunk(x, c, size), _chunk(query, c, size), r1, r2, bias, scale, *pending)
        out = smt_step_reference(step, (residual, dot, eta_scale, generators, flush))
        if records is not None:
            records.append((step, flush, out[4], out[5]))
        w1, w2 = out[0], out[1]
        reads.append(out[6])
        if r1 is not None:
            r1, r2 = out[7], out[8]
            pending = (None, None) if flush else (out[4], out[5])
    return (*out[:4], torch.cat(reads, dim=2), *out[7:])


def _kept(inputs: WalkInputs, records: list[StepRecord]) -> list[Tensor]:
    """The ``KEPT`` tensors from the steps' records, laid out as the kernels keep them."""
    x = inputs[2]
    assert x is not None
    b, h, _, i = x.shape
    tokens = b * h * records[-1][2].shape[2]  # the flushing chunk's rows: C_m tokens
    kept = []
    for j in (0, 1, 4, 5):
        first = records[0][0][j]
        if first is None:
            kept.append(x.new_empty(0))
            continue
        later = [step[j] for step, *_ in records[1:]]
        kept.append(torch.stack([torch.zeros_like(first), *later]))  # type: ignore[list-item]
    for width, held in ((3 * i, [r[2] for r in records]), (2, [r[3] for r in records])):
        flat = [F.pad(t.reshape(-1), (0, tokens * width - t.numel())) for t in held]
        kept.append(torch.stack(flat))
    return kept


def smt_walk_reference(
    inputs: WalkInputs, options: WalkOptions, keep: bool = False
) -> tuple[Tensor, ...]:
    """The forward in PyTorch ops (module docstring)."""
    records: list[StepRecord] | None = [] if keep else None
    out = _walk(inputs, options, records)
    x = inputs[2]
    assert x is not None
    if records is None:
        return (*out, *(x.new_empty(0) for _ in range(KEPT)))
    return (*out, *_kept(inputs, records))


def _kept_steps(
    inputs: WalkInputs, options: WalkOptions, kept: tuple[Tensor, ...]
) -> list[StepCall]:
    """Every chunk step's inputs and flush flag read back from the ``KEPT`` forward."""
    w1, w2, x, query, r1, r2, bias, scale = inputs
    size, period = options[4], options[5]
    assert x is not None
    b, h, _, i = x.shape
    steps: list[StepCall] = []
    for c in range(x.shape[2] // size):
        j = c % period
        state = (w1, w2, r1, r2) if c == 0 else tuple(
            None if t is None else kept[k][c] for k, t in enumerate((w1, w2, r1, r2))
        )  # fmt: skip
        pending: tuple[Tensor | None, Tensor | None] = (None, None)
        if r1 is not None and j:  # the last chunk's rows and gates, j C tokens
            held = b * h * j * size
            rows, gates = kept[4][c - 1], kept[5][c - 1]
            pending = (rows[: held * 3 * i].view(b, h, j * size, 3, i),
                       gates[: held * 2].view(b, h, j * size, 2))  # fmt: skip
        step = (state[0], state[1], _chunk(x, c, size), _chunk(query, c, size), state[2],
                state[3], bias, scale, *pending)  # fmt: skip
        steps.append((step, r1 is not None and j == period - 1))
    return steps


def smt_walk_backward_reference(
    inputs: WalkInputs,
    options: WalkOptions,
    grads: tuple[Tensor | None, ...],
    cut: int = 0,
    kept: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor | None, ...]:
    """d(w1, w2, x, query, r1, r2, alpha_bias) given d(outputs) (None where zero): every
    step's inputs (from the ``kept`` forward, else the forward again), then the steps'
    backwards last to first (``smt_step_backward_reference``), none but b_alpha's
    crossing a cut after every ``cut`` chunks."""
    x, query = inputs[2], inputs[3]
    residual, dot, eta_scale, generators, size, _ = options
    assert x is not None
    records: list[StepCall]
    if kept is not None:
        records = _kept_steps(inputs, options, kept)
    else:
        ran: list[StepRecord] = []
        with torch.no_grad():
            _walk(inputs, options, ran)
        records = [(step, flush) for step, flush, _, _ in ran]
    g_w1, g_w2, g_inc1, g_inc2, g_read, g_m1, g_m2, g_minc1, g_minc2, g_bias = grads[:10]
    chained: list[Tensor | None] = [g_w1, g_w2, g_m1, g_m2, g_bias, None, None]
    d_x = torch.empty_like(x)
    d_query = None if query is None else torch.empty_like(query)
    for c in range(len(records) - 1, -1, -1):
        step, flush = records[c]
        last = c == len(records) - 1
        if cut and not last and (c + 1) % cut == 0:  # the next chunk's state was detached
            chained[:4] = [None] * 4
        step_grads = (
            chained[0], chained[1], g_inc1 if last else None, g_inc2 if last else None,
            chained[5], chained[6], _chunk(g_read, c, size), chained[2], chained[3],
            g_minc1 if last else None, g_minc2 if last else None, chained[4],
        )  # fmt: skip
        d = smt_step_backward_reference(step, (residual, dot, eta_scale, generators, flush),
                                        step_grads)  # fmt: skip
        d_x[:, :, c * size : (c + 1) * size] = d[2]  # type: ignore[assignment]
        if d_query is not None:
            d_query[:, :, c * size : (c + 1) * size] = d[3]  # type: ignore[assignment]
        chained = [d[0], d[1], d[4], d[5], d[6], d[7], d[8]]
    r1, r2 = inputs[4], inputs[5]
    if r1 is not None and r2 is not None and chained[2] is None:  # as the kernel: zeros
        chained[2:4] = [torch.zeros_like(r1), torch.zeros_like(r2)]
    return (chained[0], chained[1], d_x, d_query, chained[2], chained[3], chained[4])


def walk_check(inputs: WalkInputs, options: WalkOptions, cut: int) -> None:
    """The walk's shapes: whole periods of whole chunks, R = 1 when M_mem is in the
    stack, cuts after whole periods."""
    x, r1 = inputs[2], inputs[4]
    size, period = options[4], options[5]
    assert x is not None
    if size < 1 or period < 1 or x.shape[2] % (size * period) or not x.shape[2]:
        raise ValueError(
            f"smt_walk: {x.shape[2]} tokens are not whole periods of {period} chunks of {size}"
        )
    if r1 is None and period != 1:
        raise ValueError("smt_walk: M_mem in the stack is written every chunk (period 1)")
    if cut < 0 or cut % period:
        raise ValueError(f"smt_walk: a cut every {cut} chunks is not after whole periods")


@torch.library.custom_op("hope::smt_walk", mutates_args=())
def smt_walk(
    w1: Tensor,
    w2: Tensor,
    x: Tensor,
    query: Tensor | None,
    r1: Tensor | None,
    r2: Tensor | None,
    alpha_bias: Tensor,
    scale: Tensor | None,
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    chunk: int,
    period: int,
    cut: int,
    keep: bool,
) -> WalkResult:
    """N = T / ``chunk`` chunk steps of ``hope::smt_step`` (its arguments, x and query
    [B, H, T, I] holding every chunk; no tokens pending at the start), M_mem apart
    written every ``period`` chunks; ``cut`` and ``keep`` as in the module docstring
    (``cut`` is the backward's: 0 for none). -> ``WalkResult``."""
    inputs = (w1, w2, x, query, r1, r2, alpha_bias, scale)
    options = (residual, dot, eta_scale, generators, chunk, period)
    walk_check(inputs, options, cut)
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_walk import smt_walk_triton

        return smt_walk_triton(inputs, options, keep)  # type: ignore[return-value]
    return smt_walk_reference(inputs, options, keep)  # type: ignore[return-value]


@smt_walk.register_fake
def _(
    w1: Tensor,
    w2: Tensor,
    x: Tensor,
    query: Tensor | None,
    r1: Tensor | None,
    r2: Tensor | None,
    alpha_bias: Tensor,
    scale: Tensor | None,
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    chunk: int,
    period: int,
    cut: int,
    keep: bool,
) -> WalkResult:
    b, h, t, _ = x.shape
    weights = [torch.empty_like(w) for w in (w1, w2, w1, w2)]
    mem = [x.new_empty(0) for _ in range(4)]  # four tensors: outputs may not alias
    if r1 is not None and r2 is not None:
        mem = [torch.empty_like(w) for w in (r1, r2, r1, r2)]
    read = x.new_empty(b, h, t, w1.shape[-2])
    kept = [x.new_empty(0) for _ in range(KEPT)]
    if keep:
        n, held = t // chunk, b * h * chunk * period
        kept = [x.new_empty(0) if w is None else w.new_empty(n, *w.shape) for w in (w1, w2, r1, r2)]
        kept += [x.new_empty(n, held * 3 * x.shape[-1]), x.new_empty(n, held * 2)]
    return (*weights, read, *mem, torch.empty_like(alpha_bias), *kept)  # type: ignore[return-value]


@torch.library.custom_op("hope::smt_walk_backward", mutates_args=())
def smt_walk_backward(
    saved: list[Tensor | None],
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    chunk: int,
    period: int,
    cut: int,
    grads: list[Tensor | None],
) -> list[Tensor]:
    """``smt_walk_backward_reference``; ``saved``: the inputs, then the ``KEPT``
    forward (empty: rerun it). Absent gradients are empty tensors."""
    w1 = saved[0]
    assert w1 is not None
    options = (residual, dot, eta_scale, generators, chunk, period)
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_walk import smt_walk_backward_triton

        out = smt_walk_backward_triton(tuple(saved), options, tuple(grads), cut)
    else:
        kept = tuple(t for t in saved[8:] if t is not None)  # outputs: never None
        forward = kept if kept and kept[0].numel() else None  # empty unless kept
        out = smt_walk_backward_reference(tuple(saved[:8]), options, tuple(grads), cut, forward)
    return [w1.new_empty(0) if t is None else t for t in out]


@smt_walk_backward.register_fake
def _(
    saved: list[Tensor | None],
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    chunk: int,
    period: int,
    cut: int,
    grads: list[Tensor | None],
) -> list[Tensor]:
    w1 = saved[0]
    assert w1 is not None
    return [w1.new_empty(0) if t is None else torch.empty_like(t) for t in saved[:7]]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: WalkResult) -> None:
    *tensors, residual, dot, eta_scale, generators, chunk, period, cut, _ = inputs
    ctx.save_for_backward(*tensors, *output[-KEPT:])
    ctx.mark_non_differentiable(*output[-KEPT:])
    ctx.options = (residual, dot, eta_scale, generators, chunk, period, cut)
    ctx.present = [t is not None for t in tensors]
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    # the kept forward's outputs get no gradient: nothing outside the walk reads them
    out = smt_walk_backward(list(ctx.saved_tensors), *ctx.options, list(grads[:-KEPT]))
    g = [*out, None]  # w1, w2, x, query, r1, r2, alpha_bias; scale gets none
    given = [
        t if here and t is not None and t.numel() else None
        for t, here in zip(g, ctx.present, strict=True)
    ]
    return (*given, *([None] * 8))


smt_walk.register_autograd(_backward, setup_context=_setup)

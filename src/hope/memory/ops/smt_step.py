"""The SMT's whole chunk step as one operator (backend ``fused``): ``hope::smt_step``
and its backward.

Per C_o chunk of x~ [B, H, C, d_h] (NL-arXiv eqs. 83, 84, 88, 94; ``memory/smt.py``):

  the generation: the generating members of the written stack on x~
  (``memory_apply``), then k, v, q, eta, alpha (``smt_generation``);
  the write of every member of the stack (``smt_write``: pass, bounded step, DGD);
  the read o = M_mem(q) at the chunk-start state: from the stack's last member when
  M_mem is written with it (C_o = C_m), else from M_mem's own state.

As separate operators that is three or four launches each way per chunk plus
autograd's sums of the gradients their shared inputs receive (the stacked state
feeds the generation and the write, k, v, q several writes and reads): ~20 launches
per chunk at the pilot chunking. Here it is one launch each way. The backward
recomputes the generation from the inputs.

On CUDA each direction is one Triton kernel (``triton_step.py``); elsewhere the
composition of the three operators' PyTorch forms, which is this operator's
reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hope.memory.ops.generation import (
    smt_generation_backward_reference,
    smt_generation_reference,
)
from hope.memory.ops.memory_apply import (
    memory_apply_backward_reference,
    memory_apply_reference,
)
from hope.memory.ops.smt_write import smt_write_backward_reference, smt_write_reference

# w1, w2 (the written stack), x, query, r1, r2 (M_mem apart), alpha_bias [B, H], scale,
# the pending tokens' rows [B, H, P, 3, I] (k, v, q) and gates [B, H, P, 2] (eta, alpha)
StepInputs = tuple[Tensor | None, ...]
# W1', W2', inc1, inc2 (the stack); rows [B, H, P + C, 3, I] and gates [B, H, P + C, 2] of
# the pending and this chunk's tokens; the read [B, H, C, O]; M_mem's W1', W2', inc1, inc2
# when it is written (``flush``), else its W1, W2 carried (inc1, inc2 empty; all empty
# when M_mem is in the stack); alpha_bias carried. The carried copies make each state
# the input of one step only, so autograd never sums a gradient between steps.
StepOutputs = tuple[Tensor, ...]
StepResult = tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor
]  # StepOutputs, as the operator's schema states it
StepOptions = tuple[bool, bool, float, int, bool]  # residual, dot, eta_scale, generators, flush


def _generation(inputs: StepInputs, options: StepOptions) -> tuple[Tensor, tuple[Tensor, ...]]:
    w1, w2, x, query, _, _, bias, scale = inputs[:8]
    residual, _, eta_scale, generators, _ = options
    assert w1 is not None and w2 is not None and x is not None and bias is not None
    raw = memory_apply_reference(w1, w2, x, scale, residual, 0, generators)
    return raw, smt_generation_reference(raw, query, bias, eta_scale)


def _write_inputs(inputs: StepInputs, gen: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """``smt_write``'s inputs: the stack, the generation, the queries when M_mem is the
    stack's last member."""
    w1, w2, _, _, r1, _, _, scale = inputs[:8]
    k, v, q, eta, alpha = gen
    return (w1, w2, k, v, q if r1 is None else None, eta, alpha, scale)


def _extended(inputs: StepInputs, gen: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The pending tokens' rows and gates followed by this chunk's."""
    rows, gates = torch.stack(gen[:3], dim=3), torch.stack(gen[3:], dim=-1)
    pend_rows, pend_gates = inputs[8:]
    if pend_rows is None or pend_gates is None:
        return rows, gates
    return torch.cat((pend_rows, rows), dim=2), torch.cat((pend_gates, gates), dim=2)


def _mem_inputs(inputs: StepInputs, rows: Tensor, gates: Tensor) -> tuple[Tensor | None, ...]:
    """M_mem's write (residual, shared k, v, eta, alpha of the C_m tokens, no reads)."""
    r1, r2 = inputs[4:6]
    return (r1, r2, rows[..., 0, :], rows[..., 1, :], None, gates[..., 0], gates[..., 1], None)


def smt_step_reference(inputs: StepInputs, options: StepOptions) -> StepOutputs:
    """The forward in PyTorch ops (module docstring)."""
    x, r1, r2, bias = inputs[2], inputs[4], inputs[5], inputs[6]
    residual, dot, flush = options[0], options[1], options[4]
    assert x is not None and bias is not None
    _, gen = _generation(inputs, options)
    out = smt_write_reference(_write_inputs(inputs, gen), residual, dot)  # type: ignore[arg-type]
    if r1 is None:
        read = out[4][:, -x.shape[1] :]
    else:
        assert r2 is not None
        read = memory_apply_reference(r1, r2, gen[2], None, True, 0, 1)
    rows, gates = _extended(inputs, gen)
    mem: tuple[Tensor, ...] = tuple(x.new_empty(0) for _ in range(4))
    if flush:
        mem = smt_write_reference(_mem_inputs(inputs, rows, gates), True, dot)[:4]  # type: ignore[arg-type]
    elif r1 is not None and r2 is not None:
        mem = (r1.clone(), r2.clone(), *mem[2:])
    return (*out[:4], rows, gates, read, *mem, bias.clone())


def smt_step_backward_reference(
    inputs: StepInputs, options: StepOptions, grads: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """d(w1, w2, x, query, r1, r2, alpha_bias [B, H], pending rows, pending gates) given
    d(outputs) (None where zero); None for absent inputs and for M_mem's state when it
    gets none."""
    w1, w2, x, query, r1, r2, _, scale, pend_rows, _ = inputs
    residual, dot, eta_scale, generators, flush = options
    assert w1 is not None and w2 is not None and x is not None
    g_w1, g_w2, g_inc1, g_inc2, g_rows, g_gates, g_read, *g_mem, g_bias_out = grads
    raw, gen = _generation(inputs, options)
    rows, gates = _extended(inputs, gen)
    d_rows = torch.zeros_like(rows) if g_rows is None else g_rows.clone()
    d_gates = torch.zeros_like(gates) if g_gates is None else g_gates.clone()
    d_r1 = d_r2 = None
    if flush and any(g is not None for g in g_mem):
        mem = _mem_inputs(inputs, rows, gates)
        d = smt_write_backward_reference(mem, True, dot, (*g_mem, None))  # type: ignore[arg-type]
        d_r1, d_r2, d_k, d_v, _, d_eta, d_alpha = d
        assert d_k is not None and d_v is not None and d_eta is not None and d_alpha is not None
        d_rows[..., 0, :] += d_k
        d_rows[..., 1, :] += d_v
        d_gates[..., 0] += d_eta
        d_gates[..., 1] += d_alpha
    elif not flush:  # M_mem carried unchanged
        d_r1, d_r2 = g_mem[0], g_mem[1]
    held = 0 if pend_rows is None else pend_rows.shape[2]
    now_rows, now_gates = d_rows[:, :, held:], d_gates[:, :, held:]
    g_gen = [*now_rows.unbind(3), *now_gates.unbind(-1)]
    g_reads = None
    if r1 is None and g_read is not None:  # the read is the stack's last member's
        g_reads = w1.new_zeros(*w1.shape[:2], *g_read.shape[2:])
        g_reads[:, -x.shape[1] :] = g_read
    write = _write_inputs(inputs, gen)
    d = smt_write_backward_reference(write, residual, dot, (g_w1, g_w2, g_inc1, g_inc2, g_reads))  # type: ignore[arg-type]
    d_w1, d_w2 = d[0], d[1]
    d_gen = [g if mine is None else mine + g for mine, g in zip(d[2:], g_gen, strict=True)]
    if r1 is not None and g_read is not None:
        assert r2 is not None
        a = memory_apply_backward_reference(r1, r2, gen[2], None, True, 0, 1, g_read)
        d_r1 = a[0] if d_r1 is None else d_r1 + a[0]
        d_r2 = a[1] if d_r2 is None else d_r2 + a[1]
        d_gen[2] = d_gen[2] + a[2]
    g_raw, g_query, g_bias = smt_generation_backward_reference(raw, query, gen[4], eta_scale, d_gen)  # type: ignore[arg-type]
    a = memory_apply_backward_reference(w1, w2, x, scale, residual, 0, generators, g_raw)
    assert d_w1 is not None and d_w2 is not None
    pending = (None, None) if pend_rows is None else (d_rows[:, :, :held], d_gates[:, :, :held])
    if _mem_gets_grad(r1, flush, list(grads)):
        assert r1 is not None and r2 is not None
        d_r1 = torch.zeros_like(r1) if d_r1 is None else d_r1
        d_r2 = torch.zeros_like(r2) if d_r2 is None else d_r2
    g_bias = g_bias if g_bias_out is None else g_bias + g_bias_out
    return (d_w1 + a[0], d_w2 + a[1], a[2], g_query, d_r1, d_r2, g_bias, *pending)


def _sizes_check(inputs: StepInputs, options: StepOptions) -> None:
    w1, _, x, query, r1, _, bias, _, pend_rows, pend_gates = inputs
    generators, flush = options[3], options[4]
    assert w1 is not None and x is not None and bias is not None
    b, heads = x.shape[:2]
    members = w1.shape[1] // heads
    if w1.shape[1] % heads or not 2 < generators < members + (r1 is not None):
        raise ValueError(f"smt_step: {generators} generators in a stack of {w1.shape[1]} heads")
    if generators != (4 if query is not None else 5) or bias.shape != (b, heads):
        raise ValueError(f"smt_step: {generators} generators, alpha_bias {tuple(bias.shape)}")
    if (r1 is None and (flush or pend_rows is not None)) or (pend_rows is None) != (
        pend_gates is None
    ):
        raise ValueError("smt_step: pending tokens and M_mem's write need M_mem apart")


def _mem_gets_grad(r1: Tensor | None, flush: bool, grads: list[Tensor | None]) -> bool:
    """Whether M_mem's state (apart) gets a gradient: from its read, its write or its
    carried copy."""
    return r1 is not None and any(g is not None for g in grads[6:11])


@torch.library.custom_op("hope::smt_step", mutates_args=())
def smt_step(
    w1: Tensor,
    w2: Tensor,
    x: Tensor,
    query: Tensor | None,
    r1: Tensor | None,
    r2: Tensor | None,
    alpha_bias: Tensor,
    scale: Tensor | None,
    pend_rows: Tensor | None,
    pend_gates: Tensor | None,
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    flush: bool,
) -> StepResult:
    """One SMT chunk step (module docstring). w1 [B, W*H, O, M], w2 [B, W*H, M, I]: the
    stack written this chunk, its first ``generators`` members M_k, M_v, [M_q,] M_eta,
    M_alpha; x, query (x W_q, or None when M_q generates q) [B, H, C, I]; r1, r2 M_mem's
    state [B, H, ...], or None when M_mem is the stack's last member; alpha_bias [B, H];
    ``scale``/``residual``/``dot`` as in ``smt_write``; the P tokens pending since M_mem's
    last write as rows [B, H, P, 3, I] (k, v, q) and gates [B, H, P, 2] (eta, alpha), or
    None; ``flush``: M_mem is written from them and this chunk (P + C = C_m). ->
    ``StepOutputs``."""
    inputs = (w1, w2, x, query, r1, r2, alpha_bias, scale, pend_rows, pend_gates)
    options = (residual, dot, eta_scale, generators, flush)
    _sizes_check(inputs, options)
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_step import smt_step_triton

        return smt_step_triton(inputs, options)  # type: ignore[return-value]
    return smt_step_reference(inputs, options)  # type: ignore[return-value]


@smt_step.register_fake
def _(
    w1: Tensor,
    w2: Tensor,
    x: Tensor,
    query: Tensor | None,
    r1: Tensor | None,
    r2: Tensor | None,
    alpha_bias: Tensor,
    scale: Tensor | None,
    pend_rows: Tensor | None,
    pend_gates: Tensor | None,
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    flush: bool,
) -> StepResult:
    b, h, c, i = x.shape
    tokens = c + (0 if pend_rows is None else pend_rows.shape[2])
    weights = [torch.empty_like(t) for t in (w1, w2, w1, w2)]  # four outputs, four tensors
    mem = [x.new_empty(0) for _ in range(4)]  # four tensors: outputs may not alias
    if r1 is not None and r2 is not None:
        mem[:2] = [torch.empty_like(r1), torch.empty_like(r2)]
    if flush and r1 is not None and r2 is not None:
        mem = [
            torch.empty_like(r1),
            torch.empty_like(r2),
            torch.empty_like(r1),
            torch.empty_like(r2),
        ]
    return (*weights, x.new_empty(b, h, tokens, 3, i), x.new_empty(b, h, tokens, 2),
            x.new_empty(b, h, c, w1.shape[-2]), *mem,
            torch.empty_like(alpha_bias))  # type: ignore[return-value]  # fmt: skip


@torch.library.custom_op("hope::smt_step_backward", mutates_args=())
def smt_step_backward(
    saved: list[Tensor | None],
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    flush: bool,
    grads: list[Tensor | None],
) -> list[Tensor]:
    """``smt_step_backward_reference``; ``saved``: the inputs, then the forward's rows
    and gates. Absent gradients are empty tensors."""
    w1 = saved[0]
    assert w1 is not None
    options = (residual, dot, eta_scale, generators, flush)
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_step import smt_step_backward_triton

        out = smt_step_backward_triton(tuple(saved), options, tuple(grads))
    else:
        out = smt_step_backward_reference(tuple(saved[:10]), options, tuple(grads))
    return [w1.new_empty(0) if t is None else t for t in out]


@smt_step_backward.register_fake
def _(
    saved: list[Tensor | None],
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    flush: bool,
    grads: list[Tensor | None],
) -> list[Tensor]:
    w1, w2, x, query, r1, r2, bias, _, pend_rows, pend_gates = saved[:10]
    assert w1 is not None and w2 is not None and x is not None and bias is not None
    mem = (r1, r2) if _mem_gets_grad(r1, flush, grads) else (None, None)
    like = [w1, w2, x, query, *mem, bias, pend_rows, pend_gates]
    return [w1.new_empty(0) if t is None else torch.empty_like(t) for t in like]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: StepResult) -> None:
    *tensors, residual, dot, eta_scale, generators, flush = inputs
    ctx.save_for_backward(*tensors, output[4], output[5])
    ctx.options = (residual, dot, eta_scale, generators, flush)
    ctx.present = [t is not None for t in tensors]
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    out = smt_step_backward(list(ctx.saved_tensors), *ctx.options, list(grads))
    # inputs' gradients in order (w1, w2, x, query, r1, r2, bias, scale, pend rows, gates)
    g = [*out[:7], None, *out[7:]]
    given = [
        t if here and t is not None and t.numel() else None
        for t, here in zip(g, ctx.present, strict=True)
    ]
    return (*given, *([None] * 5))


smt_step.register_autograd(_backward, setup_context=_setup)

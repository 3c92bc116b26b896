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

# w1, w2 (the written stack), x, query, r1, r2 (M_mem apart), alpha_bias [B, H], scale
StepInputs = tuple[
    Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor | None
]
# W1', W2', inc1, inc2, k, v, q, eta, alpha, read
StepOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
StepOptions = tuple[bool, bool, float, int]  # residual, dot, eta_scale, generators


def _generation(inputs: StepInputs, options: StepOptions) -> tuple[Tensor, tuple[Tensor, ...]]:
    w1, w2, x, query, _, _, bias, scale = inputs
    residual, _, eta_scale, generators = options
    raw = memory_apply_reference(w1, w2, x, scale, residual, 0, generators)
    return raw, smt_generation_reference(raw, query, bias, eta_scale)


def _write_inputs(inputs: StepInputs, gen: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """``smt_write``'s inputs: the stack, the generation, the queries when M_mem is the
    stack's last member."""
    w1, w2, _, _, r1, _, _, scale = inputs
    k, v, q, eta, alpha = gen
    return (w1, w2, k, v, q if r1 is None else None, eta, alpha, scale)


def smt_step_reference(inputs: StepInputs, options: StepOptions) -> StepOutputs:
    """The forward in PyTorch ops (module docstring)."""
    _, _, x, _, r1, r2, _, _ = inputs
    residual, dot = options[:2]
    _, gen = _generation(inputs, options)
    out = smt_write_reference(_write_inputs(inputs, gen), residual, dot)  # type: ignore[arg-type]
    if r1 is None:
        read = out[4][:, -x.shape[1] :]
    else:
        assert r2 is not None
        read = memory_apply_reference(r1, r2, gen[2], None, True, 0, 1)
    return (*out[:4], *gen, read)  # type: ignore[return-value]


def smt_step_backward_reference(
    inputs: StepInputs, options: StepOptions, grads: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """d(w1, w2, x, query, r1, r2, alpha_bias [B, H]) given d(outputs) (None where
    zero); None for an absent query and for M_mem's state when it gets none."""
    w1, w2, x, query, r1, r2, _, scale = inputs
    residual, dot, eta_scale, generators = options
    g_w1, g_w2, g_inc1, g_inc2, *g_gen, g_read = grads
    raw, gen = _generation(inputs, options)
    g_reads = None
    if r1 is None and g_read is not None:  # the read is the stack's last member's
        g_reads = w1.new_zeros(*w1.shape[:2], *g_read.shape[2:])
        g_reads[:, -x.shape[1] :] = g_read
    write = _write_inputs(inputs, gen)
    d = smt_write_backward_reference(write, residual, dot, (g_w1, g_w2, g_inc1, g_inc2, g_reads))  # type: ignore[arg-type]
    d_w1, d_w2 = d[0], d[1]
    d_gen: list[Tensor | None] = [
        mine if given is None else (given if mine is None else mine + given)
        for mine, given in zip(d[2:], g_gen, strict=True)
    ]
    d_r1 = d_r2 = None
    if r1 is not None and g_read is not None:
        assert r2 is not None
        d_r1, d_r2, d_q = memory_apply_backward_reference(r1, r2, gen[2], None, True, 0, 1, g_read)
        d_gen[2] = d_q if d_gen[2] is None else d_gen[2] + d_q
    g_raw, g_query, g_bias = smt_generation_backward_reference(raw, query, gen[4], eta_scale, d_gen)
    a = memory_apply_backward_reference(w1, w2, x, scale, residual, 0, generators, g_raw)
    assert d_w1 is not None and d_w2 is not None
    return d_w1 + a[0], d_w2 + a[1], a[2], g_query, d_r1, d_r2, g_bias


def _sizes_check(inputs: StepInputs, generators: int) -> None:
    w1, _, x, query, r1, _, bias, _ = inputs
    b, heads = x.shape[:2]
    members = w1.shape[1] // heads
    if w1.shape[1] % heads or not 2 < generators < members + (r1 is not None):
        raise ValueError(f"smt_step: {generators} generators in a stack of {w1.shape[1]} heads")
    if generators != (4 if query is not None else 5) or bias.shape != (b, heads):
        raise ValueError(f"smt_step: {generators} generators, alpha_bias {tuple(bias.shape)}")


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
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
) -> StepOutputs:
    """One SMT chunk step (module docstring). w1 [B, W*H, O, M], w2 [B, W*H, M, I]: the
    stack written this chunk, its first ``generators`` members M_k, M_v, [M_q,] M_eta,
    M_alpha; x, query (x W_q, or None when M_q generates q) [B, H, C, I]; r1, r2 M_mem's
    state [B, H, ...], or None when M_mem is the stack's last member; alpha_bias [B, H];
    ``scale``/``residual``/``dot`` as in ``smt_write``. -> (W1', W2', inc1, inc2, k, v, q
    [B, H, C, I], eta, alpha [B, H, C], the read [B, H, C, O])."""
    inputs = (w1, w2, x, query, r1, r2, alpha_bias, scale)
    options = (residual, dot, eta_scale, generators)
    _sizes_check(inputs, generators)
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_step import smt_step_triton

        return smt_step_triton(inputs, options)  # type: ignore[return-value]
    return smt_step_reference(inputs, options)


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
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
) -> StepOutputs:
    rows, gates = torch.empty_like(x), x.new_empty(x.shape[:3])
    weights = (torch.empty_like(w1), torch.empty_like(w2))
    return (*weights, *weights, rows, torch.empty_like(rows), torch.empty_like(rows), gates,
            torch.empty_like(gates), x.new_empty(*x.shape[:3], w1.shape[-2]))  # fmt: skip


@torch.library.custom_op("hope::smt_step_backward", mutates_args=())
def smt_step_backward(
    inputs: list[Tensor | None],
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    grads: list[Tensor | None],
) -> list[Tensor]:
    """``smt_step_backward_reference``; absent gradients are empty tensors."""
    w1 = inputs[0]
    assert w1 is not None
    args = (tuple(inputs), (residual, dot, eta_scale, generators), tuple(grads))
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_step import smt_step_backward_triton

        out = smt_step_backward_triton(*args)  # type: ignore[arg-type]
    else:
        out = smt_step_backward_reference(*args)  # type: ignore[arg-type]
    return [w1.new_empty(0) if t is None else t for t in out]


@smt_step_backward.register_fake
def _(
    inputs: list[Tensor | None],
    residual: bool,
    dot: bool,
    eta_scale: float,
    generators: int,
    grads: list[Tensor | None],
) -> list[Tensor]:
    w1, w2, x, query, r1, r2, bias, _ = inputs
    assert w1 is not None and w2 is not None and x is not None and bias is not None
    like = [w1, w2, x, query, r1 if grads[-1] is not None else None, r2, bias]
    like[5] = None if like[4] is None else r2
    return [w1.new_empty(0) if t is None else torch.empty_like(t) for t in like]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: StepOutputs) -> None:
    *tensors, residual, dot, eta_scale, generators = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = (residual, dot, eta_scale, generators)
    ctx.has = (tensors[3] is not None, tensors[4] is not None)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    out = smt_step_backward(list(ctx.saved_tensors), *ctx.options, list(grads))
    g_w1, g_w2, g_x, g_query, g_r1, g_r2, g_bias = out
    has_query, has_mem = ctx.has
    mem = (g_r1, g_r2) if has_mem and g_r1.numel() else (None, None)
    return (g_w1, g_w2, g_x, g_query if has_query else None, *mem, g_bias, *([None] * 5))


smt_step.register_autograd(_backward, setup_context=_setup)

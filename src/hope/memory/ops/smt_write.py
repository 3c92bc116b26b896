"""The SMT's whole chunk write of one stacked memory group as one operator (backend
``fused``): ``hope::smt_write`` and its backward.

Per chunk, G memories stacked along the head axis (w1 [B, G*H, O, M]) are written
from the chunk's shared k, v, eta, alpha [B, H, ...] (NL-arXiv eqs. 84, 88, 90):

  the chunk-start pass (``memory_pass``): v_hat = M(v), E, A, D at the keys and the
  kernel bound K; the bounded step eta_b = eta / (1 + rho(K, eta)) (``overshoot``);
  the preconditioned DGD write (``fused.dgd_chunk``, no momentum) from E, A, D;

and, when queries are given, the reads M(q) at the chunk-start state. As three
operators that is three launches each way plus autograd's sums of the gradients
their shared inputs receive (the weights feed the pass and the write); here one
launch each way. The backward recomputes the pass and the bound from the inputs.

On CUDA each direction is one Triton kernel (``triton_write.py``); elsewhere the
composition of the three operators' PyTorch forms, which is this operator's
reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hope.memory.ops.chunk import chunk_dgd_update
from hope.memory.ops.fused import dgd_chunk_backward_reference
from hope.memory.ops.memory_pass import memory_pass_backward_reference, memory_pass_reference
from hope.memory.ops.stacking import repeat_heads, sum_members
from hope.memory.residual_mlp import overshoot_ratio

WriteInputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None]
WriteOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _pass_and_step(
    inputs: WriteInputs, residual: bool, dot: bool
) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
    """The pass's outputs, the bounded steps [B, G*H, C] and the gains [B, G*H]."""
    w1, w2, k, v, q, eta, _, scale = inputs
    outs = memory_pass_reference(w1, w2, k, v, q, None, scale, residual, dot)
    steps = repeat_heads(eta, w1.shape[1] // eta.shape[1])
    denominator = 1.0 + overshoot_ratio(outs[8], steps)
    return outs, steps / denominator.unsqueeze(-1), 1.0 / denominator


def smt_write_reference(inputs: WriteInputs, residual: bool, dot: bool) -> WriteOutputs:
    """(W1', W2', inc1, inc2, reads [B, G*H, C_q or 0, O]) in PyTorch ops; the
    increments are the new momenta m1, m2 of a write without momentum."""
    w1, w2, k, _, _, _, alpha, _ = inputs
    outs, bounded, _ = _pass_and_step(inputs, residual, dot)
    _, read, err, act, hidden_err, pre = outs[:6]
    members = w1.shape[1] // k.shape[1]
    keys, decays = repeat_heads(k, members), repeat_heads(alpha, members)
    new = chunk_dgd_update(
        w1, w2, w1, w2, keys, err, act, hidden_err, bounded, decays, True, 0.0, pre
    )
    return new[0], new[1], new[2], new[3], read


def smt_write_backward_reference(
    inputs: WriteInputs, residual: bool, dot: bool, grads: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """d(w1, w2, k, v, q, eta, alpha) given d(W1', W2', inc1, inc2, reads) (None where
    zero)."""
    w1, w2, k, v, q, eta, alpha, scale = inputs
    g_w1, g_w2, g_inc1, g_inc2, g_read = grads
    outs, bounded, gain = _pass_and_step(inputs, residual, dot)
    _, _, err, act, hidden_err, pre = outs[:6]
    g_w1 = torch.zeros_like(w1) if g_w1 is None else g_w1
    g_w2 = torch.zeros_like(w2) if g_w2 is None else g_w2
    write = (w1, w2, k, err, act, hidden_err, bounded, alpha, pre)
    d = dgd_chunk_backward_reference(write, g_w1, g_w2, g_inc1, g_inc2)
    d_eta = sum_members(d[6] * gain.unsqueeze(-1), eta.shape[1])  # rho: a constant
    saved = (w1, w2, k, v, q, None, scale, err)
    p = memory_pass_backward_reference(saved, residual, dot, (None, g_read, *d[3:6], d[8], None))
    return d[0] + p[0], d[1] + p[1], d[2] + p[2], p[3], p[4], d_eta, d[7]


@torch.library.custom_op("hope::smt_write", mutates_args=())
def smt_write(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    v: Tensor,
    q: Tensor | None,
    eta: Tensor,
    alpha: Tensor,
    scale: Tensor | None,
    residual: bool,
    dot: bool,
) -> WriteOutputs:
    """One chunk write of a stacked group (module docstring): w1 [B, G*H, O, M],
    w2 [B, G*H, M, I]; k, v [B, H, C, I], q [B, H, C_q, I] or None, eta, alpha [B, H, C];
    ``scale`` [G*H] the 0/1 residual coefficient per stacked head, or None for
    ``residual`` on all; ``dot``: the dot-product inner loss, else l2. -> (W1', W2', the
    increments inc1, inc2, reads [B, G*H, C_q or 0, O])."""
    inputs = (w1, w2, k, v, q, eta, alpha, scale)
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_write import smt_write_triton

        return smt_write_triton(inputs, residual, dot)
    return smt_write_reference(inputs, residual, dot)


@smt_write.register_fake
def _(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    v: Tensor,
    q: Tensor | None,
    eta: Tensor,
    alpha: Tensor,
    scale: Tensor | None,
    residual: bool,
    dot: bool,
) -> WriteOutputs:
    b, gh, o, _ = w1.shape
    reads = w1.new_empty(b, gh, 0 if q is None else q.shape[2], o)
    weights = (torch.empty_like(w1), torch.empty_like(w2))
    return (*weights, torch.empty_like(w1), torch.empty_like(w2), reads)


@torch.library.custom_op("hope::smt_write_backward", mutates_args=())
def smt_write_backward(
    inputs: list[Tensor | None], residual: bool, dot: bool, grads: list[Tensor | None]
) -> list[Tensor]:
    """``smt_write_backward_reference``; the gradient of absent queries is empty."""
    w1, w2, k, v, q, eta, alpha, scale = inputs
    assert w1 is not None and w2 is not None and k is not None and v is not None
    assert eta is not None and alpha is not None
    args = ((w1, w2, k, v, q, eta, alpha, scale), residual, dot, tuple(grads))
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_write import smt_write_backward_triton

        out = smt_write_backward_triton(*args)
    else:
        out = smt_write_backward_reference(*args)
    return [w1.new_empty(0) if t is None else t for t in out]


@smt_write_backward.register_fake
def _(
    inputs: list[Tensor | None], residual: bool, dot: bool, grads: list[Tensor | None]
) -> list[Tensor]:
    like = inputs[0]
    assert like is not None
    return [like.new_empty(0) if t is None else torch.empty_like(t) for t in inputs[:7]]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    *tensors, residual, dot = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = (residual, dot)
    ctx.has_q = tensors[4] is not None
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    out = smt_write_backward(list(ctx.saved_tensors), *ctx.options, list(grads[:5]))
    g_w1, g_w2, g_k, g_v, g_q, g_eta, g_alpha = out
    return g_w1, g_w2, g_k, g_v, g_q if ctx.has_q else None, g_eta, g_alpha, None, None, None


smt_write.register_autograd(_backward, setup_context=_setup)

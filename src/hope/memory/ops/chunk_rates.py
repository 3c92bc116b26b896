"""The Titans memory's per-chunk step sizes: the retention keep = 1 - alpha, the
momentum end weights and the capped inner steps of one chunk (Ti eqs. 13-14 with the
stabiliser of ``chunk_step_cap``), and ``hope::titans_chunk_rates``, the same as one
operator each way (backend ``fused``; one Triton kernel each way on CUDA,
``triton_chunk_rates.py``). As PyTorch ops they launch about ten kernels forward and
as many backward per chunk, 15% of a fused ``titans_mac`` training step at the pilot
chunking.

Backward, given (g_keep, g_w, g_rate) and with the cap theta_max a constant (a
stabiliser, like gradient clipping):

    dL/dtheta = g_rate theta_max / max(1, lambda),
    dL/dlambda = -g_rate rate / lambda where lambda >= 1 (0 elsewhere),
    (dL/deta, dL/dkeep_w) = ``chunk_end_weights_backward_reference``(eta, keep, g_w),
    dL/dalpha = -(g_keep + dL/dkeep_w).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from hope.memory.ops.chunk import momentum_chunk_weights
from hope.memory.ops.end_weights import chunk_end_weights_backward_reference
from hope.memory.residual_mlp import overshoot_ratio


def chunk_step_cap(kernel: Tensor, end_weights: Tensor) -> Tensor:
    """Cap theta_max [B, H, 1] of a chunk's inner steps theta_s = theta_max sigma_s / lambda_s.

    A deviation (docs/FAITHFULNESS.md): the paper's theta_t is an unbounded
    data-dependent learning rate; this cap only binds where a chunk's steps couple.

    Chunked training (Ti eq. 16) takes all C gradients of a chunk at the chunk-start
    weights; with momentum (Ti eq. 18) token s's step reaches the chunk-end weights
    with weight w_s (``end_weights``: ``momentum_chunk_weights``, about 1/(1 - eta)).
    Linearised, the write moves the predictions at the chunk's keys by
    -2 theta_max J C J^T e with C = diag(sigma_s w_s / lambda_s): it cannot overshoot
    (no error grows) while 2 theta_max ||C^1/2 (J J^T) C^1/2|| <= 1. The kernel
    J_t J_s^T is bounded entrywise by ``chunk_kernel_bound`` K >= 0 (``kernel``
    [B, H, C, C]; any memory depth), whose spectral norm bounds that of the block
    kernel; with sigma <= 1 that gives theta_max = 1 / max(1, rho),
    rho = 2 ||diag(sqrt(w/lambda)) K diag(sqrt(w/lambda))||_2 (``perron_bound``).

    Tight only when it must be: keys sharing one direction (MAC writes attention
    outputs, nearly constant within a segment) give rho ~ C w, the worst case; spread
    keys give a far smaller rho. A stabiliser, so the outer gradient treats it as a
    constant (like gradient clipping). Before any cap (theta = sigmoid ~ 0.05,
    unnormalised, C = 16) titans_mac was NaN after 80 tokens; the fixed worst-case
    cap 1 / (C (C + 1)) that followed lowered the inner loss of a written chunk by
    only 0.3% at the pilot chunk C = 64.
    """
    kernel, end_weights = kernel.detach(), end_weights.detach()  # [B, H, C, C], [B, H, C]
    curvature = kernel.diagonal(dim1=-2, dim2=-1).clamp_min(1.0)
    rho = overshoot_ratio(kernel, end_weights / curvature)  # [B, H]
    return (1.0 / rho.clamp_min(1.0)).unsqueeze(-1)


def rates_dtype(*vectors: Tensor) -> torch.dtype:
    """The outputs' dtype: the promotion of the gates' and the curvature's (under autocast
    bf16 gates and an fp32 curvature give fp32 rates, as the PyTorch ops would)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in vectors))


def chunk_rates_reference(
    theta: Tensor, eta: Tensor, alpha: Tensor, curvature: Tensor, coupling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(keep = 1 - alpha, w = ``momentum_chunk_weights(eta, keep)``, the inner steps
    theta_max theta / max(1, lambda)) [B, H, C] of one chunk, from its gates theta, eta,
    alpha [B, H, C], its curvature bound lambda [B, H, C] and kernel bound [B, H, C, C]
    (``chunk_step_cap``), in PyTorch ops, in their common dtype (``rates_dtype``)."""
    dtype = rates_dtype(theta, eta, alpha, curvature)
    theta, eta, alpha, curvature = (t.to(dtype) for t in (theta, eta, alpha, curvature))
    keep = 1.0 - alpha
    weights = momentum_chunk_weights(eta, keep)
    rate = chunk_step_cap(coupling, weights) * theta / curvature.clamp_min(1.0)
    return keep, weights, rate


def chunk_rates_backward_reference(
    inputs: tuple[Tensor, ...],
    g_keep: Tensor | None,
    g_weights: Tensor | None,
    g_rate: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dL/dtheta, dL/deta, dL/dalpha, dL/dcurvature) of ``chunk_rates_reference`` at
    ``inputs`` = (theta, eta, alpha, curvature, coupling), an absent gradient a zero
    one (the module docstring's closed form)."""
    theta, eta, alpha, curvature, coupling = inputs
    keep = 1.0 - alpha
    d_eta = torch.zeros_like(eta)
    d_alpha = torch.zeros_like(alpha) if g_keep is None else -g_keep
    if g_weights is not None:
        d_eta, d_keep = chunk_end_weights_backward_reference(eta, keep, g_weights)
        d_alpha = d_alpha - d_keep
    d_theta, d_curvature = torch.zeros_like(theta), torch.zeros_like(curvature)
    if g_rate is not None:
        cap = chunk_step_cap(coupling, momentum_chunk_weights(eta, keep))
        bounded = curvature.clamp_min(1.0)
        d_theta = g_rate * cap / bounded
        d_curvature = torch.where(curvature >= 1.0, -d_theta * theta / bounded, 0.0)
    grads = (d_theta, d_eta, d_alpha, d_curvature)
    # each in its input's dtype, as the operator declares them
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs, strict=False))  # type: ignore[return-value]


@torch.library.custom_op("hope::titans_chunk_rates", mutates_args=())
def titans_chunk_rates(
    theta: Tensor, eta: Tensor, alpha: Tensor, curvature: Tensor, coupling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``chunk_rates_reference`` in one launch; ``coupling`` carries no gradient."""
    if theta.device.type == "cuda":
        from hope.memory.ops.triton_chunk_rates import titans_chunk_rates_triton

        return titans_chunk_rates_triton(theta, eta, alpha, curvature, coupling)
    return chunk_rates_reference(theta, eta, alpha, curvature, coupling)


@titans_chunk_rates.register_fake
def _(
    theta: Tensor, eta: Tensor, alpha: Tensor, curvature: Tensor, coupling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    dtype = rates_dtype(theta, eta, alpha, curvature)
    return tuple(theta.new_empty(theta.shape, dtype=dtype) for _ in range(3))  # type: ignore[return-value]


@torch.library.custom_op("hope::titans_chunk_rates_backward", mutates_args=())
def titans_chunk_rates_backward(
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    curvature: Tensor,
    coupling: Tensor,
    g_keep: Tensor | None,
    g_weights: Tensor | None,
    g_rate: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``titans_chunk_rates`` (``chunk_rates_backward_reference``)."""
    inputs = (theta, eta, alpha, curvature, coupling)
    if theta.device.type == "cuda":
        from hope.memory.ops.triton_chunk_rates import titans_chunk_rates_backward_triton

        return titans_chunk_rates_backward_triton(inputs, g_keep, g_weights, g_rate)
    return chunk_rates_backward_reference(inputs, g_keep, g_weights, g_rate)


@titans_chunk_rates_backward.register_fake
def _(
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    curvature: Tensor,
    coupling: Tensor,
    g_keep: Tensor | None,
    g_weights: Tensor | None,
    g_rate: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.new_empty(theta.shape) for t in (theta, eta, alpha, curvature))  # type: ignore[return-value]


def _setup(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, ...]) -> None:
    ctx.save_for_backward(*inputs)
    ctx.set_materialize_grads(False)


def _backward(
    ctx: Any, g_keep: Tensor | None, g_weights: Tensor | None, g_rate: Tensor | None
) -> tuple[Tensor | None, ...]:
    if g_keep is None and g_weights is None and g_rate is None:
        return (None,) * 5
    grads = titans_chunk_rates_backward(*ctx.saved_tensors, g_keep, g_weights, g_rate)
    return (*grads, None)


titans_chunk_rates.register_autograd(_backward, setup_context=_setup)

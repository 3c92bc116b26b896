"""Memory-write steps as single operators (backend ``fused``): the SMT's DGD chunk write
with a closed-form backward (NL-arXiv eq. 88, MECHANISMS §8.1), the Titans memory's
momentum chunk write likewise (``hope::momentum_chunk``, Ti eqs. 13-14 chunked per eqs.
16-18). (The overshoot bound their steps are divided by: ``overshoot.py``.)

``chunk_dgd_update`` (``memory/ops/chunk.py``) differentiated by autograd launches
about 37 kernels forward and 76 backward per chunk and memory group (the C x C decay
ratios, the preconditioner's solve, the products, and autograd's node per op): at
the pilot chunking that is 22 k of the 57 k launches of a HOPE layer-step. Here the
write of the default rule (preconditioned, no momentum) is one ``torch.library``
operator, ``hope::dgd_chunk``, whose backward is another, ``hope::dgd_chunk_backward``,
written out below. On CUDA each is one Triton kernel (``triton_kernels.py``); on other
devices each runs the same closed form in PyTorch ops (so a CPU counts the launches
a GPU pays, and float64 tests compare every path). The forward keeps only its
inputs for backward and recomputes the C x C terms there.

Backward of W1' = gC W1 + (c1 ⊙ E)^T A, W2' = gC W2 + R^T Z, inc2 = U^T Z with
U = -η ⊙ D, R = U - (η γ_prev) ⊙ S0k, Z = L^-T (γ_C/γ_s ⊙ K), L = I + η ⊙ (P ∘ K K^T),
P_ts = γ_{t-1}/γ_s (s < t), c1 = -η γ_C/γ_s, γ_t = prod_{s<=t} α_s
(shapes and names as in ``chunk_dgd_update``): with G_i the output gradients,
  dZ = R G_w2 + U G_inc2,  Y = L^-1 dZ,  dL = -Z Y^T (strictly lower),
  dU = Z (G_w2 + G_inc2)^T,  dS0k = -(η γ_prev) ⊙ Z G_w2^T,
and the decays' gradients gathered in log γ and returned through the cumulative sum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hope.memory.ops.chunk import chunk_dgd_update, chunk_momentum_update
from hope.memory.ops.stacking import repeat_heads, sum_members

_Grads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _rowdot(x: Tensor, y: Tensor) -> Tensor:
    """sum over the last axis of x ⊙ y."""
    return (x * y).sum(-1)


def dgd_chunk_backward_reference(
    inputs: tuple[Tensor, ...],
    g_w1: Tensor,
    g_w2: Tensor,
    g_inc1: Tensor | None,
    g_inc2: Tensor | None,
) -> _Grads:
    """Gradients of (W1', W2', inc1, inc2) = ``dgd_chunk`` with respect to its inputs
    (w1, w2, k, e, a, d, eta, alpha, w2k), in PyTorch ops (module docstring). A None
    increment gradient is zero (the increments feed only a momentum, absent here).
    k and alpha shared by stacked members get their gradients summed over them."""
    heads = (inputs[2].shape[1], inputs[7].shape[1])
    w1, w2, k, e, a, d, eta, alpha, w2k = _per_member(inputs)
    grads = _dgd_grads((w1, w2, k, e, a, d, eta, alpha, w2k), g_w1, g_w2, g_inc1, g_inc2)
    d_k, d_alpha = sum_members(grads[2], heads[0]), sum_members(grads[7], heads[1])
    return (*grads[:2], d_k, *grads[3:7], d_alpha, grads[8])


def _per_member(inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``dgd_chunk``'s inputs with k and alpha repeated to every stacked member."""
    w1, w2, k, e, a, d, eta, alpha, w2k = inputs
    stacked = w1.shape[1]
    k, alpha = (repeat_heads(t, stacked // t.shape[1]) for t in (k, alpha))
    return w1, w2, k, e, a, d, eta, alpha, w2k


def _dgd_grads(
    inputs: tuple[Tensor, ...],
    g_w1: Tensor,
    g_w2: Tensor,
    g_inc1: Tensor | None,
    g_inc2: Tensor | None,
) -> _Grads:
    """``dgd_chunk_backward_reference`` with every input per stacked member."""
    w1, w2, k, e, a, d, eta, alpha, w2k = inputs
    n = k.shape[-2]
    log_keep = torch.log(alpha)
    cum = torch.cumsum(log_keep, dim=-1)  # log γ_t
    prev = cum - log_keep  # log γ_{t-1}
    end = cum[..., -1:]
    strict = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
    ratio = torch.exp((prev.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~strict, -torch.inf))
    gamma_prev, end_over_s, gamma_end = torch.exp(prev), torch.exp(end - cum), torch.exp(end)
    gram = k @ k.transpose(-1, -2)
    coupling = ratio * gram  # P ∘ K K^T
    eye = torch.eye(n, dtype=k.dtype, device=k.device)
    lower = torch.addcmul(eye, eta.unsqueeze(-1), coupling)
    inverse = torch.linalg.solve_triangular(
        lower, eye.expand_as(lower), upper=False, unitriangular=True
    )
    keys = inverse.transpose(-1, -2) @ (end_over_s.unsqueeze(-1) * k)
    u = -eta.unsqueeze(-1) * d
    hom_coef = -eta * gamma_prev
    rhs = torch.addcmul(u, hom_coef.unsqueeze(-1), w2k)  # R = U + hom
    c1 = -eta * end_over_s
    # Outputs' gains: W1' and W2' scale the chunk-start weights by γ_C.
    d_gamma_end = (g_w1 * w1).sum((-2, -1)) + (g_w2 * w2).sum((-2, -1))
    gain = gamma_end.unsqueeze(-1)
    d_w1, d_w2 = gain * g_w1, gain * g_w2
    # inc1 = (c1 ⊙ E)^T A
    g1 = g_w1 if g_inc1 is None else g_w1 + g_inc1
    a_g = a @ g1.transpose(-1, -2)  # [C, O]
    d_e = c1.unsqueeze(-1) * a_g
    d_a = c1.unsqueeze(-1) * (e @ g1)
    d_c1 = _rowdot(e, a_g)
    # W2' - γ_C W2 = R^T Z and inc2 = U^T Z
    d_rhs = keys @ g_w2.transpose(-1, -2)  # [C, M]
    d_u, d_keys = d_rhs, rhs @ g_w2  # [C, M], [C, I]
    if g_inc2 is not None:
        d_u = d_u + keys @ g_inc2.transpose(-1, -2)
        d_keys = d_keys + u @ g_inc2
    d_d = -eta.unsqueeze(-1) * d_u
    d_w2k = hom_coef.unsqueeze(-1) * d_rhs
    d_hom_coef = _rowdot(w2k, d_rhs)
    # Z = L^-T (γ_C/γ_s ⊙ K)
    y = inverse @ d_keys
    d_lower = -(keys @ y.transpose(-1, -2)).masked_fill(~strict, 0.0)
    d_k = end_over_s.unsqueeze(-1) * y
    d_end_over_s = _rowdot(k, y) - eta * d_c1
    d_eta = -_rowdot(d, d_u) - gamma_prev * d_hom_coef - end_over_s * d_c1
    d_eta = d_eta + _rowdot(d_lower, coupling)
    d_coupling = eta.unsqueeze(-1) * d_lower
    d_gram = d_coupling * ratio
    d_k = d_k + (d_gram + d_gram.transpose(-1, -2)) @ k
    # Decays, in log γ: P_ts = exp(prev_t - cum_s), γ_prev, γ_C/γ_s, γ_C.
    q = d_coupling * gram * ratio
    d_prev = q.sum(-1) - eta * d_hom_coef * gamma_prev
    scaled_end = d_end_over_s * end_over_s
    d_cum = -q.sum(-2) - scaled_end
    d_end = scaled_end.sum(-1, keepdim=True) + d_gamma_end.unsqueeze(-1) * gamma_end
    total = d_cum + d_prev
    # cum = cumsum(log α), γ_C = exp(cum_C): d log α_j = sum_{t>=j} total_t + d_end.
    suffix = total - torch.cumsum(total, dim=-1) + total.sum(-1, keepdim=True)
    d_alpha = (suffix - d_prev + d_end) / alpha
    return d_w1, d_w2, d_k, d_e, d_a, d_d, d_eta, d_alpha, d_w2k


def _uses_triton(t: Tensor) -> bool:
    return t.device.type == "cuda"


@torch.library.custom_op("hope::dgd_chunk", mutates_args=())
def dgd_chunk(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    e: Tensor,
    a: Tensor,
    d: Tensor,
    eta: Tensor,
    alpha: Tensor,
    w2k: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W1', W2', inc1, inc2) of one preconditioned DGD chunk without momentum: the
    values of ``chunk_dgd_update(..., precondition=True, momentum=0, w2k=w2k)`` (its
    m1, m2 are the increments). k [B, H_k, C, I] and alpha [B, H_k, C] may be shared by
    the G stacked members of w1 [B, G*H_k, ...] (member g's head g*H_k + h reads head
    h): the SMT's memories written from one chunk share them, not copies."""
    if _uses_triton(k):
        from hope.memory.ops.triton_kernels import dgd_chunk_triton  # CUDA builds ship Triton

        return dgd_chunk_triton(w1, w2, k, e, a, d, eta, alpha, w2k)
    w1, w2, k, e, a, d, eta, alpha, w2k = _per_member((w1, w2, k, e, a, d, eta, alpha, w2k))
    # Momentum 0 never reads m1, m2: the weights stand in for them.
    out = chunk_dgd_update(w1, w2, w1, w2, k, e, a, d, eta, alpha, True, 0.0, w2k)
    return out[0], out[1], out[2], out[3]


@dgd_chunk.register_fake
def _(w1: Tensor, w2: Tensor, *rest: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(w1), torch.empty_like(w2), torch.empty_like(w1), torch.empty_like(w2))


@torch.library.custom_op("hope::dgd_chunk_backward", mutates_args=())
def dgd_chunk_backward(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    e: Tensor,
    a: Tensor,
    d: Tensor,
    eta: Tensor,
    alpha: Tensor,
    w2k: Tensor,
    g_w1: Tensor,
    g_w2: Tensor,
    g_inc1: Tensor | None,
    g_inc2: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``dgd_chunk``'s inputs (``dgd_chunk_backward_reference``)."""
    inputs = (w1, w2, k, e, a, d, eta, alpha, w2k)
    if _uses_triton(k):
        from hope.memory.ops.triton_kernels import dgd_chunk_backward_triton

        return dgd_chunk_backward_triton(inputs, g_w1, g_w2, g_inc1, g_inc2)  # type: ignore[return-value]
    return dgd_chunk_backward_reference(inputs, g_w1, g_w2, g_inc1, g_inc2)


@dgd_chunk_backward.register_fake
def _(w1: Tensor, w2: Tensor, k: Tensor, e: Tensor, a: Tensor, d: Tensor, eta: Tensor,
      alpha: Tensor, w2k: Tensor, *grads: Tensor) -> _Grads:  # fmt: skip
    return tuple(torch.empty_like(t) for t in (w1, w2, k, e, a, d, eta, alpha, w2k))  # type: ignore[return-value]


def _setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)
    # Unused outputs (the increments, without momentum) get None, not zero tensors.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Tensor | None) -> _Grads:
    inputs = ctx.saved_tensors
    g_w1, g_w2, g_inc1, g_inc2 = grads
    # The weights' gradients are always defined in a step (the state is read later);
    # zeros stand in where a caller differentiates only the increments.
    g_w1 = torch.zeros_like(inputs[0]) if g_w1 is None else g_w1
    g_w2 = torch.zeros_like(inputs[1]) if g_w2 is None else g_w2
    return dgd_chunk_backward(*inputs, g_w1, g_w2, g_inc1, g_inc2)  # type: ignore[no-any-return]


dgd_chunk.register_autograd(_backward, setup_context=_setup_context)


_MomentumGrads = tuple[Tensor, ...]


def momentum_chunk_backward_reference(
    inputs: tuple[Tensor, ...], grads: tuple[Tensor, Tensor, Tensor, Tensor]
) -> _MomentumGrads:
    """Gradients of (W1', W2', S1', S2') = ``momentum_chunk`` with respect to (w1, w2, s1,
    s2, k, e, a, d, theta, eta, keep, end_weights), in PyTorch ops. Per matrix (W, S,
    err, inp): W' = a_C W + c S - (w θ ⊙ err)^T inp, S' = b_C S - (b_C/b_s θ ⊙ err)^T
    inp, with b, a the cumulative products of eta, keep and c = sum_j (a_C/a_j) b_j
    (``chunk_momentum_update``); the decays' gradients are gathered in log b, log a."""
    w1, w2, s1, s2, k, e, a, d, theta, eta, keep, end_weights = inputs
    g_w1, g_w2, g_s1, g_s2 = grads
    log_b, log_a = torch.cumsum(torch.log(eta), -1), torch.cumsum(torch.log(keep), -1)
    b_end, a_end = log_b[..., -1:], log_a[..., -1:]
    to_momentum_gain = torch.exp(b_end - log_b)  # b_C / b_s
    carry_terms = torch.exp(a_end - log_a + log_b)  # (a_C / a_j) b_j
    keep_end, decay_end = torch.exp(a_end)[..., None], torch.exp(b_end)[..., None]
    carry = carry_terms.sum(-1)[..., None, None]
    to_weight, to_momentum = (end_weights * theta)[..., None], (to_momentum_gain * theta)[..., None]
    d_keep_end = (g_w1 * w1).sum((-2, -1)) + (g_w2 * w2).sum((-2, -1))
    d_carry = (g_w1 * s1).sum((-2, -1)) + (g_w2 * s2).sum((-2, -1))
    d_decay_end = (g_s1 * s1).sum((-2, -1)) + (g_s2 * s2).sum((-2, -1))
    d_w1, d_w2 = keep_end * g_w1, keep_end * g_w2
    d_s1, d_s2 = carry * g_w1 + decay_end * g_s1, carry * g_w2 + decay_end * g_s2
    # W1: err e [C, O], inp a [C, M]; W2: err d [C, M], inp k [C, I].
    x_w1, x_s1 = -a @ g_w1.transpose(-1, -2), -a @ g_s1.transpose(-1, -2)  # [C, O]
    x_w2, x_s2 = -k @ g_w2.transpose(-1, -2), -k @ g_s2.transpose(-1, -2)  # [C, M]
    d_a = -(to_weight * e) @ g_w1 - (to_momentum * e) @ g_s1
    d_k = -(to_weight * d) @ g_w2 - (to_momentum * d) @ g_s2
    d_e, d_d = to_weight * x_w1 + to_momentum * x_s1, to_weight * x_w2 + to_momentum * x_s2
    d_to_weight = (e * x_w1).sum(-1) + (d * x_w2).sum(-1)
    d_to_momentum = (e * x_s1).sum(-1) + (d * x_s2).sum(-1)
    d_end_weights = theta * d_to_weight
    d_theta = end_weights * d_to_weight + to_momentum_gain * d_to_momentum
    gain_grad = to_momentum_gain * theta * d_to_momentum  # d/d(log b_C - log b_s)
    carry_grad = d_carry.unsqueeze(-1) * carry_terms
    d_log_b = carry_grad - gain_grad
    d_log_a = -carry_grad
    d_b_end = gain_grad.sum(-1) + d_decay_end * decay_end[..., 0, 0]
    d_a_end = carry_grad.sum(-1) + d_keep_end * keep_end[..., 0, 0]

    def through_cumsum(grad: Tensor, end: Tensor) -> Tensor:
        # log x_t -> its cumulative sum (and its last entry): suffix sums.
        return grad - torch.cumsum(grad, -1) + grad.sum(-1, keepdim=True) + end.unsqueeze(-1)

    d_eta = through_cumsum(d_log_b, d_b_end) / eta
    d_keep = through_cumsum(d_log_a, d_a_end) / keep
    return (d_w1, d_w2, d_s1, d_s2, d_k, d_e, d_a, d_d, d_theta, d_eta, d_keep, d_end_weights)


@torch.library.custom_op("hope::momentum_chunk", mutates_args=())
def momentum_chunk(
    w1: Tensor,
    w2: Tensor,
    s1: Tensor,
    s2: Tensor,
    k: Tensor,
    e: Tensor,
    a: Tensor,
    d: Tensor,
    theta: Tensor,
    eta: Tensor,
    keep: Tensor,
    end_weights: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W1', W2', S1', S2'): the values of ``chunk_momentum_update`` given its
    ``end_weights``."""
    if _uses_triton(k):
        from hope.memory.ops.triton_momentum import momentum_chunk_triton

        return momentum_chunk_triton(w1, w2, s1, s2, k, e, a, d, theta, eta, keep, end_weights)
    out = chunk_momentum_update(w1, w2, s1, s2, k, e, a, d, theta, eta, keep, end_weights)
    return out[0], out[1], out[2], out[3]


@momentum_chunk.register_fake
def _(w1: Tensor, w2: Tensor, s1: Tensor, s2: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
    return tuple(torch.empty_like(t) for t in (w1, w2, s1, s2))


@torch.library.custom_op("hope::momentum_chunk_backward", mutates_args=())
def momentum_chunk_backward(
    w1: Tensor,
    w2: Tensor,
    s1: Tensor,
    s2: Tensor,
    k: Tensor,
    e: Tensor,
    a: Tensor,
    d: Tensor,
    theta: Tensor,
    eta: Tensor,
    keep: Tensor,
    end_weights: Tensor,
    g_w1: Tensor,
    g_w2: Tensor,
    g_s1: Tensor,
    g_s2: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor]:  # fmt: skip
    """The gradients of ``momentum_chunk``'s inputs (``momentum_chunk_backward_reference``)."""
    inputs = (w1, w2, s1, s2, k, e, a, d, theta, eta, keep, end_weights)
    grads = (g_w1, g_w2, g_s1, g_s2)
    if _uses_triton(k):
        from hope.memory.ops.triton_momentum import momentum_chunk_backward_triton

        return momentum_chunk_backward_triton(inputs, grads)  # type: ignore[return-value]
    return momentum_chunk_backward_reference(inputs, grads)  # type: ignore[return-value]


@momentum_chunk_backward.register_fake
def _(*args: Tensor) -> tuple[Tensor, ...]:
    return tuple(torch.empty_like(t) for t in args[:12])


def _momentum_backward(ctx: Any, *grads: Tensor | None) -> _MomentumGrads:
    inputs = ctx.saved_tensors
    full = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs[:4], strict=True)]
    return momentum_chunk_backward(*inputs, *full)  # type: ignore[no-any-return]


def _momentum_setup(ctx: Any, inputs: tuple[Tensor, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)
    ctx.set_materialize_grads(False)


momentum_chunk.register_autograd(_momentum_backward, setup_context=_momentum_setup)

"""``hope::chunk_end_weights``: how much of each token's step reaches the end of its
chunk in the Titans momentum write (backend ``fused``), with its gradient written out;
on CUDA one Triton kernel each way (``triton_end_weights.py``), elsewhere the same
closed forms in PyTorch ops.

Per (sample, head), with log b_t = sum_{i<=t} log eta_i (momentum decay) and
log a_t = sum_{i<=t} log keep_i (retention, Ti eqs. 13-14):

    w_s = sum_{j>=s} P[j, s],   P[j, s] = exp(log a_C - log a_j + log b_j - log b_s)

(``momentum_chunk_weights``: its log / cumsum / mask / exp / sum launch about ten
kernels forward and twenty-five backward per Titans chunk, 14% of a fused
``titans_mac`` step at the pilot chunking). Given dL/dw = g, with R_j = sum_s g_s P[j, s]:

    dL/dlog a_j = -R_j (+ sum_s g_s w_s at j = C),   dL/dlog b_j = R_j - g_j w_j,

and dL/deta_t = (sum_{i>=t} dL/dlog b_i) / eta_t, dL/dkeep_t likewise from log a.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hope.memory.ops.chunk import chunk_end_terms, momentum_chunk_weights


def chunk_end_weights_backward_reference(
    eta: Tensor, keep: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor]:
    """(dL/deta, dL/dkeep) [B, H, C] of w = ``momentum_chunk_weights(eta, keep)`` given
    dL/dw, in PyTorch ops (the module docstring's closed form)."""
    log_b, log_a = torch.cumsum(torch.log(eta), -1), torch.cumsum(torch.log(keep), -1)
    terms = chunk_end_terms(log_b, log_a)
    weights = terms.sum(-2)
    along = (terms * grad.unsqueeze(-2)).sum(-1)  # R_j
    d_log_b = along - grad * weights
    d_log_a = -along
    d_log_a[..., -1] += (grad * weights).sum(-1)

    def suffix(x: Tensor) -> Tensor:  # sum_{i >= t} x_i
        return x.flip(-1).cumsum(-1).flip(-1)

    return suffix(d_log_b) / eta, suffix(d_log_a) / keep


@torch.library.custom_op("hope::chunk_end_weights", mutates_args=())
def chunk_end_weights(eta: Tensor, keep: Tensor) -> Tensor:
    """``momentum_chunk_weights(eta, keep)`` [B, H, C] in one launch."""
    if eta.device.type == "cuda":
        from hope.memory.ops.triton_end_weights import chunk_end_weights_triton

        return chunk_end_weights_triton(eta, keep)
    return momentum_chunk_weights(eta, keep)


@chunk_end_weights.register_fake
def _(eta: Tensor, keep: Tensor) -> Tensor:
    return torch.empty_like(eta, memory_format=torch.contiguous_format)


@torch.library.custom_op("hope::chunk_end_weights_backward", mutates_args=())
def chunk_end_weights_backward(eta: Tensor, keep: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of ``chunk_end_weights`` (``chunk_end_weights_backward_reference``)."""
    if eta.device.type == "cuda":
        from hope.memory.ops.triton_end_weights import chunk_end_weights_backward_triton

        return chunk_end_weights_backward_triton(eta, keep, grad)
    return chunk_end_weights_backward_reference(eta, keep, grad)


@chunk_end_weights_backward.register_fake
def _(eta: Tensor, keep: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (eta, keep))  # type: ignore[return-value]


def _setup(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
    eta, keep = ctx.saved_tensors
    return chunk_end_weights_backward(eta, keep, grad)  # type: ignore[no-any-return]


chunk_end_weights.register_autograd(_backward, setup_context=_setup)

"""The SMT's bounded step as a single operator (backend ``fused``).

A chunk applies its C inner steps at the chunk-start weights; ``overshoot_ratio``
(``residual_mlp``) bounds how far they can overshoot, from the chunk's kernel bound
and steps. ``hope::bounded_step`` is the SMT's bounded step eta / (1 + rho)
(``smt_state.bounded_eta``) with its gradient (rho a constant): about 30 kernels as
PyTorch ops (four power iterations), one Triton kernel here on CUDA
(``triton_kernels.py``); elsewhere the same form in PyTorch ops. (The Titans memory's
cap takes the same bound inside ``hope::titans_chunk_rates``, ``chunk_rates.py``.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hope.memory.ops.stacking import repeat_heads, sum_members
from hope.memory.residual_mlp import overshoot_ratio


def _uses_triton(t: Tensor) -> bool:
    return t.device.type == "cuda"


@torch.library.custom_op("hope::bounded_step", mutates_args=())
def bounded_step_op(kernel: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
    """(eta / (1 + rho), 1 / (1 + rho)) with rho = ``overshoot_ratio(kernel, eta)`` [B, G*H]
    not differentiated (``smt_state.bounded_eta``): the bound and the division in one
    launch (one Triton kernel on CUDA). kernel [B, G*H, C, C] carries no gradient; eta
    [B, H, C] may be shared by the G stacked members (the bounded step is per member)."""
    if _uses_triton(kernel):
        from hope.memory.ops.triton_kernels import bounded_step_triton

        return bounded_step_triton(kernel, eta)
    eta = repeat_heads(eta, kernel.shape[1] // eta.shape[1])
    denominator = 1.0 + overshoot_ratio(kernel, eta)
    return eta / denominator.unsqueeze(-1), 1.0 / denominator


@bounded_step_op.register_fake
def _(kernel: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
    return eta.new_empty(kernel.shape[:-1]), eta.new_empty(kernel.shape[:-2])


def _bounded_setup(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, Tensor]) -> None:
    ctx.save_for_backward(output[1])
    ctx.heads = inputs[1].shape[1]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _bounded_backward(ctx: Any, grad: Tensor | None, _gain: Tensor | None) -> tuple[Any, ...]:
    (gain,) = ctx.saved_tensors
    if grad is None:
        return None, None
    return None, sum_members(grad * gain.unsqueeze(-1), ctx.heads)


bounded_step_op.register_autograd(_bounded_backward, setup_context=_bounded_setup)

"""Tensors a Python loop uses in every iteration, their gradients taken once per call.

Autograd sums the gradients of a tensor used n times with n - 1 ``add`` launches, one
as each use's gradient arrives, and a linear map's weight gradient costs one ``mm`` per
use. MAC's segment loop (Ti eqs. 21-25) uses about ten parameters once per segment, so
at the pilot shape (16 segments) those accumulations were a third of its step's
launches. ``share_across`` hands the loop one alias of each tensor per iteration from
one autograd node, whose backward runs after every iteration's and receives all n
gradients at once:

- a plain tensor's n gradients are summed with one ``stack`` and one ``sum``;
- a linear map (``LoopLinear``) does not take its weight gradient per iteration: each
  iteration's backward hands its input rows and output gradient to the node, which
  takes the weight's (and bias's) gradient as one matmul over all of them.

Same values as the plain loop; the gradient sums run in another order (float64 tests).
Under autocast a linear map's weight and bias are cast once per call, not per iteration,
as autocast's own cast cache does for the parameters a plain loop would use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import Tensor
from torch.nn import functional as F

# A shared tensor, or None where the caller has none (kept None in every iteration).
MaybeTensor = TypeVar("MaybeTensor", Tensor, Tensor | None)


@dataclass
class _Stash:
    """Each iteration's (input rows [..., S_i, in], output gradient [..., S_i, out]) of a
    linear map, handed over by its backward."""

    inputs: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class LoopLinear:
    """One iteration's y = x W^T + b, like ``nn.Linear``; with a stash its weight and
    bias gradients are taken once for the whole loop (``share_across``)."""

    weight: Tensor  # [out, in]
    bias: Tensor | None  # [out]
    stash: _Stash | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.stash is None:
            return F.linear(x, self.weight, self.bias)
        out: Tensor = _DeferredLinear.apply(x, self.weight, self.bias, self.stash)
        return out


class _DeferredLinear(torch.autograd.Function):
    """F.linear whose backward returns only the input's gradient and stashes what the
    weight's needs (the input rows and the output gradient) for ``_FanOut``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, stash: _Stash) -> Tensor:
        # Under autocast the weight arrives cast (``share_across``); x is cast here so the
        # stash holds what the matmul reads (autocast's own casts are then no-ops).
        rows = x.to(weight.dtype)
        ctx.save_for_backward(rows, weight)
        ctx.stash, ctx.x_dtype = stash, x.dtype
        return F.linear(rows, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        rows, weight = ctx.saved_tensors
        ctx.stash.inputs.append(rows)
        ctx.stash.grads.append(grad)
        grad_x = (grad @ weight).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class _FanOut(torch.autograd.Function):
    """``copies`` aliases of each tensor (copy-major); backward sums each tensor's
    gradients once, or, for a linear map's weight and bias, takes them from the stash."""

    @staticmethod
    def forward(
        ctx: Any, copies: int, roles: tuple[tuple[str, _Stash | None], ...], *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.roles = roles
        return tuple(t.view_as(t) for _ in range(copies) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        count = len(ctx.roles)
        joined: dict[int, tuple[Tensor, Tensor]] = {}
        out: list[Tensor | None] = [None, None]
        for slot, (role, stash) in enumerate(ctx.roles):
            # gradients of the aliases themselves (a linear map's alias used directly)
            summed = _summed([g for g in grads[slot::count] if g is not None])
            if stash is None or not stash.grads or not ctx.needs_input_grad[2 + slot]:
                out.append(summed)
                continue
            if id(stash) not in joined:  # one cat each of the rows and the gradients
                joined[id(stash)] = _rows(stash.inputs), _rows(stash.grads)
            rows, grad = joined[id(stash)]
            taken = grad.T @ rows if role == "weight" else grad.sum(0)
            out.append(taken if summed is None else taken + summed)
        for _, stash in ctx.roles:  # a second backward (retain_graph) restashes
            if stash is not None:
                stash.inputs.clear()
                stash.grads.clear()
        return tuple(out)


def _summed(parts: list[Tensor]) -> Tensor | None:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def _rows(parts: list[Tensor]) -> Tensor:
    """The iterations' [..., S_i, n] joined along S as [rows, n] (a view when dense)."""
    joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    return joined.reshape(-1, joined.shape[-1])


def _autocast_cast(t: Tensor) -> Tensor:
    device = t.device.type
    available = torch.amp.is_autocast_available(device)  # not on "meta"
    if t.is_floating_point() and available and torch.is_autocast_enabled(device):
        return t.to(torch.get_autocast_dtype(device))
    return t


def share_across(
    copies: int,
    tensors: Sequence[MaybeTensor],
    linears: Sequence[tuple[Tensor, Tensor | None]] = (),
    enabled: bool = True,
) -> list[tuple[list[MaybeTensor], list[LoopLinear]]]:
    """Per iteration of a loop of ``copies``: aliases of ``tensors`` (None stays None)
    and ``LoopLinear`` maps of ``linears`` (weight [out, in], bias [out] or None), all
    from one autograd node (module docstring). ``enabled=False``, or nothing that
    needs a gradient: the tensors themselves and plain linear maps."""
    flat = [t for t in tensors if t is not None]
    needs_grad = torch.is_grad_enabled() and (
        any(t.requires_grad for t in flat)
        or any(w.requires_grad or (b is not None and b.requires_grad) for w, b in linears)
    )
    if not enabled or not needs_grad:
        maps = [LoopLinear(w, b) for w, b in linears]
        return [(list(tensors), maps) for _ in range(copies)]
    roles: list[tuple[str, _Stash | None]] = [("sum", None)] * len(flat)
    stashes = [_Stash() for _ in linears]
    for (weight, bias), stash in zip(linears, stashes, strict=True):
        flat.append(_autocast_cast(weight))
        roles.append(("weight", stash))
        if bias is not None:
            flat.append(_autocast_cast(bias))
            roles.append(("bias", stash))
    aliases = _FanOut.apply(copies, tuple(roles), *flat)
    width = len(flat)
    shared = []
    for copy in range(copies):
        own = iter(aliases[copy * width : (copy + 1) * width])
        plain = [cast(MaybeTensor, None if t is None else next(own)) for t in tensors]
        maps = []
        for (_, bias), stash in zip(linears, stashes, strict=True):
            weight_alias = next(own)
            maps.append(LoopLinear(weight_alias, None if bias is None else next(own), stash))
        shared.append((plain, maps))
    return shared

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
  takes the weight's (and bias's) gradient as one matmul over all of them;
- an RMSNorm (``LoopNorm``, backend ``fused``) likewise: each iteration's backward takes
  only its input's gradient (no sum of the kernel's blocks' weight shares), and the
  node takes the weight's as one ``hope::rms_norm_backward`` over all iterations' rows.

Same values as the plain loop; the gradient sums run in another order (float64 tests).
Under autocast a linear map's weight and bias are cast once per call, not per iteration,
as autocast's own cast cache does for the parameters a plain loop would use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.memory.ops.dispatch import rms_normalized
from hope.memory.ops.rms_norm import rms_norm, rms_norm_backward


@dataclass
class _Stash:
    """Each iteration's (input rows [..., S_i, in], output gradient [..., S_i, out]) of a
    linear map or an RMSNorm, handed over by its backward."""

    inputs: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    eps: float = 0.0  # an RMSNorm's


@dataclass(frozen=True)
class LoopNorm:
    """One iteration's RMSNorm x / rms(x) ⊙ w (``dispatch.rms_normalized``); with a stash
    (backend ``fused``) its weight's gradient is taken once for the whole loop."""

    weight: Tensor  # [d]
    eps: float
    stash: _Stash | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.stash is None:
            return rms_normalized(x, self.weight, self.eps)
        out: Tensor = _DeferredNorm.apply(x, self.weight, self.stash)
        return out


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


class _DeferredNorm(torch.autograd.Function):
    """``hope::rms_norm`` whose backward returns only the input's gradient and stashes
    the input and the output gradient for ``_FanOut``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, stash: _Stash) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.stash = stash
        out: Tensor = rms_norm(x, weight, stash.eps)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        x, weight = ctx.saved_tensors
        ctx.stash.inputs.append(x)
        ctx.stash.grads.append(grad)
        grad_x, _ = rms_norm_backward(x, weight, grad, ctx.stash.eps, False)
        return grad_x, None, None


class _FanOut(torch.autograd.Function):
    """``copies`` aliases of each tensor (copy-major); backward sums each tensor's
    gradients once, or, for a linear map's weight and bias and a deferred RMSNorm's
    weight, takes them from the stash."""

    @staticmethod
    def forward(
        ctx: Any, copies: int, roles: tuple[tuple[str, _Stash | None], ...], *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.roles = roles
        # an RMSNorm's weight enters its own gradient (``rms_norm_backward``)
        norms = [t if role == "norm" else None for (role, _), t in zip(roles, tensors, strict=True)]
        ctx.save_for_backward(*norms)
        return tuple(t.view_as(t) for _ in range(copies) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        count = len(ctx.roles)
        # once: under non-reentrant checkpointing each access unpacks (recomputes) again
        saved = ctx.saved_tensors
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
            if role == "norm":
                taken = rms_norm_backward(rows, saved[slot], grad, stash.eps)[1]
            else:
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


@dataclass(frozen=True)
class LoopShare:
    """One iteration's share (``share_across``): its aliases of the shared tensors, its
    linear maps and its RMSNorms, each in the order given."""

    tensors: list[Any]  # Tensor or None, as given
    linears: list[LoopLinear]
    norms: list[LoopNorm]


def share_across(
    copies: int,
    tensors: Sequence[Tensor | None] = (),
    linears: Sequence[tuple[Tensor, Tensor | None]] = (),
    norms: Sequence[tuple[Tensor, float]] = (),
    enabled: bool = True,
    defer_norms: bool = False,
) -> list[LoopShare]:
    """Per iteration of a loop of ``copies``: aliases of ``tensors`` (None stays None),
    ``LoopLinear`` maps of ``linears`` (weight [out, in], bias [out] or None) and
    ``LoopNorm`` norms of ``norms`` (weight [d], eps), all from one autograd node (module
    docstring); the norms' weight gradients taken once only with ``defer_norms`` (their
    operator is the fused backend's). ``enabled=False``, or nothing that needs a
    gradient: the tensors themselves and plain maps and norms."""
    given = [t for t in tensors if t is not None]
    params = given + [t for w, b in linears for t in (w, b) if t is not None]
    params += [w for w, _ in norms]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in params)
    if not enabled or not needs_grad:
        plain_maps = [LoopLinear(w, b) for w, b in linears]
        plain_norms = [LoopNorm(w, eps) for w, eps in norms]
        return [LoopShare(list(tensors), plain_maps, plain_norms) for _ in range(copies)]
    flat = list(given)
    roles: list[tuple[str, _Stash | None]] = [("sum", None)] * len(given)
    map_stashes = [_Stash() for _ in linears]
    for (weight, bias), stash in zip(linears, map_stashes, strict=True):
        flat.append(_autocast_cast(weight))
        roles.append(("weight", stash))
        if bias is not None:
            flat.append(_autocast_cast(bias))
            roles.append(("bias", stash))
    norm_stashes = [_Stash(eps=eps) if defer_norms else None for _, eps in norms]
    for (weight, _), norm_stash in zip(norms, norm_stashes, strict=True):
        flat.append(weight)
        roles.append(("norm" if defer_norms else "sum", norm_stash))
    aliases = _FanOut.apply(copies, tuple(roles), *flat)
    return [
        _share_of(
            aliases[copy * len(flat) : (copy + 1) * len(flat)],
            tensors,
            linears,
            map_stashes,
            norms,
            norm_stashes,
        )  # fmt: skip
        for copy in range(copies)
    ]


def _share_of(
    own_aliases: Sequence[Tensor],
    tensors: Sequence[Tensor | None],
    linears: Sequence[tuple[Tensor, Tensor | None]],
    map_stashes: list[_Stash],
    norms: Sequence[tuple[Tensor, float]],
    norm_stashes: list[_Stash | None],
) -> LoopShare:
    """One iteration's ``LoopShare`` from its aliases (in ``share_across``'s order)."""
    own = iter(own_aliases)
    plain = [None if t is None else next(own) for t in tensors]
    maps = []
    for (_, bias), stash in zip(linears, map_stashes, strict=True):
        weight_alias = next(own)
        maps.append(LoopLinear(weight_alias, None if bias is None else next(own), stash))
    loop_norms = [
        LoopNorm(next(own), eps, stash) for (_, eps), stash in zip(norms, norm_stashes, strict=True)
    ]
    return LoopShare(plain, maps, loop_norms)

"""loop_shared.share_across: a loop's shared tensors and linear maps give the plain
loop's values and gradients (float64), with each gradient taken once per call."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from hope.memory.ops.layouts import wrapper_launches
from hope.memory.ops.loop_shared import LoopLinear, share_across

DT = torch.float64
STEPS, BATCH, LENGTH, DIM = 5, 2, 3, 4


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _params(seed: int = 0, dtype: torch.dtype = DT) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"scale": (DIM,), "w": (DIM, DIM), "b": (DIM,), "u": (2 * DIM, DIM), "g": (DIM,),
              "g2": (DIM,)}  # fmt: skip
    return {
        name: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
        for name, shape in shapes.items()
    }


def _inputs(seed: int = 1, dtype: torch.dtype = DT) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, LENGTH, DIM, generator=g, dtype=dtype) for _ in range(STEPS)]


def _loop(
    params: dict[str, torch.Tensor], xs: list[torch.Tensor], shared: bool, defer: bool = False
) -> torch.Tensor:
    """A recurrence that uses every parameter once per step: h <- tanh(W(N(h) * s) + b) +
    the first half of U x, N an RMSNorm of weight g; the loss reads every step's h, and
    its RMSNorm of weight g2."""
    parts = share_across(
        len(xs), tensors=[params["scale"]],
        linears=[(params["w"], params["b"]), (params["u"], None)],
        norms=[(params["g"], 1e-6), (params["g2"], 1e-6)], enabled=shared, defer_norms=defer,
    )  # fmt: skip
    h, total = xs[0] * 0.5, xs[0].new_zeros(())
    for x, part in zip(xs, parts, strict=True):
        (scale,), (w, u), (norm, out_norm) = part.tensors, part.linears, part.norms
        h = torch.tanh(w(norm(h) * scale) + b_free(u(x))) + h
        total = total + (h * out_norm(h)).sum()
    return total


def b_free(y: torch.Tensor) -> torch.Tensor:
    return y[..., :DIM] * y[..., DIM:]


def _grads(shared: bool, defer: bool = False) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    params, xs = _params(), _inputs()
    for x in xs:
        x.requires_grad_()
    loss = _loop(params, xs, shared, defer)
    grads = torch.autograd.grad(loss, [*params.values(), *xs])
    return loss, list(grads)


@pytest.mark.parametrize("defer", [False, True], ids=["norm_summed", "norm_deferred"])
def test_shared_loop_equals_the_plain_loop_in_float64(defer: bool) -> None:
    loss, grads = _grads(shared=False)
    loss_s, grads_s = _grads(shared=True, defer=defer)
    torch.testing.assert_close(loss_s, loss, rtol=1e-14, atol=0)
    for got, want in zip(grads_s, grads, strict=True):
        assert got is not None and want is not None
        assert want.abs().max() > 1e-3  # every parameter and input reached
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_each_gradient_is_taken_once_per_call() -> None:
    """Backward's weight matmuls, norm weight sums and accumulations do not grow with
    the loop's length."""
    for steps in (3, 6):
        params = _params()
        xs = [torch.randn(BATCH, LENGTH, DIM, dtype=DT) for _ in range(steps)]
        loss = _loop(params, xs, shared=True, defer=True)
        counter = OpCounter()
        with counter:
            loss.backward()
        ops = counter.ops
        # per step W's input gradient (x needs none, so U has none); W's and U's weight
        # gradients once each (b's as one sum of the joined output gradients)
        assert ops["mm"] == steps + 2, ops
        # per step the norms' input gradients (no weight share); their weights' once
        assert ops["rms_norm_backward"] == 2 * steps + 2, ops
        # the scale's gradient: one stack and one sum; the stashes: two cats each
        assert ops["stack"] == 1 and ops["cat"] == 2 * 4, ops
    # a step's norm backward launches its kernel only (no sum of the blocks' shares)
    op = torch.ops.hope.rms_norm_backward.default
    x, w = torch.ones(2, DIM), torch.ones(DIM)
    assert wrapper_launches(op, (x, w, x, 1e-6, False), {}) == 0
    assert wrapper_launches(op, (x, w, x, 1e-6), {}) == 1


def test_plain_loop_accumulates_per_step() -> None:
    """The count the sharing removes: the plain loop's weight matmuls grow per step."""
    ops = {}
    for steps in (3, 6):
        params = _params()
        xs = [torch.randn(BATCH, LENGTH, DIM, dtype=DT) for _ in range(steps)]
        loss = _loop(params, xs, shared=False)
        counter = OpCounter()
        with counter:
            loss.backward()
        ops[steps] = counter.ops
    assert ops[6]["mm"] - ops[3]["mm"] == 3 * 3  # W's input and weight, U's weight
    assert ops[6]["stack"] == ops[3]["stack"] == 0


def test_a_second_backward_restashes() -> None:
    params, xs = _params(), _inputs()
    loss = _loop(params, xs, shared=True)
    loss.backward(retain_graph=True)
    first = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
    loss.backward()
    for name, grad in first.items():
        torch.testing.assert_close(params[name].grad, 2 * grad, rtol=1e-12, atol=0)


def test_a_linear_alias_used_directly_keeps_its_gradient() -> None:
    """An iteration may read a linear map's weight itself; both gradients arrive."""
    w_plain = torch.randn(DIM, DIM, dtype=DT, requires_grad=True)
    w_shared = w_plain.detach().clone().requires_grad_()
    xs = _inputs()
    for weight, shared in ((w_plain, False), (w_shared, True)):
        parts = share_across(len(xs), linears=[(weight, None)], enabled=shared)
        pairs = [(x, part.linears[0]) for x, part in zip(xs, parts, strict=True)]
        loss = sum(((lin(x) + x @ lin.weight) ** 2).sum() for x, lin in pairs)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
    assert w_shared.grad is not None and w_plain.grad is not None
    torch.testing.assert_close(w_shared.grad, w_plain.grad, rtol=1e-12, atol=1e-12)


def test_without_gradients_the_tensors_themselves_are_handed_out() -> None:
    params = _params()
    with torch.no_grad():
        parts = share_across(3, [params["scale"], None], [(params["w"], params["b"])])
    for part in parts:
        (scale, missing), (lin,) = part.tensors, part.linears
        assert scale is params["scale"] and missing is None
        assert lin.weight is params["w"] and lin.bias is params["b"] and lin.stash is None
    part = share_across(2, [params["scale"], None], [(params["w"], None)], [(params["g"], 0.1)])[1]
    (scale, _), (lin,), (norm,) = part.tensors, part.linears, part.norms
    assert scale is not params["scale"] and lin.stash is not None
    assert norm.stash is None and norm.eps == 0.1  # summed, not deferred, by default


def test_checkpointed_loop_trains_the_same() -> None:
    """Block checkpointing recomputes the loop's forward in backward (each saved tensor
    unpacked once: two deferred norms read the node's saved weights); the gradients stay."""
    params, xs = _params(), _inputs()
    plain = torch.autograd.grad(_loop(params, xs, shared=True), list(params.values()))
    loss = checkpoint(_loop, params, xs, True, True, use_reentrant=False)  # norms deferred
    again = torch.autograd.grad(loss, list(params.values()))
    for got, want in zip(again, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True])
def test_autocast_casts_each_weight_once(shared: bool) -> None:
    """Under bf16 autocast a shared map's weight is cast once per call, as autocast's
    cache does for a plain parameter; gradients stay in the parameters' dtype."""
    params, xs = _params(dtype=torch.float32), _inputs(dtype=torch.float32)
    counter = OpCounter()
    with torch.autocast("cpu", dtype=torch.bfloat16), counter:
        loss = _loop(params, xs, shared)
    copies = counter.ops["_to_copy"]
    loss.backward()
    for name, p in params.items():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    if shared:  # w, b, u once each; every step's inputs (h * s, x) once each
        assert copies == 3 + 2 * STEPS
    reference = _params(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loop(reference, xs, not shared).backward()
    for name, p in params.items():
        ref = reference[name].grad
        assert ref is not None and p.grad is not None
        scale = ref.abs().max()
        torch.testing.assert_close(p.grad / scale, ref / scale, rtol=0, atol=3e-2, msg=name)


def test_loop_linear_without_stash_is_f_linear() -> None:
    w, b = torch.randn(3, 4, dtype=DT), torch.randn(3, dtype=DT)
    x = torch.randn(2, 4, dtype=DT)
    torch.testing.assert_close(LoopLinear(w, b)(x), F.linear(x, w, b), rtol=0, atol=0)

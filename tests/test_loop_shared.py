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
    shapes = {"scale": (DIM,), "w": (DIM, DIM), "b": (DIM,), "u": (2 * DIM, DIM)}
    return {
        name: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
        for name, shape in shapes.items()
    }


def _inputs(seed: int = 1, dtype: torch.dtype = DT) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, LENGTH, DIM, generator=g, dtype=dtype) for _ in range(STEPS)]


def _loop(params: dict[str, torch.Tensor], xs: list[torch.Tensor], shared: bool) -> torch.Tensor:
    """A recurrence that uses every parameter once per step: h <- tanh(W(h * s) + b) +
    the first half of U x; the loss reads every step's h."""
    parts = share_across(
        len(xs), [params["scale"]], [(params["w"], params["b"]), (params["u"], None)], shared
    )
    h, total = torch.zeros_like(xs[0]), xs[0].new_zeros(())
    for x, ((scale,), (w, u)) in zip(xs, parts, strict=True):
        h = torch.tanh(w(h * scale) + b_free(u(x))) + h
        total = total + (h * h).sum()
    return total


def b_free(y: torch.Tensor) -> torch.Tensor:
    return y[..., :DIM] * y[..., DIM:]


def _grads(shared: bool, **kw: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    params, xs = _params(), _inputs()
    for x in xs:
        x.requires_grad_()
    loss = _loop(params, xs, shared, **kw)
    grads = torch.autograd.grad(loss, [*params.values(), *xs])
    return loss, list(grads)


def test_shared_loop_equals_the_plain_loop_in_float64() -> None:
    loss, grads = _grads(shared=False)
    loss_s, grads_s = _grads(shared=True)
    torch.testing.assert_close(loss_s, loss, rtol=0, atol=0)
    for got, want in zip(grads_s, grads, strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_each_gradient_is_taken_once_per_call() -> None:
    """Backward's weight matmuls and accumulations do not grow with the loop's length."""
    counts = {}
    for steps in (3, 6):
        params = _params()
        xs = [torch.randn(BATCH, LENGTH, DIM, dtype=DT) for _ in range(steps)]
        loss = _loop(params, xs, shared=True)
        counter = OpCounter()
        with counter:
            loss.backward()
        counts[steps] = counter.ops
    # per step: W's input gradient and the read of the first input (no U input grad)
    assert counts[6]["mm"] - counts[3]["mm"] == 3
    # the weight gradients: W and U once each (+ b as one sum) whatever the length
    assert counts[3]["mm"] == 3 + 2 and counts[6]["mm"] == 6 + 2
    # the scale's gradient: one stack and one sum, no accumulation per step
    assert counts[3]["stack"] == counts[6]["stack"] == 1
    grew = {op for op in counts[6] if counts[6][op] > counts[3][op]}
    assert "stack" not in grew and "cat" in counts[6]


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
        parts = share_across(len(xs), [], [(weight, None)], shared)
        pairs = zip(xs, parts, strict=True)
        loss = sum(((lin(x) + x @ lin.weight) ** 2).sum() for x, (_, (lin,)) in pairs)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
    assert w_shared.grad is not None and w_plain.grad is not None
    torch.testing.assert_close(w_shared.grad, w_plain.grad, rtol=1e-12, atol=1e-12)


def test_without_gradients_the_tensors_themselves_are_handed_out() -> None:
    params = _params()
    with torch.no_grad():
        parts = share_across(3, [params["scale"], None], [(params["w"], params["b"])])
    for (scale, missing), (lin,) in parts:
        assert scale is params["scale"] and missing is None
        assert lin.weight is params["w"] and lin.bias is params["b"] and lin.stash is None
    (scale, _), (lin,) = share_across(2, [params["scale"], None], [(params["w"], None)])[1]
    assert scale is not params["scale"] and lin.stash is not None


def test_checkpointed_loop_trains_the_same() -> None:
    """Block checkpointing recomputes the loop's forward in backward; the gradients stay."""
    params, xs = _params(), _inputs()
    plain = torch.autograd.grad(_loop(params, xs, shared=True), list(params.values()))
    loss = checkpoint(_loop, params, xs, True, use_reentrant=False)
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

"""The opt-in ``compile`` memory backend and the shared factor/curvature pass (float64)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hope.memory.ops.dispatch import dgd_write, resolve_backend
from hope.memory.residual_mlp import (
    FastWeights,
    chunk_kernel_bound,
    chunk_pass,
    curvature_bound,
    grad_factors,
    mlp_apply,
)

B, H, C, D_IN, D_HID = 2, 3, 5, 4, 8
DT = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(d_out: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=DT) * scale
        return t.to(DEVICE).requires_grad_()

    k = F.normalize(torch.randn(B, H, C, D_IN, generator=gen, dtype=DT), dim=-1)
    return {
        "w1": rand(B, H, d_out, D_HID, scale=0.3),
        "w2": rand(B, H, D_HID, D_IN, scale=0.5),
        "m1": rand(B, H, d_out, D_HID, scale=0.1),
        "m2": rand(B, H, D_HID, D_IN, scale=0.1),
        "k": k.to(DEVICE).requires_grad_(),
        "target": rand(B, H, C, d_out),
        # Large eta and a wide alpha range make the preconditioner and decay matter.
        "eta": (0.05 + 0.5 * torch.rand(B, H, C, generator=gen, dtype=DT))
        .to(DEVICE)
        .requires_grad_(),
        "alpha": (0.6 + 0.4 * torch.rand(B, H, C, generator=gen, dtype=DT))
        .to(DEVICE)
        .requires_grad_(),
    }


def test_compile_backend_is_opt_in_and_unknown_names_are_refused():
    assert resolve_backend(None) == "torch"  # the default, unless a knob set another
    assert resolve_backend("compile") == "compile"
    with pytest.raises(ValueError, match="unknown memory backend 'triton'"):
        resolve_backend("triton")


@pytest.mark.parametrize("objective", ["l2", "dot"])
@pytest.mark.parametrize("residual", ["yes", "no", "mixed"])
def test_chunk_pass_equals_separate_calls(objective, residual):
    """Targets M(v), reads M(q), factors and curvature at k from one MLP call equal
    ``mlp_apply`` / ``grad_factors`` / ``curvature_bound`` called one by one."""
    x = _inputs(D_IN, seed=1)
    flag: bool | torch.Tensor = residual == "yes"
    if residual == "mixed":  # heads 0 and 2 residual, head 1 not (stacked memories)
        flag = torch.tensor([1.0, 0.0, 1.0], dtype=DT, device=DEVICE).view(1, H, 1, 1)
    gen = torch.Generator().manual_seed(5)
    v, q = (torch.randn(B, H, C, D_IN, generator=gen, dtype=DT).to(DEVICE) for _ in range(2))
    step = chunk_pass(x["w1"], x["w2"], v, x["k"], q, objective, flag)
    target = mlp_apply(x["w1"], x["w2"], v, flag)
    torch.testing.assert_close(step.target, target, rtol=0, atol=1e-14)
    assert step.read is not None
    torch.testing.assert_close(step.read, mlp_apply(x["w1"], x["w2"], q, flag), rtol=0, atol=1e-14)
    ref = grad_factors(x["w1"], x["w2"], x["k"], target, objective, flag)
    for name in ("e", "a", "d", "pre"):
        torch.testing.assert_close(
            getattr(step.factors, name), getattr(ref, name), rtol=0, atol=1e-14
        )
    curvature = curvature_bound(x["w1"], x["w2"], x["k"])
    torch.testing.assert_close(step.curvature, curvature, rtol=0, atol=1e-14)
    assert chunk_pass(x["w1"], x["w2"], v, x["k"], None, objective, flag).read is None


def test_chunk_pass_with_given_targets_and_fewer_queries() -> None:
    """The Titans memory's pass: the target given (its values v_t, Ti eq. 12), reads
    of only the last queries (a chunk completing a pending one): the same factors,
    curvature, kernel bound and reads as the separate calls; v and target exclude
    each other."""
    x = _inputs(D_IN, seed=3)
    gen = torch.Generator().manual_seed(6)
    target = torch.randn(B, H, C, D_IN, generator=gen, dtype=DT).to(DEVICE)
    q = torch.randn(B, H, 2, D_IN, generator=gen, dtype=DT).to(DEVICE)
    w1, w2, k = x["w1"], x["w2"], x["k"]
    step = chunk_pass(w1, w2, None, k, q, "l2", True, target=target)
    assert step.target is target and step.read is not None
    torch.testing.assert_close(step.read, mlp_apply(w1, w2, q, True), rtol=0, atol=1e-14)
    ref = grad_factors(w1, w2, k, target, "l2", True)
    for name in ("e", "a", "d", "pre"):
        got, want = getattr(step.factors, name), getattr(ref, name)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    torch.testing.assert_close(step.curvature, curvature_bound(w1, w2, k), rtol=0, atol=1e-14)
    kernel = chunk_kernel_bound(w1, w2, k)
    torch.testing.assert_close(step.coupling, kernel, rtol=0, atol=1e-14)
    for v, given in ((None, None), (target, target)):
        with pytest.raises(ValueError, match="v or the target"):
            chunk_pass(w1, w2, v, k, q, "l2", True, target=given)


# torch.compile (inductor) builds C++ kernels on CPU: seconds per graph on the 2-core
# dev machine, so the compile parity tests are in the slow tier (CI runs them).
@pytest.mark.slow
@pytest.mark.parametrize("d_out", [D_IN, 1])
def test_compile_backend_equals_torch_backend_with_grads(d_out):
    x = _inputs(d_out, seed=2)
    fast = FastWeights(x["w1"], x["w2"], x["m1"], x["m2"])
    kw = dict(objective="l2", residual=d_out == D_IN, precondition=True, momentum=0.3)
    seeds = torch.Generator().manual_seed(3)
    probes = [
        torch.randn(t.shape, generator=seeds, dtype=DT).to(DEVICE) for t in fast.__dict__.values()
    ]
    results = {}
    for backend in ("torch", "compile"):
        out = dgd_write(fast, x["k"], x["target"], x["eta"], x["alpha"], backend=backend, **kw)
        tensors = (out.w1, out.w2, out.m1, out.m2)
        loss = sum((t * p).sum() for t, p in zip(tensors, probes, strict=True))
        grads = torch.autograd.grad(loss, list(x.values()))
        results[backend] = (tensors, grads)
    for got, ref in zip(*(results[b][0] for b in ("compile", "torch")), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    for name, got, ref in zip(x, *(results[b][1] for b in ("compile", "torch")), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10, msg=name)

"""The shell's fused operators (backend ``fused``): ``hope::rms_norm`` (its closed-form
backward against autograd of the PyTorch form, the RMSNorm module on either backend)
and ``hope::rotary`` (on the strided views the attention hands it), with the launches
each way."""

from __future__ import annotations

import pytest
import torch

from hope.bench.measure import LaunchCounter
from hope.layers import apply_rotary, rotary_tables
from hope.memory.norm import RMSNorm
from hope.memory.ops import dispatch
from hope.memory.ops.rms_norm import rms_norm, rms_norm_backward_reference, rms_norm_reference
from hope.memory.ops.rotary import rotary

DT = torch.float64


def _inputs(shape: tuple[int, ...], dtype: torch.dtype = DT) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen, dtype=DT) * torch.logspace(-3, 2, shape[-2])[:, None]
    weight = 1.0 + 0.3 * torch.randn(shape[-1], generator=gen, dtype=DT)
    probe = torch.randn(shape, generator=gen, dtype=DT)
    return x.to(dtype), weight, probe.to(dtype)


@pytest.mark.parametrize("shape", [(2, 7, 24), (3, 5, 1), (1, 40, 130)])
def test_closed_form_backward_equals_autograd_of_the_pytorch_form(shape: tuple[int, ...]) -> None:
    """Rows from rms 1e-3 to 1e2 (eps matters at the small end), width 1 included."""
    x, weight, probe = _inputs(shape)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    want = torch.autograd.grad(rms_norm_reference(x, weight, 1e-6), (x, weight), probe)
    got = rms_norm_backward_reference(x.detach(), weight.detach(), probe, 1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_half_precision_input_is_normalised_in_fp32() -> None:
    """bf16 x and an fp32 weight: y and dx come back in bf16, dw in fp32, all computed
    from the fp32 values (equal to the float64 result within bf16's rounding)."""
    x, weight, probe = _inputs((2, 9, 32))
    low = x.to(torch.bfloat16).requires_grad_(True)
    w32 = weight.float().requires_grad_(True)
    y = rms_norm(low, w32, 1e-6)
    dx, dw = torch.autograd.grad(y, (low, w32), probe.to(torch.bfloat16))
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    exact = low.detach().double().requires_grad_(True)
    w64 = w32.detach().double().requires_grad_(True)
    y64 = rms_norm_reference(exact, w64, 1e-6)
    dx64, dw64 = torch.autograd.grad(y64, (exact, w64), probe.to(torch.bfloat16).double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dx.double(), dx64, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-5, atol=1e-5)


def test_rms_norm_module_is_one_operator_each_way_under_fused() -> None:
    """The same values and gradients on either backend; fused: one launch forward, the
    kernel and the weight gradient's sum backward (``EXTRA_LAUNCHES``), against six
    and eleven eager launches."""
    x, weight, probe = _inputs((2, 6, 16))
    norm = RMSNorm(16, eps=1e-6).to(DT)
    with torch.no_grad():
        norm.weight.copy_(weight)
    results, counts = {}, {}
    for backend in ("torch", "fused"):
        dispatch.set_default_backend(backend)
        try:
            given = x.clone().requires_grad_(True)
            with LaunchCounter() as forward:
                y = norm(given)
            with LaunchCounter() as backward:
                grads = torch.autograd.grad(y, (given, norm.weight), probe)
        finally:
            dispatch.set_default_backend("torch")
        results[backend], counts[backend] = (y, *grads), (forward.count, backward.count)
    for got, want in zip(results["fused"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    assert counts["fused"] == (1, 2)
    assert counts["torch"][0] == 6 and counts["torch"][1] >= 10, counts


@pytest.mark.parametrize("head_dim", [8, 2])
def test_fused_rotary_equals_apply_rotary_on_qkv_views_and_is_one_launch_each_way(
    head_dim: int,
) -> None:
    """k as the attention makes it (a permuted view of the fused qkv projection): the
    rotation and its gradient (the rotation by the opposite angles) equal the PyTorch
    form's; one launch each way, the strided input read in place."""
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(2, 5, 3, 4, head_dim, generator=gen, dtype=DT)  # [B, T, 3, H, D]
    k = qkv.permute(2, 0, 3, 1, 4)[1].requires_grad_(True)  # [B, H, T, D], strided
    assert not k.is_contiguous()
    cos, sin = rotary_tables(head_dim, 3, 5, 10000.0, torch.device("cpu"), DT)
    probe = torch.randn(2, 4, 5, head_dim, generator=gen, dtype=DT)
    with LaunchCounter() as forward:
        got = rotary(k, cos, sin, False)
    with LaunchCounter() as backward:
        (grad,) = torch.autograd.grad(got, k, probe)
    want = apply_rotary(k, cos, sin)
    (grad_want,) = torch.autograd.grad(want, k, probe)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grad, grad_want, rtol=1e-15, atol=1e-15)
    assert got.is_contiguous() and (forward.count, backward.count) == (1, 1)
    # The inverse undoes the rotation.
    back = rotary(got.detach(), cos, sin, True)
    torch.testing.assert_close(back, k.detach(), rtol=1e-13, atol=1e-14)


def test_shell_operators_pass_torch_library_opcheck() -> None:
    """Schema, autograd registration, fake tensors (the dense results the kernels
    return, here for a strided input) and AOT dispatch of both operators."""
    x, weight, _ = _inputs((2, 5, 16))
    qkv = torch.randn(2, 5, 3, 4, 8, dtype=DT)
    k = qkv.permute(2, 0, 3, 1, 4)[1]
    cos, sin = rotary_tables(8, 0, 5, 10000.0, torch.device("cpu"), DT)
    cases = [
        (rms_norm, (x.requires_grad_(True), weight.requires_grad_(True), 1e-6)),
        (rms_norm, (x.transpose(0, 1), weight, 1e-6)),
        (rotary, (k.requires_grad_(True), cos, sin, False)),
    ]
    for op, args in cases:
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, results

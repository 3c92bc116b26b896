"""Memory ops: MLP memory, rank-1 factors, chunk closed forms vs token loops (float64)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch.nn import functional as F

from hope.layers import gelu_backward, gelu_prime
from hope.memory import residual_mlp
from hope.memory.ops.chunk import chunk_dgd_update, chunk_momentum_update
from hope.memory.ops.dispatch import dgd_write, resolve_backend
from hope.memory.ops.naive import naive_dgd_update, naive_inner_grads, naive_momentum_update
from hope.memory.ops.stacking import repeat_heads
from hope.memory.residual_mlp import (
    FastWeights,
    curvature_reference,
    grad_factors,
    inner_loss,
    mlp_apply,
)

B, H, D_IN, D_HID = 2, 2, 4, 8
DT = torch.float64


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=DT) * scale).requires_grad_()


def _chunk_inputs(c: int, d_out: int, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    k = F.normalize(torch.randn(B, H, c, D_IN, dtype=DT), dim=-1).requires_grad_()
    return {
        "w1": _rand(B, H, d_out, D_HID, scale=0.3),
        "w2": _rand(B, H, D_HID, D_IN, scale=0.5),
        "m1": _rand(B, H, d_out, D_HID, scale=0.1),
        "m2": _rand(B, H, D_HID, D_IN, scale=0.1),
        "k": k,
        "e": _rand(B, H, c, d_out),
        "a": _rand(B, H, c, D_HID),
        "d": _rand(B, H, c, D_HID),
        # Large eta and a wide alpha range make the preconditioner and decay matter.
        "eta": (0.05 + 0.5 * torch.rand(B, H, c, dtype=DT)).requires_grad_(),
        "alpha": (0.6 + 0.4 * torch.rand(B, H, c, dtype=DT)).requires_grad_(),
    }


def _naive_from_factors(x: dict[str, torch.Tensor], precondition: bool, momentum: float):
    g1 = x["e"].unsqueeze(-1) * x["a"].unsqueeze(-2)  # [B, H, C, O, M]
    g2 = x["d"].unsqueeze(-1) * x["k"].unsqueeze(-2)  # [B, H, C, M, I]
    return naive_dgd_update(
        x["w1"],
        x["w2"],
        x["m1"],
        x["m2"],
        x["k"],
        g1,
        g2,
        x["eta"],
        x["alpha"],
        precondition,
        momentum,
    )


def _chunk(x: dict[str, torch.Tensor], precondition: bool, momentum: float):
    return chunk_dgd_update(
        x["w1"],
        x["w2"],
        x["m1"],
        x["m2"],
        x["k"],
        x["e"],
        x["a"],
        x["d"],
        x["eta"],
        x["alpha"],
        precondition,
        momentum,
    )


def _grads(outs, inputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=DT)).sum() for o in outs)
    grads = torch.autograd.grad(loss, list(inputs.values()), allow_unused=True)
    return {n: g for n, g in zip(inputs, grads, strict=True) if g is not None}


def test_mlp_apply_is_residual_two_layer_mlp():
    torch.manual_seed(0)
    w1, w2 = torch.randn(B, H, D_IN, D_HID, dtype=DT), torch.randn(B, H, D_HID, D_IN, dtype=DT)
    z = torch.randn(B, H, 5, D_IN, dtype=DT)
    out = mlp_apply(w1, w2, z, residual=True)
    for b in range(B):
        for h in range(H):
            for t in range(5):
                ref = z[b, h, t] + w1[b, h] @ F.gelu(w2[b, h] @ z[b, h, t])
                torch.testing.assert_close(out[b, h, t], ref, rtol=0, atol=1e-12)
    scalar = mlp_apply(w1[:, :, :1], w2, z, residual=False)
    torch.testing.assert_close(
        scalar,
        torch.einsum(
            "bhom,bhtm->bhto", w1[:, :, :1], F.gelu(torch.einsum("bhmi,bhti->bhtm", w2, z))
        ),
    )


@pytest.mark.parametrize("objective", ["l2", "dot"])
@pytest.mark.parametrize("d_out", [D_IN, 1])
def test_grad_factors_equal_autograd_per_token_gradients(objective, d_out):
    torch.manual_seed(1)
    w1, w2 = torch.randn(B, H, d_out, D_HID, dtype=DT), torch.randn(B, H, D_HID, D_IN, dtype=DT)
    k, target = torch.randn(B, H, 7, D_IN, dtype=DT), torch.randn(B, H, 7, d_out, dtype=DT)
    residual = d_out == D_IN
    fac = grad_factors(w1, w2, k, target, objective, residual)
    g1, g2 = naive_inner_grads(w1, w2, k, target, objective, residual)
    torch.testing.assert_close(fac.e.unsqueeze(-1) * fac.a.unsqueeze(-2), g1, rtol=0, atol=1e-12)
    torch.testing.assert_close(fac.d.unsqueeze(-1) * k.unsqueeze(-2), g2, rtol=0, atol=1e-12)


def gelu_prime_reference(z: torch.Tensor) -> torch.Tensor:
    """gelu'(z) = Phi(z) + z phi(z) from elementary ops; autograd derives through each."""
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    return cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def test_gelu_prime_and_its_closed_form_backward_equal_autograd():
    z = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64, requires_grad=True)
    slope = gelu_prime(z)
    (auto_slope,) = torch.autograd.grad(F.gelu(z).sum(), z, create_graph=True)
    torch.testing.assert_close(slope, auto_slope, rtol=0, atol=1e-15)
    probe = torch.randn(241, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (second,) = torch.autograd.grad((slope * probe).sum(), z)
    (twin,) = torch.autograd.grad((gelu_prime_reference(z) * probe).sum(), z)
    (auto_second,) = torch.autograd.grad((auto_slope * probe).sum(), z)
    torch.testing.assert_close(second, twin, rtol=0, atol=1e-14)
    torch.testing.assert_close(second, auto_second, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(gelu_prime, (z[::20].detach().requires_grad_(),))


def test_gelu_backward_is_the_signal_times_gelu_prime_in_value_and_gradients():
    gen = torch.Generator().manual_seed(2)
    z = (3 * torch.randn(5, 7, dtype=DT, generator=gen)).requires_grad_()
    signal = torch.randn(5, 7, dtype=DT, generator=gen, requires_grad=True)
    probe = torch.randn(5, 7, dtype=DT, generator=gen)
    fused = gelu_backward(signal, z)
    plain = signal * gelu_prime(z)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-14)
    grads = torch.autograd.grad((fused * probe).sum(), (signal, z))
    twins = torch.autograd.grad((plain * probe).sum(), (signal, z))
    for got, want in zip(grads, twins, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(gelu_backward, (signal[:2, :3], z[:2, :3]))


@pytest.mark.parametrize("expanded_w1", [False, True])
def test_curvature_closed_form_gradient_equals_its_elementary_twin(expanded_w1):
    """chunk_pass's curvature (one autograd node) vs the elementary-op form: values and
    the gradients of act, slope, W1 (also a per-sample expanded view, as at init) and k."""
    gen = torch.Generator().manual_seed(5)
    shape_h, shape_k = (2, 3, 5, 8), (2, 3, 5, 4)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    act, slope, k = rand(*shape_h), rand(*shape_h), rand(*shape_k)
    w1_base = rand(3, 6, 8) if expanded_w1 else rand(2, 3, 6, 8)
    w1 = w1_base.expand(2, -1, -1, -1) if expanded_w1 else w1_base
    inputs = (act, slope, w1_base, k)
    probe = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    got, back_sq = residual_mlp._Curvature.apply(act, slope, w1, k)
    assert not back_sq.requires_grad  # the kernel bound's input: no graph
    ref = curvature_reference(act, slope, w1, k)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)
    grads = torch.autograd.grad((got * probe).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * probe).sum(), inputs)
    for name, g, r in zip(("act", "slope", "w1", "k"), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12, msg=name)
    checked = (act, slope, w1.detach().contiguous().requires_grad_(), k)  # no stride-0 input
    assert torch.autograd.gradcheck(lambda *t: residual_mlp._Curvature.apply(*t)[0], checked)


def test_curvature_gradient_takes_mixed_precision_inputs_as_autocast_leaves_them():
    """Under bf16 autocast the curvature's inputs can arrive in two dtypes: on CUDA the
    keys come out of their normalisation in fp32 (autocast's fp32 list) beside bf16
    hidden activations, so the incoming gradient is fp32 and the saved slope bf16 (the
    pilot bench of titans_mac failed there). Backward runs outside autocast and still
    returns each input's gradient, equal to the float64 one at bf16 precision."""
    gen = torch.Generator().manual_seed(7)
    act, slope = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 3, 5, 8, generator=gen)
    w1, k = torch.randn(2, 3, 6, 8, generator=gen), torch.randn(2, 3, 5, 4, generator=gen)
    probe = torch.randn(2, 3, 5, generator=gen)
    dtypes = (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    rounded = [t.to(dt) for t, dt in zip((act, slope, w1, k), dtypes, strict=True)]
    mixed = [t.clone().requires_grad_() for t in rounded]
    exact = [t.double().requires_grad_() for t in rounded]
    with torch.autocast("cpu", torch.bfloat16):
        got = residual_mlp._Curvature.apply(*mixed)[0]
    assert got.dtype == torch.float32
    grads = torch.autograd.grad((got * probe).sum(), mixed)
    ref = residual_mlp._Curvature.apply(*exact)[0]
    want = torch.autograd.grad((ref * probe.double()).sum(), exact)
    for name, g, w, t in zip(("act", "slope", "w1", "k"), grads, want, mixed, strict=True):
        assert g.dtype == t.dtype, name
        scale = w.abs().max().item()
        torch.testing.assert_close(g.double(), w, rtol=0.05, atol=0.05 * scale, msg=name)


def test_linear_case_gradient_is_sum_of_two_error_outer_products():
    """For the output (linear) layer: G1 = sum_t 2 (pred_t - v_hat_t) a_t^T (no 1/2)."""
    torch.manual_seed(2)
    w1 = torch.randn(B, H, D_IN, D_HID, dtype=DT, requires_grad=True)
    w2 = torch.randn(B, H, D_HID, D_IN, dtype=DT)
    k, target = torch.randn(B, H, 6, D_IN, dtype=DT), torch.randn(B, H, 6, D_IN, dtype=DT)
    pred = mlp_apply(w1, w2, k, residual=True)
    act = F.gelu(torch.einsum("bhmi,bhti->bhtm", w2, k))
    expected = torch.einsum("bhto,bhtm->bhom", 2 * (pred - target), act)
    (auto,) = torch.autograd.grad(inner_loss(w1, w2, k, target, "l2", True).sum(), w1)
    fac = grad_factors(w1, w2, k, target, "l2", True)
    torch.testing.assert_close(auto, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        torch.einsum("bhto,bhtm->bhom", fac.e, fac.a), expected, rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("precondition", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.7])
@pytest.mark.parametrize("c", [1, 13])
def test_chunk_dgd_equals_token_loop_states_and_grads(precondition, momentum, c):
    x = _chunk_inputs(c, D_IN, seed=3)
    naive = _naive_from_factors(x, precondition, momentum)
    fast = _chunk(x, precondition, momentum)
    for got, ref in zip(fast, naive, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    g_fast, g_naive = _grads(fast, x, seed=4), _grads(naive, x, seed=4)
    assert set(g_fast) == set(g_naive) == set(x) - ({"m1", "m2"} if momentum == 0 else set())
    for name in g_naive:
        torch.testing.assert_close(g_fast[name], g_naive[name], rtol=0, atol=1e-10)


def test_chunk_dgd_gradcheck():
    x = _chunk_inputs(5, 3, seed=5)
    small = {n: t.detach()[:1, :1].clone().requires_grad_() for n, t in x.items()}
    names = list(small)

    def fn(*args: torch.Tensor):
        return _chunk(dict(zip(names, args, strict=True)), True, 0.5)

    assert torch.autograd.gradcheck(fn, tuple(small.values()), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("c", [1, 11])
def test_chunk_momentum_equals_token_loop_states_and_grads(c):
    x = _chunk_inputs(c, D_IN, seed=6)
    gen = torch.Generator().manual_seed(7)
    gates = {
        "theta": (0.5 * torch.rand(B, H, c, generator=gen, dtype=DT)).requires_grad_(),
        "eta": (0.3 + 0.7 * torch.rand(B, H, c, generator=gen, dtype=DT)).requires_grad_(),
        "keep": (0.5 + 0.5 * torch.rand(B, H, c, generator=gen, dtype=DT)).requires_grad_(),
    }
    inputs = {n: x[n] for n in ("w1", "w2", "m1", "m2", "k", "e", "a", "d")} | gates
    fast = chunk_momentum_update(
        x["w1"],
        x["w2"],
        x["m1"],
        x["m2"],
        x["k"],
        x["e"],
        x["a"],
        x["d"],
        gates["theta"],
        gates["eta"],
        gates["keep"],
    )
    g1 = x["e"].unsqueeze(-1) * x["a"].unsqueeze(-2)
    g2 = x["d"].unsqueeze(-1) * x["k"].unsqueeze(-2)
    naive = naive_momentum_update(
        x["w1"], x["w2"], x["m1"], x["m2"], g1, g2, gates["theta"], gates["eta"], gates["keep"]
    )
    for got, ref in zip(fast, naive, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    g_fast, g_naive = _grads(fast, inputs, seed=8), _grads(naive, inputs, seed=8)
    assert set(g_fast) == set(g_naive) == set(inputs)
    for name in g_naive:
        torch.testing.assert_close(g_fast[name], g_naive[name], rtol=0, atol=1e-10)


@pytest.mark.parametrize("objective", ["l2", "dot"])
@pytest.mark.parametrize("d_out", [D_IN, 1])
def test_dgd_write_torch_equals_naive_backend_with_grads(objective, d_out):
    """Factors + closed form == autograd gradients + token loop, end to end."""
    x = _chunk_inputs(9, d_out, seed=9)
    target = _rand(B, H, 9, d_out)
    fast = FastWeights(x["w1"], x["w2"], x["m1"], x["m2"])
    kw = dict(objective=objective, residual=d_out == D_IN, precondition=True, momentum=0.3)
    outs = {
        be: dgd_write(fast, x["k"], target, x["eta"], x["alpha"], backend=be, **kw)
        for be in ("torch", "naive")
    }
    inputs = {"w1": x["w1"], "w2": x["w2"], "k": x["k"], "target": target, "eta": x["eta"]}
    grads = {}
    for be, out in outs.items():
        grads[be] = _grads((out.w1, out.w2, out.m1, out.m2), inputs, seed=10)
    for a, b in zip(
        (outs["torch"].w1, outs["torch"].w2), (outs["naive"].w1, outs["naive"].w2), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for name in inputs:
        torch.testing.assert_close(grads["torch"][name], grads["naive"][name], rtol=0, atol=1e-10)


@pytest.mark.parametrize("precondition", [False, True])
def test_one_write_lowers_inner_loss_on_same_tokens(precondition):
    """Sign: a small-eta write (alpha = 1) descends the memory's own inner loss."""
    torch.manual_seed(11)
    x = _chunk_inputs(8, D_IN, seed=11)
    w1, w2 = x["w1"].detach(), x["w2"].detach()
    k, target = x["k"].detach(), torch.randn(B, H, 8, D_IN, dtype=DT)
    fac = grad_factors(w1, w2, k, target, "l2", True)
    eta = torch.full((B, H, 8), 1e-3, dtype=DT)
    ones = torch.ones(B, H, 8, dtype=DT)
    zero1, zero2 = torch.zeros_like(w1), torch.zeros_like(w2)
    new1, new2, _, _ = chunk_dgd_update(
        w1, w2, zero1, zero2, k, fac.e, fac.a, fac.d, eta, ones, precondition, 0.0
    )
    before = inner_loss(w1, w2, k, target, "l2", True).sum((-1,))
    after = inner_loss(new1, new2, k, target, "l2", True).sum((-1,))
    assert bool((after < before).all()), (before, after)


def test_backend_errors_are_clear():
    with pytest.raises(ValueError, match="unknown memory backend 'cuda'"):
        resolve_backend("cuda")
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention installed; the missing-package error cannot occur")
    x = _chunk_inputs(3, D_IN, seed=12)
    fast = FastWeights(x["w1"], x["w2"], x["m1"], x["m2"])
    with pytest.raises(RuntimeError, match="flash-linear-attention"):
        dgd_write(
            fast,
            x["k"],
            x["e"],
            x["eta"],
            x["alpha"],
            objective="l2",
            residual=True,
            precondition=True,
            momentum=0.0,
            backend="fla",
        )


@pytest.mark.parametrize("precondition", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_chunk_dgd_update_with_keys_and_decays_shared_by_stacked_members(precondition, momentum):
    """Three memories stacked along the head axis passing the k and alpha they share
    ([B, H_k, ...]; the Gram matrix and decay ratios formed once per head) write what
    they write from one copy per member (float64, values and gradients: the shared
    inputs get the sum of their copies' gradients), and each member equals its own
    token loop."""
    members = 3
    x = _chunk_inputs(5, D_IN, seed=11)
    per_member = dict(x)
    for name in ("w1", "w2", "m1", "m2", "e", "a", "d", "eta"):  # the members' own inputs
        gen = torch.Generator().manual_seed(len(name))
        stacked = [x[name].detach()] + [
            x[name].detach() * (1 + 0.3 * torch.rand(x[name].shape, generator=gen, dtype=DT))
            for _ in range(members - 1)
        ]
        per_member[name] = torch.cat(stacked, 1).requires_grad_()
    shared = dict(per_member)
    copies = dict(
        per_member, k=repeat_heads(x["k"], members), alpha=repeat_heads(x["alpha"], members)
    )
    got = _chunk(shared, precondition, momentum)
    want = _chunk(copies, precondition, momentum)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for g, w in zip(_grads(got, shared, 3).values(), _grads(want, shared, 3).values(), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    one = {n: t[:, H : 2 * H] if t.shape[1] == members * H else t for n, t in shared.items()}
    for g, w in zip(got, _naive_from_factors(one, precondition, momentum), strict=True):
        torch.testing.assert_close(g[:, H : 2 * H], w, rtol=1e-9, atol=1e-11)

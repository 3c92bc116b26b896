"""The ``fused`` backend's Titans operators, each against its plain PyTorch path
differentiated by autograd in float64 (values, every input's gradient, one launch each
way): the momentum chunk write and its end weights, a chunk's rates, the memory's
heads and gates, and MAC's segment attention. Their Triton kernels are checked in
test_fused_ops.py's interpreter run.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hope.bench.measure import LaunchCounter
from hope.layers import apply_rotary
from hope.memory.conv import causal_depthwise
from hope.memory.ops import dispatch
from hope.memory.ops.chunk import chunk_momentum_update, momentum_chunk_weights
from hope.memory.ops.chunk_rates import chunk_rates_reference
from hope.memory.ops.end_weights import chunk_end_weights
from hope.memory.ops.fused import momentum_chunk
from hope.memory.ops.segment_attention import (
    masked_attention,
    segment_attention,
    segment_attention_backward,
    segment_visibility,
)
from hope.memory.ops.titans_heads import titans_heads
from test_fused_ops import _inputs

DT = torch.float64


def _momentum_inputs(c: int) -> dict[str, torch.Tensor]:
    x = _inputs(c, seed=10 + c)
    gen = torch.Generator().manual_seed(c)
    w1, w2 = x["w1"], x["w2"]

    def gate(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(w1.shape[0], w1.shape[1], c, generator=gen, dtype=DT)

    eta, keep = gate(0.5, 0.95), gate(0.8, 1.0)
    return {
        "w1": w1, "w2": w2,
        "s1": (0.1 * torch.randn(w1.shape, generator=gen, dtype=DT)).requires_grad_(),
        "s2": (0.1 * torch.randn(w2.shape, generator=gen, dtype=DT)).requires_grad_(),
        "k": x["k"], "e": x["e"], "a": x["a"], "d": x["d"],
        "theta": gate(0.01, 0.2).requires_grad_(), "eta": eta.requires_grad_(),
        "keep": keep.requires_grad_(),
        "end_weights": momentum_chunk_weights(eta.detach(), keep.detach()).requires_grad_(),
    }  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_fused_momentum_write_equals_closed_form_and_its_gradients(chunk: int) -> None:
    """The Titans write's operator: values exactly, every input's gradient (momenta,
    gates and end weights included) to 1e-12 of autograd's through the closed form."""
    x = _momentum_inputs(chunk)
    want, got = chunk_momentum_update(*x.values()), momentum_chunk(*x.values())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    gen = torch.Generator().manual_seed(2)
    probes = [torch.randn(t.shape, generator=gen, dtype=DT) for t in want]

    def grads(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        loss = torch.stack([(o * p).sum() for o, p in zip(outs, probes, strict=True)]).sum()
        return torch.autograd.grad(loss, list(x.values()))

    for name, g, w in zip(x, grads(got), grads(want), strict=True):
        assert w.abs().max() > 0, name
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)
    with LaunchCounter() as forward:
        out = momentum_chunk(*x.values())
    seeds = [torch.ones_like(o) for o in out]  # dense, as a real loss's gradients
    with LaunchCounter() as backward:
        torch.autograd.grad(out, list(x.values()), seeds)
    assert (forward.count, backward.count) == (1, 1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_fused_end_weights_equal_the_closed_form_with_gradients_and_are_one_launch(
    chunk: int,
) -> None:
    """``hope::chunk_end_weights`` on the strided views the Titans gates are: the values
    of ``momentum_chunk_weights`` and autograd's gradients of it (eta and keep, a spread
    of decays down to 0.05 so the terms span many orders), one launch each way."""
    gen = torch.Generator().manual_seed(chunk)
    gates = torch.rand(2, chunk, 6, generator=gen, dtype=DT) * 0.9 + 0.05
    gates.requires_grad_()
    eta, keep = gates.transpose(1, 2).split(3, dim=1)  # [B, H, C] views, as in Titans
    probe = torch.randn(2, 3, chunk, generator=gen, dtype=DT)
    with LaunchCounter() as forward:
        got = chunk_end_weights(eta, keep)
    want = momentum_chunk_weights(eta, keep)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with LaunchCounter() as backward:
        (grad,) = torch.autograd.grad(got, gates, probe)
    (grad_want,) = torch.autograd.grad(want, gates, probe)
    # One token: w = 1 whatever the gates, so no gradient; longer chunks: a real one.
    assert grad_want.abs().max() > 0.1 if chunk > 1 else bool((want == 1).all())
    torch.testing.assert_close(grad, grad_want, rtol=1e-12, atol=1e-13)
    # The operator's backward, then the split and transpose assembling the gates' gradient.
    assert forward.count == 1 and backward.count <= 3


def _titans_chunk(chunk: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A Titans chunk's gates as the strided views the memory takes ([B, T, 3H] rows,
    transposed and split), a curvature bound with entries below 1 (clamped) and a
    kernel bound large enough that the cap binds."""
    gen = torch.Generator().manual_seed(chunk)
    low, span = torch.tensor([0.05] * 3 + [0.5] * 3 + [0.0] * 3), torch.tensor([0.9] * 9)
    gates = (low + span * torch.rand(2, chunk, 9, generator=gen, dtype=DT)).requires_grad_()
    theta, eta, alpha = gates.transpose(1, 2).split(3, dim=1)
    curvature = (torch.rand(2, 3, chunk, generator=gen, dtype=DT) * 40).requires_grad_()
    act = torch.randn(2, 3, chunk, 24, generator=gen, dtype=DT)
    coupling = (act @ act.transpose(-1, -2)).abs()
    return gates, (theta, eta, alpha, curvature, coupling)


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_fused_chunk_rates_equal_the_torch_forms_with_gradients_in_one_launch_each_way(
    chunk: int,
) -> None:
    """``chunk_rates`` under ``fused`` (``hope::titans_chunk_rates``) against the same
    function's PyTorch ops differentiated by autograd: keep, the end weights and the
    capped rates, and the gradients of the gates and the curvature, with every output
    used and with only the rates used; one launch each way instead of ~20."""
    gates, inputs = _titans_chunk(chunk)
    curvature = inputs[3]
    gen = torch.Generator().manual_seed(100 + chunk)
    probes = [torch.randn(2, 3, chunk, generator=gen, dtype=DT) for _ in range(3)]
    counts, values = {}, {}
    for backend in ("fused", "torch"):
        with LaunchCounter() as forward:
            outs = dispatch.chunk_rates(*inputs, backend=backend)
        with LaunchCounter() as backward:
            grads = torch.autograd.grad(outs, (gates, curvature), probes, retain_graph=True)
        rates_only = torch.autograd.grad(outs[2], (gates, curvature), probes[2])
        values[backend] = (*outs, *grads, *rates_only)
        counts[backend] = (forward.count, backward.count)
    for got, want in zip(values["fused"], values["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    cap = chunk_rates_reference(*inputs)[2] * curvature.clamp_min(1.0) / inputs[0]
    d_curvature = values["torch"][4]
    if chunk > 1:  # the cap binds, and a clamped curvature has no gradient
        assert cap.max() < 0.5 and bool((d_curvature[curvature < 1] == 0).all())
        assert bool((curvature < 1).any()) and d_curvature.abs().max() > 1e-3
    # The operator each way, then the split and transpose assembling the gates' gradient.
    assert counts["fused"][0] == 1 and counts["fused"][1] <= 3, counts
    assert counts["torch"][0] >= 10 and counts["torch"][1] >= 10, counts


def _plain_heads(projected, tail, weight, heads):  # type: ignore[no-untyped-def]
    """The Titans memory's plain path from its projection [qkv | gates] (SiLU, the conv
    module's function, heads, F.normalize, sigmoid gates), in the layouts it hands on."""
    pre, gate_pre = projected.split([projected.shape[-1] - 3 * heads, 3 * heads], -1)
    conv, new_tail = causal_depthwise(F.silu(pre), tail, weight)
    batch, length, width = conv.shape
    q, k, v = (
        t.reshape(batch, length, heads, -1).transpose(1, 2) for t in conv.split(width // 3, -1)
    )
    gates = torch.sigmoid(gate_pre).transpose(1, 2).split(heads, 1)
    return (F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, *gates, new_tail)


@pytest.mark.parametrize(
    ("length", "window", "per_sample"),
    [(1, 4, False), (3, 4, False), (21, 4, True), (16, 1, False)],
)
def test_fused_titans_heads_equal_the_plain_path_with_gradients_in_one_launch_each_way(
    length: int, window: int, per_sample: bool
) -> None:
    """``hope::titans_heads`` against the plain path differentiated by autograd: the
    heads, gates and new tail, and the gradients of the projection, the carried tail
    (also through a call shorter than the window, whose new tail holds old tail rows)
    and the conv weight, with every output's gradient given and with some absent; one
    launch forward, and the kernel plus the weight's sum backward (the kernel alone for
    a conv weight per sample [B, 3d, W], whose gradient stays per sample)."""
    heads, d_head = 2, 5
    width = 3 * heads * d_head
    gen = torch.Generator().manual_seed(length)
    leaves = [
        torch.randn(2, length, width + 3 * heads, generator=gen, dtype=DT),
        torch.randn(2, window - 1, width, generator=gen, dtype=DT),
        1.0 + 0.3 * torch.randn(*(2,) * per_sample, width, window, generator=gen, dtype=DT),
    ]
    leaves = [t.requires_grad_() for t in leaves]
    with LaunchCounter() as forward:
        got = titans_heads(*leaves, heads)
    want = _plain_heads(*leaves, heads)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-15)
    probes = [torch.randn(w.shape, generator=gen, dtype=DT) for w in want]
    for used in (range(7), (1, 3, 6)):  # all outputs; k, theta and the new tail only
        pairs = [(i, probes[i]) for i in used]
        with LaunchCounter() as backward:
            grads = torch.autograd.grad(
                [got[i] for i, _ in pairs], leaves, [p for _, p in pairs], retain_graph=True
            )
        wanted = torch.autograd.grad(
            [want[i] for i, _ in pairs], leaves, [p for _, p in pairs], retain_graph=True
        )
        for g, w in zip(grads, wanted, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)
        assert backward.count == 2 - per_sample, backward.count
        assert min(g.abs().max() for g in wanted if g.numel()) > 1e-3  # all reached
    assert forward.count == 1


def _segment_inputs(length: int, persistent: int) -> tuple[torch.Tensor | None, ...]:
    """One MAC segment's attention inputs in the layouts the block hands over: q a
    slice of the call's queries, h's keys and values their projection [B, S, 2d] (here
    with strided rows), the angles slices of the call's tables."""
    gen = torch.Generator().manual_seed(length + persistent)
    batch, heads, dim = 2, 3, 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=DT)

    q = rand(batch, heads, length + 4, dim)[:, :, 2 : 2 + length]
    kv = rand(batch, length, 2 * heads * dim + 5)[..., : 2 * heads * dim]
    angles = 3 * rand(length + 2, dim // 2)[1 : 1 + length]
    p_scores = rand(batch, heads, length, persistent) if persistent else None
    p_values = rand(1, heads, persistent, dim) if persistent else None
    inputs = (q.requires_grad_(), kv.requires_grad_(), angles.cos(), angles.sin(),
              rand(batch, heads, length, dim).requires_grad_(),
              rand(batch, heads, length, dim).requires_grad_(),
              None if p_scores is None else p_scores.requires_grad_(),
              None if p_values is None else p_values.requires_grad_())  # fmt: skip
    return inputs


@pytest.mark.parametrize(("length", "persistent"), [(1, 4), (16, 4), (9, 0)])
def test_fused_segment_attention_equals_the_masked_attention_with_gradients(
    length: int, persistent: int
) -> None:
    """``hope::segment_attention`` against rotary and ``masked_attention`` over
    [P || h || x] with the segment mask, differentiated by autograd: y token-major and
    every input's gradient (h's projection's as one tensor), P's values' summed over the
    batch; one launch forward, one backward (and the sum of P's values' gradients when
    P is given)."""
    inputs = _segment_inputs(length, persistent)
    q, kv, cos, sin, k_seg, v_seg, p_scores, p_values = inputs
    assert q is not None and kv is not None and cos is not None and sin is not None
    with LaunchCounter() as forward:
        got = segment_attention(*inputs)
    k_mem, v_mem = kv.view(2, length, 2, 3, 8).permute(2, 0, 3, 1, 4)
    k_mem = apply_rotary(k_mem, cos, sin)
    values = [v_mem, v_seg] if p_values is None else [p_values.expand(2, -1, -1, -1), v_mem, v_seg]
    hidden = ~segment_visibility(length, q.device)
    want = masked_attention(q, torch.cat((k_mem, k_seg), 2), torch.cat(values, 2), hidden, p_scores)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    assert got.is_contiguous() and got.shape == (2, length, 3, 8)
    probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    with LaunchCounter() as backward:
        grads = torch.autograd.grad(got, leaves, probe)
    wanted = torch.autograd.grad(want, leaves, probe)
    for g, w in zip(grads, wanted, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
        assert w.abs().max() > 1e-3 or length == 1  # one token: q and k get no gradient
    assert (forward.count, backward.count) == (1, 1 + int(persistent > 0))
    if p_values is not None:  # P's values per sample (MAC's, expanded): gradient per sample
        per_sample = list(inputs[:7]) + [p_values.expand(2, -1, -1, -1)]
        with LaunchCounter() as backward:
            found = segment_attention_backward(per_sample, probe)
        assert backward.count == 1 and found[-1].shape == (2, 3, persistent, 8)
        torch.testing.assert_close(found[-1].sum(0, keepdim=True), grads[-1], rtol=1e-13, atol=0)

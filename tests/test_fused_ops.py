"""The ``fused`` memory backend: the SMT's DGD chunk write as one operator
(``hope::dgd_chunk``) with a closed-form backward, and its Triton kernels.

float64 everywhere: the operator equals ``chunk_dgd_update`` and autograd's gradients
of it (which test_memory_ops.py checks against the token loop); the Triton kernels,
run by Triton's interpreter on this CPU, equal the PyTorch forms; a whole HOPE model
trains to the same loss and gradients under either backend.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import functional as F

import hope
from conftest import assert_states_close, state_leaves
from hope.bench.measure import LaunchCounter
from hope.config import TrainConfig
from hope.memory.ops import dispatch
from hope.memory.ops.chunk import chunk_dgd_update, momentum_chunk_weights
from hope.memory.ops.cms_factor_scan import cms_factor_scan, cms_factor_scan_reference
from hope.memory.ops.end_weights import chunk_end_weights
from hope.memory.ops.fused import dgd_chunk
from hope.memory.ops.generation import smt_generation
from hope.memory.ops.layouts import dense_below, dense_copies
from hope.memory.ops.memory_apply import memory_apply
from hope.memory.ops.pointwise import l2_normalize
from hope.memory.ops.smt_step import smt_step
from hope.memory.ops.smt_write import smt_write
from hope.memory.residual_mlp import (
    FastWeights,
    chunk_pass,
    mlp_apply,
    overshoot_ratio,
    stacked_apply,
)
from hope.memory.smt import SelfModifyingTitans
from hope.model.config import ModelConfig
from hope.train.device import setup_runtime

DT = torch.float64
TESTS = Path(__file__).parent
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _inputs(c: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, h, i, m, o = 2, 3, 6, 10, 5

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=DT) * scale).requires_grad_()

    k = F.normalize(torch.randn(b, h, c, i, generator=gen, dtype=DT), dim=-1)
    return {
        "w1": rand(b, h, o, m, scale=0.3),
        "w2": rand(b, h, m, i, scale=0.5),
        "k": k.requires_grad_(),
        "e": rand(b, h, c, o),
        "a": rand(b, h, c, m),
        "d": rand(b, h, c, m),
        # Large steps and a wide decay range: the preconditioner and decays matter.
        "eta": (0.05 + 0.5 * torch.rand(b, h, c, generator=gen, dtype=DT)).requires_grad_(),
        "alpha": (0.6 + 0.4 * torch.rand(b, h, c, generator=gen, dtype=DT)).requires_grad_(),
        "w2k": rand(b, h, c, m),
    }


def _closed_form(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    w1, w2, k, e, a, d, eta, alpha, w2k = x.values()
    return chunk_dgd_update(w1, w2, w1, w2, k, e, a, d, eta, alpha, True, 0.0, w2k)


@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("increments", [True, False])
def test_fused_write_equals_closed_form_and_its_gradients(chunk: int, increments: bool) -> None:
    """Values exactly; gradients of every input to 1e-12 (a loss on W1', W2' and, when
    ``increments``, on the increments too: the momentum rule's path)."""
    x = _inputs(chunk, seed=chunk)
    want, got = _closed_form(x), dgd_chunk(*x.values())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    gen = torch.Generator().manual_seed(1)
    used = 4 if increments else 2
    probes = [torch.randn(t.shape, generator=gen, dtype=DT) for t in want[:used]]

    def grads(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        loss = torch.stack([(o * p).sum() for o, p in zip(outs, probes, strict=False)]).sum()
        return torch.autograd.grad(loss, list(x.values()))

    for name, g, w in zip(x, grads(got), grads(want), strict=True):
        assert w.abs().max() > 0, name  # every input reaches the outputs
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


def test_fused_write_with_shared_keys_and_decays_equals_member_copies() -> None:
    """Three memories stacked on the head axis sharing k and alpha (the SMT's group):
    the operator on the shared tensors equals it on per-member copies, values exactly
    and every gradient (k's and alpha's summed over the members) to 1e-12; one launch
    each way."""
    x = _inputs(7, seed=3)
    members, gen = 3, torch.Generator().manual_seed(5)
    stacked = {
        n: (t.detach().repeat(1, members, *([1] * (t.dim() - 2))) * (1 + 0.1 * torch.rand(
            1, members * t.shape[1], *([1] * (t.dim() - 2)), generator=gen, dtype=DT)))
        .requires_grad_()
        for n, t in x.items() if n not in ("k", "alpha")
    }  # fmt: skip
    shared = {n: stacked.get(n, x[n]) for n in x}
    copies = {n: stacked.get(n, x[n].repeat(1, members, *([1] * (x[n].dim() - 2)))) for n in x}
    with LaunchCounter() as forward:
        got = dgd_chunk(*shared.values())
    want = dgd_chunk(*copies.values())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    probes = [torch.randn(t.shape, generator=gen, dtype=DT) for t in want[:2]]
    with LaunchCounter() as backward:
        got_grads = torch.autograd.grad(got[:2], list(shared.values()), probes)
    want_grads = torch.autograd.grad(want[:2], list(shared.values()), probes)
    for name, g, w in zip(shared, got_grads, want_grads, strict=True):
        assert w.abs().max() > 0, name
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)
    assert (forward.count, backward.count) == (1, 1)


def test_fused_write_is_one_launch_each_way() -> None:
    """What a GPU pays per chunk write: one kernel forward, one backward (the closed
    form differentiated by autograd: dozens each way)."""
    counts = {}
    for name, write in (("fused", lambda x: dgd_chunk(*x.values())), ("torch", _closed_form)):
        x = _inputs(8)
        with LaunchCounter() as forward:
            out = write(x)
        seeds = [torch.ones_like(t) for t in out[:2]]  # dense, as a real loss's gradients
        with LaunchCounter() as backward:
            torch.autograd.backward(out[:2], seeds)
        counts[name] = (forward.count, backward.count)
    assert counts["fused"] == (1, 1), counts
    assert counts["torch"][0] > 20 and counts["torch"][1] > 40, counts


def test_fused_normalize_equals_f_normalize_with_gradients_and_is_one_launch() -> None:
    """Zero and tiny rows included (where the norm is clamped, the gradient is g/eps)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 9, 7, generator=gen, dtype=DT)
    x[0, 0, 0], x[0, 0, 1] = 0.0, 1e-14 * x[0, 0, 1]
    x.requires_grad_()
    probe = torch.randn(x.shape, generator=gen, dtype=DT)
    with LaunchCounter() as forward:
        got = l2_normalize(x)
    want = F.normalize(x, dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with LaunchCounter() as backward:
        (grad,) = torch.autograd.grad(got, x, probe)
    (grad_want,) = torch.autograd.grad(want, x, probe)
    torch.testing.assert_close(grad, grad_want, rtol=1e-13, atol=1e-15)
    assert grad_want[0, 0, 0].abs().min() > 1e10  # the clamped row: g / eps
    assert (forward.count, backward.count) == (1, 1)


def test_torch_unit_rows_equals_f_normalize_with_gradients_in_fewer_launches() -> None:
    """The ``torch`` backend's normalisation (``unit_rows_torch``): F.normalize's values
    and gradients, zero and tiny rows included, in six backward launches (autograd
    through F.normalize: 14); the ``naive`` oracle keeps F.normalize itself."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 9, 7, generator=gen, dtype=DT)
    x[0, 0, 0], x[0, 0, 1] = 0.0, 1e-14 * x[0, 0, 1]
    x.requires_grad_()
    probe = torch.randn(x.shape, generator=gen, dtype=DT)
    got = dispatch.unit_rows(x, "torch")
    want = F.normalize(x, dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with LaunchCounter() as backward:
        (grad,) = torch.autograd.grad(got, x, probe)
    with LaunchCounter() as plain:
        (grad_want,) = torch.autograd.grad(want, x, probe)
    torch.testing.assert_close(grad, grad_want, rtol=1e-13, atol=1e-15)
    assert grad[0, 0, 0].abs().min() > 1e10  # the clamped row: g / eps
    assert (backward.count, plain.count) == (6, 14)
    with LaunchCounter() as oracle:
        torch.autograd.grad(dispatch.unit_rows(x, "naive"), x, probe)
    assert oracle.count == 3 + 14  # F.normalize forward and autograd's backward
    assert torch.autograd.gradcheck(
        lambda t: dispatch.unit_rows(t, "torch"), (x[1:2, :2].detach().requires_grad_(),)
    )


def test_launch_counter_counts_the_copies_a_cuda_wrapper_makes_of_strided_arguments() -> None:
    """A strided argument is copied dense before the kernel (one more launch) unless the
    kernel reads it through its strides (``memory/ops/layouts.py``)."""
    x = torch.randn(3, 5, 8, dtype=DT)
    for given, launches in ((x, 1), (x.transpose(0, 1), 2), (x[:, :, :4], 2)):
        with LaunchCounter() as counter:
            l2_normalize(given)
        assert counter.count == launches
    gates = torch.rand(2, 7, 6, dtype=DT) * 0.5 + 0.4
    eta, keep = gates.transpose(1, 2).split(3, dim=1)
    assert not eta.is_contiguous()
    with LaunchCounter() as counter:
        chunk_end_weights(eta, keep)  # read through their strides
    assert counter.count == 1
    with LaunchCounter() as counter:
        momentum_chunk_weights(eta, keep)  # aten ops only: nothing added
    plain = counter.count
    assert plain > 5


def test_dense_copies_skip_only_the_strides_a_kernel_reads() -> None:
    """``smt_step_backward`` reads saved x, query, b_alpha and the read's gradient at any
    strides, the rows' and gates' gradients at any batch and head strides: every other
    strided argument is one copy."""
    op = torch.ops.hope.smt_step_backward.default
    dense = torch.zeros(1, 2, 8, 3, 4)
    sliced = torch.zeros(1, 2, 16, 3, 4)[:, :, :8]  # gaps between heads only
    twisted = torch.zeros(1, 2, 3, 8, 4).transpose(2, 3)  # gaps inside a head's rows
    saved = [dense, dense, twisted, sliced, None, None, twisted, sliced, None, None, dense, dense]
    grads = [None, None, None, None, sliced, twisted, twisted, None, None, None, None, None]
    # copied: saved[7] (not read in place) and grads[5] (its rows are not dense)
    assert dense_copies(op, (saved, False, False, 1.0, 4, False, grads), {}) == 2
    assert dense_below(sliced, 2) and not dense_below(twisted, 2) and dense_below(twisted, 4)
    # memory_pass's backward reads the reads' gradient (a slice of MAC's joined reads')
    # in place; another strided gradient (D's) is copied
    op = torch.ops.hope.memory_pass_backward.default
    joined = torch.zeros(1, 2, 48, 4)[:, :, 16:32]
    pass_grads = [None, joined, None, None, None, None, None]
    assert dense_copies(op, ([dense] * 8, True, False, pass_grads), {}) == 0
    assert dense_copies(op, ([dense] * 8, True, False, [joined] * 2 + [None] * 5), {}) == 1
    # memory_apply reads z and, backward, the output's gradient through their strides
    op = torch.ops.hope.memory_apply_backward.default
    assert dense_copies(op, (dense, dense, twisted, None, True, 0, 1, twisted), {}) == 0


PASS_CASES = {
    # SMT: three stacked members (mixed residual), values, partial reads.
    "smt": {"g": 3, "cq": 3, "titans": False, "dot": False},
    "smt-dot": {"g": 3, "cq": 5, "titans": False, "dot": True},
    "smt-single-no-reads": {"g": 1, "cq": 0, "titans": False, "dot": False},
    # Titans: given targets, reads of every key, the curvature in the outer graph.
    "titans": {"g": 1, "cq": 5, "titans": True, "dot": False},
}


@pytest.mark.parametrize("case", PASS_CASES.values(), ids=list(PASS_CASES))
def test_fused_memory_pass_equals_chunk_pass_with_gradients_and_is_one_launch(
    case: dict[str, Any],
) -> None:
    """``hope::memory_pass`` on shared (unrepeated) v, k, q equals ``chunk_pass`` on
    member copies: every output, and the gradients of every input (the shared ones
    summed over the members) under a random probe of every output."""
    g, cq, titans, dot = case.values()
    gen = torch.Generator().manual_seed(g * 10 + cq)
    b, h, c, i, m = 2, 2, 5, 8, 12

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=DT) * scale).requires_grad_()

    w1, w2, k = rand(b, g * h, i, m, scale=0.3), rand(b, g * h, m, i, scale=0.4), rand(b, h, c, i)
    v = None if titans else rand(b, h, c, i)
    q = rand(b, h, cq, i) if cq else None
    target = rand(b, h, c, i) if titans else None
    flags = torch.tensor([1.0, 0.0, 1.0][:g], dtype=DT).repeat_interleave(h).view(1, -1, 1, 1)
    residual = flags if g > 1 else True
    objective = "dot" if dot else "l2"
    copies = [None if t is None else t.repeat(1, g, 1, 1) for t in (v, k, q)]
    want = chunk_pass(w1, w2, *copies, objective, residual, target=target)
    with LaunchCounter() as forward:
        got = chunk_pass(w1, w2, v, k, q, objective, residual, target, fused=True, members=g)
    assert got.keys is k  # shared: the write reads it as it is, no copies
    pairs = [(got.target, want.target), (got.curvature, want.curvature),
             (got.coupling, want.coupling)]  # fmt: skip
    pairs += [(getattr(got.factors, f), getattr(want.factors, f)) for f in ("e", "a", "d", "pre")]
    if cq:
        pairs.append((got.read, want.read))
    for x, y in pairs:
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)
    assert got.coupling.grad_fn is None and want.coupling.grad_fn is None
    differentiable = [j for j, (_, y) in enumerate(pairs) if y.requires_grad]
    probes = [torch.randn(y.shape, generator=gen, dtype=DT) for _, y in pairs]
    inputs = [t for t in (w1, w2, k, v, q, target) if t is not None]

    def grads(which: int) -> tuple[torch.Tensor, ...]:
        outs = [pairs[j][which] for j in differentiable]
        return torch.autograd.grad(outs, inputs, [probes[j] for j in differentiable])

    with LaunchCounter() as backward:
        got_grads = grads(0)
    for x, y in zip(got_grads, grads(1), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    # One launch each way; backward, one add more where a probed output is an input
    # (the given Titans targets), to sum its gradients.
    assert (forward.count, backward.count) == (1, 1 + int(titans))


@pytest.mark.parametrize(("first", "count"), [(0, 3), (0, 2), (2, 1)])
def test_fused_stacked_apply_equals_member_copies_with_gradients_and_is_one_launch(
    first: int, count: int
) -> None:
    """``hope::memory_apply`` (members ``first`` .. of a mixed-residual stack on one
    shared z) equals ``mlp_apply`` on the selected members and copies of z, and so do
    its gradients: zero for the members not applied, z's summed over the members."""
    gen = torch.Generator().manual_seed(first * 10 + count)
    b, g, h, t, i, m = 2, 3, 2, 5, 6, 10

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=DT) * scale).requires_grad_()

    w1, w2, z = rand(b, g * h, i, m, scale=0.3), rand(b, g * h, m, i, scale=0.5), rand(b, h, t, i)
    flags = torch.tensor([1.0, 0.0, 1.0], dtype=DT).repeat_interleave(h).view(1, -1, 1, 1)
    part = slice(first * h, (first + count) * h)
    want = mlp_apply(w1[:, part], w2[:, part], z.repeat(1, count, 1, 1), flags[:, part])
    with LaunchCounter() as forward:
        got = stacked_apply(w1, w2, z, flags, first, count, fused=True)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
    probe = torch.randn(want.shape, generator=gen, dtype=DT)
    with LaunchCounter() as backward:
        grads = torch.autograd.grad(got, (w1, w2, z), probe)
    for x, y in zip(grads, torch.autograd.grad(want, (w1, w2, z), probe), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    assert bool((grads[0][:, : first * h] == 0).all()) and bool(grads[1][:, part].abs().sum() > 0)
    assert (forward.count, backward.count) == (1, 1)
    # The unfused path equals it too (all members evaluated only when all are asked).
    torch.testing.assert_close(stacked_apply(w1, w2, z, flags, first, count, fused=False), want)


def test_fused_read_takes_strided_queries_and_lays_its_output_out_token_major() -> None:
    """MAC's retrieval: a memory read of a chunk of token-major queries, written over a
    [B, T, H, d] buffer, so merging its heads per token and W_o's input gradient need no
    copy; one launch each way, the values and gradients of the member-major read."""
    gen = torch.Generator().manual_seed(5)
    b, h, t, i, m = 2, 3, 6, 4, 8
    w1 = (0.3 * torch.randn(b, h, i, m, generator=gen, dtype=DT)).requires_grad_()
    w2 = (0.5 * torch.randn(b, h, m, i, generator=gen, dtype=DT)).requires_grad_()
    tokens = torch.randn(b, t + 3, h, i, generator=gen, dtype=DT).requires_grad_()
    z = tokens.transpose(1, 2)[:, :, 1 : 1 + t]  # [B, H, T, I] through strides
    with LaunchCounter() as forward:
        got = stacked_apply(w1, w2, z, True, 0, 1, fused=True, token_major=True)
        merged = got.transpose(1, 2).reshape(b, t, h * i)  # a view: no launch
    assert got.transpose(1, 2).is_contiguous() and merged.data_ptr() == got.data_ptr()
    want = mlp_apply(w1, w2, z, True)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
    probe = torch.randn(b, t, h * i, generator=gen, dtype=DT)
    with LaunchCounter() as backward:
        grads = torch.autograd.grad(merged, (w1, w2, tokens), probe)
    wanted = torch.autograd.grad(want.transpose(1, 2).reshape(b, t, h * i), (w1, w2, tokens), probe)
    for x, y in zip(grads, wanted, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    # the read's operator each way, no copy of z or of the gradient; the other backward
    # launch is the slice's gradient into ``tokens`` (autograd's, not the read's)
    assert forward.count == 1 and backward.count == 2, (forward.count, backward.count)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_q", "adaptive_q"])
def test_fused_generation_equals_the_pytorch_epilogue_with_gradients(adaptive: bool) -> None:
    """``hope::smt_generation`` equals F.normalize / softplus / sigmoid on the members'
    outputs (eq. 83), and so do the gradients of the outputs, the query and b_alpha;
    one launch forward, the operator and b_alpha's batch sum backward."""
    gen = torch.Generator().manual_seed(int(adaptive))
    b, h, t, o = 2, 3, 5, 6
    members = 5 if adaptive else 4
    raw = torch.randn(b, members * h, t, o, generator=gen, dtype=DT)
    raw[:, -2 * h :, :, 1:] = 0.0  # scalar memories: their first column
    raw = raw.requires_grad_()
    query = None if adaptive else torch.randn(b, h, t, o, generator=gen, dtype=DT).requires_grad_()
    bias = torch.randn(h, generator=gen, dtype=DT).requires_grad_()
    with LaunchCounter() as forward:
        got = smt_generation(raw, query, bias, 0.7)
    parts = raw.split(h, dim=1)
    want = (
        F.normalize(parts[0], dim=-1), F.normalize(parts[1], dim=-1),
        F.normalize(parts[2] if query is None else query, dim=-1),
        0.7 * F.softplus(parts[-2][..., 0]), torch.sigmoid(parts[-1][..., 0] + bias[:, None]),
    )  # fmt: skip
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-14, atol=1e-15)
    inputs = [t for t in (raw, query, bias) if t is not None]
    probes = [torch.randn(y.shape, generator=gen, dtype=DT) for y in want]
    with LaunchCounter() as backward:
        got_grads = torch.autograd.grad(got, inputs, probes)
    for x, y in zip(got_grads, torch.autograd.grad(want, inputs, probes), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    assert (forward.count, backward.count) == (1, 2)


@pytest.mark.parametrize("reads", [0, 3], ids=["no_reads", "reads"])
def test_fused_smt_write_equals_the_pytorch_pass_bound_and_write(reads: int) -> None:
    """``hope::smt_write`` (three stacked memories, mixed residual flags, shared k, v, q,
    eta, alpha) equals the PyTorch forms composed: ``chunk_pass`` on member copies,
    the bounded step, the closed-form DGD write; W1', W2', the increments and the reads,
    and every input's gradient. One launch each way."""
    gen = torch.Generator().manual_seed(reads)
    b, g, h, c, i, m = 2, 3, 2, 6, 8, 12

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=DT) * scale).requires_grad_()

    def unit(*shape: int) -> torch.Tensor:
        return F.normalize(torch.randn(*shape, generator=gen, dtype=DT), dim=-1).requires_grad_()

    w1, w2 = rand(b, g * h, i, m, scale=0.3), rand(b, g * h, m, i, scale=0.5)
    k, v, q = unit(b, h, c, i), unit(b, h, c, i), unit(b, h, reads, i) if reads else None
    eta = (0.05 + 0.5 * torch.rand(b, h, c, generator=gen, dtype=DT)).requires_grad_()
    alpha = (0.6 + 0.4 * torch.rand(b, h, c, generator=gen, dtype=DT)).requires_grad_()
    flags = torch.tensor([1.0, 0.0, 1.0], dtype=DT).repeat_interleave(h)
    with LaunchCounter() as forward:
        got = smt_write(w1, w2, k, v, q, eta, alpha, flags, False, False)
    step = chunk_pass(w1, w2, v, k, q, "l2", flags.view(1, -1, 1, 1), members=g)
    fast = FastWeights(w1, w2, torch.zeros_like(w1), torch.zeros_like(w2))
    new = dispatch.dgd_write(
        fast, step.keys, step.target, dispatch.bounded_step(step.coupling, eta, "torch"), alpha,
        objective="l2", residual=flags.view(1, -1, 1, 1), precondition=True, momentum=0.0,
        backend="torch", factors=step.factors,
    )  # fmt: skip
    want = [new.w1, new.w2, new.m1, new.m2] + ([step.read] if reads else [])
    for x, y in zip(got, want, strict=False):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)
    inputs = [t for t in (w1, w2, k, v, q, eta, alpha) if t is not None]
    probes = [torch.randn(y.shape, generator=gen, dtype=DT) for y in want]
    with LaunchCounter() as backward:
        got_grads = torch.autograd.grad(got[: len(want)], inputs, probes)
    for x, y in zip(got_grads, torch.autograd.grad(want, inputs, probes), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    assert (forward.count, backward.count) == (1, 1)


@pytest.mark.parametrize(
    ("own_read", "adaptive", "held"),
    [(True, False, 0), (True, True, 0), (False, False, 0), (False, True, 5), (False, False, 10)],
    ids=["mem_in_stack", "mem_in_stack-adaptive_q", "mem_apart", "pending-adaptive_q", "flush"],
)
def test_fused_smt_step_equals_the_operators_it_joins(
    own_read: bool, adaptive: bool, held: int
) -> None:
    """``hope::smt_step`` equals ``memory_apply`` (generation) -> ``smt_generation`` ->
    ``smt_write`` (+ M_mem's read, in the write or apart; + the pending tokens joined and,
    once they make C_m = 15 tokens, M_mem's ``smt_write``; M_mem's state and b_alpha
    carried to the next step) composed: every output and every input's gradient, bit for
    bit (the PyTorch form is that composition). One launch each way; the composition is
    3-9 forward and 10+ backward."""
    gen = torch.Generator().manual_seed(2 * own_read + adaptive + held)
    b, h, c, d, m = 2, 3, 5, 8, 12
    g, flush = 5 if adaptive else 4, held + c == 15
    members = g + own_read

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=DT) * scale).requires_grad_()

    w1, w2 = rand(b, members * h, d, m, scale=0.3), rand(b, members * h, m, d, scale=0.5)
    x, query = rand(b, h, c, d), None if adaptive else rand(b, h, c, d)
    mem = (rand(b, h, d, m, scale=0.3), rand(b, h, m, d, scale=0.5))
    r1, r2 = (None, None) if own_read else mem
    rows = F.normalize(torch.randn(b, h, held, 3, d, generator=gen, dtype=DT), dim=-1)
    steps, decays = (torch.rand(b, h, held, generator=gen, dtype=DT) for _ in "sd")
    gates = torch.stack((0.05 + 0.5 * steps, 0.6 + 0.4 * decays), -1)
    pending = (rows.requires_grad_(), gates.requires_grad_()) if held else (None, None)
    bias = rand(h)
    per_sample = bias.expand(b, h)  # the step's form: its gradient is summed once per call
    flags = torch.tensor([1.0] * (g - 2) + [0.0, 0.0] + [1.0] * own_read, dtype=DT)
    scale = flags.repeat_interleave(h)
    with LaunchCounter() as forward:
        got = smt_step(w1, w2, x, query, r1, r2, per_sample, scale, *pending, False, False, 0.3,
                       g, flush)  # fmt: skip
    with LaunchCounter() as composed:
        raw = memory_apply(w1, w2, x, scale, False, 0, g)
        k, v, q, eta, alpha = smt_generation(raw, query, bias, 0.3)
        out = smt_write(w1, w2, k, v, q if own_read else None, eta, alpha, scale, False, False)
        read = out[4][:, -h:] if own_read else memory_apply(r1, r2, q, None, True, 0, 1)
        new_rows, new_gates = torch.stack((k, v, q), 3), torch.stack((eta, alpha), -1)
        if held:
            new_rows, new_gates = torch.cat((rows, new_rows), 2), torch.cat((gates, new_gates), 2)
        written = [torch.empty(0, dtype=DT)] * 4
        if not own_read:  # M_mem carried unchanged, or written
            written[:2] = mem
        if flush:
            keys, values = new_rows[..., 0, :], new_rows[..., 1, :]
            steps, decays = new_gates[..., 0], new_gates[..., 1]
            args = (keys, values, None, steps, decays, None, True, False)
            written = list(smt_write(*mem, *args)[:4])
    want = (*out[:4], new_rows, new_gates, read, *written, per_sample)
    for x_, y_ in zip(got, want, strict=True):
        torch.testing.assert_close(x_, y_, rtol=0, atol=0)
    inputs = [t for t in (w1, w2, x, query, r1, r2, *pending) if t is not None]
    present = [j for j, y in enumerate(want) if y.numel()]  # M_mem's state unless flushed
    probes = [torch.randn(want[j].shape, generator=gen, dtype=DT) for j in present]
    with LaunchCounter() as backward:
        *got_grads, g_bias = torch.autograd.grad(
            [got[j] for j in present], [*inputs, per_sample], probes
        )
    with LaunchCounter() as composed_backward:
        want_grads = torch.autograd.grad([want[j] for j in present], [*inputs, bias], probes)
    for x_, y_ in zip([*got_grads, g_bias.sum(0)], want_grads, strict=True):
        torch.testing.assert_close(x_, y_, rtol=1e-12, atol=1e-14)
    assert (forward.count, backward.count) == (1, 1)
    counts = (composed.count, composed_backward.count)
    assert counts[0] >= 3 and counts[1] >= 10, counts
    # The fake (what compile and CUDA graphs trace) returns as many storages as outputs:
    # torch.library refuses outputs that alias one another.
    real = [None if t is None else t.detach() for t in (w1, w2, x, query, r1, r2, per_sample,
                                                        scale, *pending)]  # fmt: skip
    with FakeTensorMode() as fake_mode:
        args = [None if t is None else fake_mode.from_tensor(t) for t in real]
        traced = torch.ops.hope.smt_step.default(*args, False, False, 0.3, g, flush)
        storages = {StorageWeakRef(t.untyped_storage()) for t in traced}
    assert len(storages) == len(traced)


def test_fused_cms_factor_scan_is_one_launch_with_the_reference_values() -> None:
    """``hope::cms_factor_scan``: the CMS dual form's chunk scan, one launch instead of
    5 per fired chunk, the same values (on a CPU its form is the reference; the Triton
    kernel is compared with it in the interpreter and on CUDA)."""
    gen = torch.Generator().manual_seed(0)
    rows, fired, hid, chunk = 24, 20, 12, 4
    chunk_of = torch.arange(rows) // chunk
    earlier = chunk_of[:, None] > chunk_of[None, :fired]
    key, teach = (torch.randn(2, rows, fired, generator=gen, dtype=DT) * earlier for _ in "kt")
    pre_0, back_0 = (torch.randn(2, rows, hid, generator=gen, dtype=DT) for _ in "pb")
    with LaunchCounter() as fused:
        got = cms_factor_scan(pre_0, back_0, key, teach, chunk)
    with LaunchCounter() as loop:
        want = cms_factor_scan_reference(pre_0, back_0, key, teach, chunk)
    for x_, y_ in zip(got, want, strict=True):
        torch.testing.assert_close(x_, y_, rtol=0, atol=0)
    # The first chunk reads the carried state only; later ones the earlier factors too.
    torch.testing.assert_close(got[0][:, :chunk], F.gelu(pre_0[:, :chunk]), rtol=0, atol=0)
    assert (got[0][:, chunk:] - F.gelu(pre_0[:, chunk:fired])).abs().min() > 0
    # The loop: two products, the GELU, its copy and the slope per chunk; one buffer.
    assert (fused.count, loop.count) == (1, 5 * (fired // chunk) + 1)
    with pytest.raises(ValueError, match="20 tokens in chunks of 3"):
        cms_factor_scan(pre_0, back_0, key, teach, 3)


def test_cms_scan_runs_its_gelu_natively_and_restores_the_flag() -> None:
    """On a CPU the scan's row-sized GELUs bypass oneDNN (setup costs more than the
    rows); the values are the scan's in float32 within rounding of the oneDNN kernel,
    and the global flag is as it was after the call, also after an error inside."""
    gen = torch.Generator().manual_seed(0)
    rows, chunk = 16, 1
    earlier = torch.ones(rows, rows).tril(-1)
    key, teach = (torch.randn(3, rows, rows, generator=gen) * earlier / 4 for _ in "kt")
    pre_0, back_0 = (torch.randn(3, rows, 40, generator=gen) for _ in "pb")
    seen: list[bool] = []
    original = F.gelu

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch.backends.mkldnn.enabled)
        return original(x, *args, **kwargs)

    assert torch.backends.mkldnn.enabled
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "gelu", spy)
        hidden, back = cms_factor_scan_reference(pre_0, back_0, key, teach, chunk)
    assert seen == [False] * rows and torch.backends.mkldnn.enabled
    # the same recurrence in float64 (no oneDNN there), step by step
    want_h, want_b = cms_factor_scan_reference(
        *(t.double() for t in (pre_0, back_0, key, teach)), chunk
    )
    torch.testing.assert_close(hidden, want_h.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back, want_b.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):
        cms_factor_scan_reference(pre_0, back_0[:, :, :3], key, teach, chunk)
    assert torch.backends.mkldnn.enabled


def test_fused_bounded_step_is_one_launch_each_way_and_the_same_value() -> None:
    """The SMT's bounded step eta / (1 + rho) with its gradient (rho not differentiated):
    one launch each way under ``fused``."""
    gen = torch.Generator().manual_seed(0)
    act = torch.randn(2, 3, 12, 8, generator=gen, dtype=DT)
    kernel = (act @ act.transpose(-1, -2)).abs()
    step = torch.rand(2, 3, 12, generator=gen, dtype=DT).requires_grad_()
    probe = torch.randn(step.shape, generator=gen, dtype=DT)
    counts, values = {}, {}
    for backend in ("fused", "torch"):
        with LaunchCounter() as counter:
            bounded = dispatch.bounded_step(kernel, step, backend)
        with LaunchCounter() as backward:
            (grad,) = torch.autograd.grad(bounded, step, probe)
        values[backend] = (bounded, grad)
        counts[backend] = (counter.count, backward.count)
    for got, want in zip(values["fused"], values["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    rho = overshoot_ratio(kernel, step.detach())
    assert rho.shape == (2, 3) and bool((rho > 0.5).all())  # the bound binds here
    torch.testing.assert_close(values["torch"][1], probe / (1.0 + rho.unsqueeze(-1)))
    assert counts["fused"] == (1, 1) and counts["torch"][0] > 20, counts


def _train_step(model_cfg: ModelConfig, backend: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    dispatch.set_default_backend(backend)
    try:
        torch.manual_seed(0)
        model = hope.build_model(model_cfg).double()
        tokens = torch.randint(0, model_cfg.vocab_size or 64, (2, 48))
        loss = model.training_loss(tokens, tokens)
        loss.backward()
    finally:
        dispatch.set_default_backend("torch")
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


FROZEN = {"smt_chunk": 16, "smt_mem_chunk": 16, "smt_read_chunk": 4}


@pytest.mark.parametrize(
    ("variant", "extra"),
    [
        ("hope", {}),
        ("hope", {"smt_adaptive_q": True, "smt_mem_chunk": 8}),
        ("hope", {"cms_periods": [16, 32]}),
        ("hope", {"cms_periods": [16, 32], "smt_checkpoint_chunks": 4}),
        ("hope", FROZEN),
        ("titans_mac", {}),
        ("titans_mac", {"titans_persistent": 0, "titans_chunk": 10}),
        ("titans_mag", {}),
        ("titans_lmm", {"titans_depth": 3}),
        ("transformer", {}),
    ],
    ids=[
        "hope",
        "hope-adaptive_q-one_group",
        "hope-walked",
        "hope-walked-checkpointed",
        "hope-frozen_reads",
        "titans_mac",
        "titans_mac-no_persistent-partial_segment",
        "titans_mag",
        "titans_lmm-depth3",
        "transformer",
    ],
)
def test_fused_backend_trains_a_model_to_the_same_loss_and_gradients(
    variant: str, extra: dict[str, int]
) -> None:
    """HOPE (its SMT writes through the operator; the frozen-read mode's masked copies
    too), Titans (its heads, step sizes and momentum write through ``hope::titans_heads``,
    ``hope::titans_chunk_rates`` and ``hope::momentum_chunk``; MAC's segment attention
    through ``hope::segment_attention``, also without P and with a partial last segment;
    a depth-3 memory's steps) and the
    transformer (its norms and rotary embedding through ``hope::rms_norm`` and
    ``hope::rotary``) under ``fused`` equal ``torch`` in float64."""
    shape = {"dim": 32, "n_heads": 2, "n_layers": 2, "vocab_size": 64, "cms_periods": [4, 16],
             "smt_chunk": 8, "smt_mem_chunk": 16, "titans_chunk": 8}  # fmt: skip
    cfg = dataclasses.replace(ModelConfig(), variant=variant, **{**shape, **extra})
    want_loss, want = _train_step(cfg, "torch")
    got_loss, got = _train_step(cfg, "fused")
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-13, atol=0)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)


def _smt_run(module: SelfModifyingTitans, x: torch.Tensor, splits: list[int], backend: str):
    """Output, final state and every parameter's and x's gradient of a loss on both, the
    sequence fed in pieces of ``splits`` tokens."""
    dispatch.set_default_backend(backend)
    try:
        x = x.clone().requires_grad_(True)
        state, parts = module.init_state(x.shape[0]), []
        for piece in x.split(splits, dim=1):
            y, state = module(piece, state)
            parts.append(y)
        y = torch.cat(parts, dim=1)
        leaves = [t for _, t in state_leaves(state) if isinstance(t, torch.Tensor)]
        loss = y.pow(2).sum() + sum(t.pow(2).sum() for t in leaves)
        grads = torch.autograd.grad(loss, [*module.parameters(), x], allow_unused=True)
    finally:
        dispatch.set_default_backend("torch")
    return y, state, grads


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"smt_chunk": 3, "smt_mem_chunk": 3},
        {"smt_adaptive_q": True, "smt_mem_chunk": 9, "smt_checkpoint_chunks": 2},
        {"write_grad": "truncated", "write_grad_window": 2, "smt_objective": "dot"},
        {"smt_checkpoint_chunks": 4},
        {"smt_chunk": 3, "smt_mem_chunk": 3, "smt_checkpoint_chunks": 3},
        {"write_grad": "truncated", "write_grad_window": 2, "smt_checkpoint_chunks": 4},
    ],
    ids=[
        "two_groups",
        "one_group",
        "adaptive_q-checkpointed",
        "truncated-dot",
        "two_groups-walked",
        "one_group-walked",
        "truncated-checkpointed",
    ],  # fmt: skip
)
def test_fused_smt_steps_equal_torch_in_one_call_and_streamed(overrides: dict[str, Any]) -> None:
    """The SMT with complete chunks through ``hope::smt_step`` equals the torch backend:
    outputs, final states (pending M_mem chunks and a partial chunk included) and every
    gradient, in one call and fed in pieces off every chunk grid (partial chunks take
    the per-operator path, complete ones the step)."""
    torch.manual_seed(0)
    base = {"dim": 8, "n_heads": 2, "smt_expansion": 2, "smt_chunk": 3, "smt_mem_chunk": 6,
            "smt_eta_scale": 0.05, "smt_retention_init": 0.9, "smt_conv_window": 3}  # fmt: skip
    cfg = dataclasses.replace(ModelConfig(), **(base | overrides))
    module = SelfModifyingTitans(cfg.smt_config()).to(DT)
    x = torch.randn(2, 22, 8, dtype=DT, generator=torch.Generator().manual_seed(1))
    want = _smt_run(module, x, [22], "torch")
    for splits in ([22], [4, 1, 8, 2, 7]):
        got = _smt_run(module, x, splits, "fused")
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
        assert_states_close(got[1], want[1], atol=1e-12)
        for g, w, like in zip(got[2], want[2], [*module.parameters(), x], strict=True):
            # None = no path to the loss; one operator may give such an input zeros
            # (write-gradient truncation cuts the generators' only paths).
            g, w = (torch.zeros_like(like) if t is None else t for t in (g, w))
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_fused_write_through_dgd_write_and_fallbacks() -> None:
    """dgd_write under ``fused``: the operator for the default rule, the closed form bit
    for bit for the rules it has no kernel for (momentum, no preconditioning)."""
    x = _inputs(6)
    w1, w2 = x["w1"], x["w2"]
    fast = FastWeights(w1, w2, torch.zeros_like(w1), torch.zeros_like(w2))
    target = torch.randn(w1.shape[0], w1.shape[1], 6, w1.shape[2], dtype=DT)
    args = (fast, x["k"], target, x["eta"], x["alpha"])
    for precondition, momentum in ((True, 0.0), (True, 0.5), (False, 0.0)):
        kw = {"objective": "l2", "residual": False, "precondition": precondition,
              "momentum": momentum}  # fmt: skip
        got = dispatch.dgd_write(*args, **kw, backend="fused")
        want = dispatch.dgd_write(*args, **kw, backend="torch")
        exact = 0.0 if momentum or not precondition else 1e-14
        for name in ("w1", "w2", "m1", "m2"):
            torch.testing.assert_close(
                getattr(got, name), getattr(want, name), rtol=exact, atol=exact, msg=name
            )


def test_fused_backend_is_accepted_on_a_cpu_and_named_in_errors() -> None:
    setup_runtime(TrainConfig(memory_backend="fused"), torch.device("cpu"))
    try:
        assert dispatch.resolve_backend(None) == "fused"
    finally:
        dispatch.set_default_backend("torch")
    with pytest.raises(ValueError, match="unknown memory backend 'fuse'"):
        dispatch.resolve_backend("fuse")


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is installed with the dev extra")
def test_kernel_products_follow_the_runs_tf32_policy() -> None:
    """The kernels multiply fp32 as the run's PyTorch matmuls do (``configure_numerics``):
    on TF32 tensor cores where TF32 is allowed (bf16/auto runs; bf16 inputs are computed
    in fp32), in IEEE fp32 otherwise; fp64 always in IEEE."""
    from hope.memory.ops.triton_kernels import dot_precision, launch_sizes

    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    w1 = [torch.zeros(1, 2, 4, 8, dtype=dtype) for dtype in dtypes]
    k = torch.zeros(1, 2, 16, 4)
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert [dot_precision(w) for w in w1] == ["ieee", "ieee", "ieee"]
        assert launch_sizes(w1[0], k)["DOT"] == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert [dot_precision(w) for w in w1] == ["tf32", "tf32", "ieee"]
        assert launch_sizes(w1[0], k)["DOT"] == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def _run_worker(device: str, env: dict[str, str], *dtypes: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, str(TESTS / "triton_worker.py"), device, *dtypes],
        env={**os.environ, "PYTHONPATH": str(TESTS), **env},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_errors(errors: dict[str, float], fp32_tol: float, count: int) -> None:
    assert len(errors) == count
    for name, err in errors.items():
        # bf16 outputs: a few bf16 ulps (2^-8 each) of the largest value
        limit = 1e-13 if "float64" in name else 2e-2 if "bfloat16" in name else fp32_tol
        assert err < limit, (name, err)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is installed with the dev extra")
def test_triton_kernels_equal_the_pytorch_forms_in_the_interpreter() -> None:
    """The kernels' arithmetic, run by Triton's interpreter on this CPU: the DGD write
    over padded tiles (C = 1, 8, 16, 20; odd widths), several h_m blocks, with and
    without increment gradients; the overshoot bound with non-writing tokens; float64
    and float32 (the SMT step and walk in float64 alone: triton_worker.main)."""
    _check_errors(_run_worker("cpu", {"TRITON_INTERPRET": "1"}), fp32_tol=5e-6, count=246)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is installed with the dev extra")
def test_tf32_products_keep_the_smt_recurrence_within_bf16_rounding() -> None:
    """A bf16 run's kernels multiply fp32 on TF32 tensor cores (``dot_precision``). With
    the interpreter rounding their operands to TF32's 10 mantissa bits, the DGD chunk
    write and the SMT chunk step (float32, every case) stay within bf16's rounding
    (2^-8 = 3.9e-3) of the largest value of each output, and visibly off the IEEE
    products' ~1e-6 (the rounding is on). The whole float32 check under TF32 gave a
    median of 3.6e-4 and a maximum of 2.3e-3 (docs/PERFORMANCE.md, the ``fused`` backend)."""
    errors = _run_worker("cpu", {"TRITON_INTERPRET": "1", "HOPE_TF32": "1"}, "--core")
    # three DGD checks for each of the worker's 4 shapes, two for each of its 6 step cases
    assert len(errors) == 3 * 4 + 2 * 6, sorted(errors)
    assert max(errors.values()) < 2**-8, max(errors.items(), key=lambda kv: kv[1])
    assert max(errors.values()) > 1e-4


# Every kernel the fused backend has, as the worker launches them.
KERNELS = {
    "_dgd_chunk_fwd", "_dgd_chunk_bwd", "_momentum_fwd", "_momentum_bwd", "_normalize",
    "_bounded_step", "_chunk_rates", "_memory_pass_fwd", "_memory_pass_bwd",
    "_memory_apply_fwd", "_memory_apply_bwd", "_generation_fwd", "_generation_bwd",
    "_smt_write_fwd", "_smt_write_bwd", "_smt_step_fwd", "_smt_step_bwd", "_cms_scan",
    "_end_weights", "_rms_norm", "_rotary", "_heads_fwd", "_heads_bwd",
    "_segment_attention", "_smt_walk_fwd", "_smt_walk_bwd",
}  # fmt: skip


def _compile_kernels(cache: Path, *flags: str, timeout: float) -> dict[str, dict[str, int]]:
    """tests/triton_compile.py's report, compiled into the empty Triton cache ``cache``
    (a cold compile whatever an earlier run left on this machine)."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "TRITON_DEFAULT_FP_FUSION": "1",
           "TRITON_CACHE_DIR": str(cache)}  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(TESTS / "triton_compile.py"), *flags],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    kernels = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(kernels) == KERNELS
    for name, info in kernels.items():
        assert info["launched"] >= info["compiled"] >= 1 and info["ptx_bytes"] > 10_000, name
    # Every kernel with tl.dot products runs them on tensor cores (TF32) in each variant.
    with_dot = {name for name, info in kernels.items() if info["mma"] >= 0}
    assert {"_smt_walk_fwd", "_smt_walk_bwd", "_dgd_chunk_fwd", "_cms_scan"} <= with_dot
    assert all(kernels[name]["mma"] > 0 for name in with_dot), kernels
    return kernels


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is installed with the dev extra")
def test_triton_kernels_compile_for_a_gpu_without_one(tmp_path: Path) -> None:
    """Each kernel compiled by Triton's CUDA backend for sm_90 to PTX and a cubin on
    this CPU, from an empty cache, fp32 products on TF32 tensor cores as a bf16 run
    makes them: of the flag combinations the parity tests launch, the one that switches
    on the most constexpr branches, then the largest tiles (~2 min on 2 cores). Every
    combination: ``test_triton_kernels_compile_in_every_launched_specialisation``."""
    kernels = _compile_kernels(tmp_path / "triton-cache", timeout=900)
    assert all(info["compiled"] == 1 for info in kernels.values()), kernels
    # The worker launches several flag combinations of most kernels (126 in all).
    assert sum(info["launched"] for info in kernels.values()) >= 100


@pytest.mark.triton_full
@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is installed with the dev extra")
def test_triton_kernels_compile_in_every_launched_specialisation(tmp_path: Path) -> None:
    """Every flag combination the parity tests launch compiled for sm_90 (opt-in:
    ``pytest -m triton_full``, ~17 min cold on 2 cores; scripts/gpu_check.sh runs it)."""
    kernels = _compile_kernels(tmp_path / "triton-cache", "--every", timeout=3600)
    assert all(info["compiled"] == info["launched"] for info in kernels.values()), kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_equal_the_pytorch_forms_on_cuda() -> None:
    # float32 only: what training runs, and half the kernels to compile (the interpreter
    # covers float64), so gpu_check's parity part stays within its limit.
    _check_errors(_run_worker("cuda", {}, "float32"), fp32_tol=5e-5, count=138)

"""Frozen-base reads of the SMT (``memory/smt_frozen.py``, MECHANISMS §8.2), float64.

The batched form (one masked write per read boundary, stacked along the head axis)
against its plain twin: for every read, the token-loop write of just that read's
prefix of the segment, gradients taken at the segment start, then M(q). Streaming,
batch independence and causality of the mode run in tests/test_streaming.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from conftest import F64, assert_states_close, rand64
from hope.memory.ops.dispatch import dgd_write
from hope.memory.pieces import PieceGrid
from hope.memory.residual_mlp import FastWeights, chunk_pass, mlp_apply
from hope.memory.smt import SelfModifyingTitans
from hope.memory.smt_frozen import ReadSpan, frozen_segment, read_spans
from hope.memory.smt_state import Generated, bounded_eta
from hope.model.config import ModelConfig

B, H, D, HID, L, R = 2, 2, 4, 8, 10, 4


def segment_inputs(seed: int = 0) -> tuple[FastWeights, Generated]:
    """M_mem's segment-start state and L generated tokens, every tensor a leaf."""
    w1, w2 = 0.3 * rand64(B, H, D, HID, seed=seed), 0.3 * rand64(B, H, HID, D, seed=seed + 1)
    fast = FastWeights(w1, w2, torch.zeros_like(w1), torch.zeros_like(w2))
    k = F.normalize(rand64(B, H, L, D, seed=seed + 2), dim=-1)
    v = F.normalize(rand64(B, H, L, D, seed=seed + 3), dim=-1)
    q = F.normalize(rand64(B, H, L, D, seed=seed + 4), dim=-1)
    eta = 0.3 * torch.sigmoid(rand64(B, H, L, seed=seed + 5))
    alpha = 0.8 + 0.2 * torch.sigmoid(rand64(B, H, L, seed=seed + 6))
    leaves = [t.requires_grad_() for t in (w1, w2, k, v, q, eta, alpha)]
    return FastWeights(*leaves[:2], fast.m1, fast.m2), Generated(*leaves[2:])


def prefix_state(fast: FastWeights, gen: Generated, stop: int) -> FastWeights:
    """The plain twin: M_mem after the token-loop write of the segment's first ``stop``
    tokens alone, its gradients and overshoot bound those of that prefix."""
    if stop == 0:
        return fast
    k, v, eta, alpha = (t[:, :, :stop] for t in (gen.k, gen.v, gen.eta, gen.alpha))
    prefix = chunk_pass(fast.w1, fast.w2, v, k, None, "l2", True)
    return dgd_write(
        fast, k, prefix.target, bounded_eta(eta, prefix.coupling), alpha, objective="l2",
        residual=True, precondition=True, momentum=0.0, backend="naive",
    )  # fmt: skip


def twin_reads(fast: FastWeights, gen: Generated, spans: tuple[ReadSpan, ...]) -> torch.Tensor:
    reads = []
    for span in spans:
        state = prefix_state(fast, gen, span.bound)
        reads.append(mlp_apply(state.w1, state.w2, gen.q[:, :, span.lo : span.hi], True))
    return torch.cat(reads, dim=2)


def leaves(fast: FastWeights, gen: Generated) -> list[torch.Tensor]:
    return [fast.w1, fast.w2, gen.k, gen.v, gen.q, gen.eta, gen.alpha]


@pytest.mark.parametrize("first", [0, 3, 8])
def test_batched_reads_and_state_equal_the_prefix_writes(first: int) -> None:
    fast, gen = segment_inputs()
    spans = read_spans(first, L, R)
    assert [s.bound for s in spans] == list(range(first - first % R, L, R))
    reads, state = frozen_segment(fast, gen, spans, True, R, "l2", True, "torch")
    want_reads, want_state = twin_reads(fast, gen, spans), prefix_state(fast, gen, L)
    assert state is not None and reads.shape == (B, H, L - first, D)
    torch.testing.assert_close(reads, want_reads, rtol=0, atol=1e-12)
    assert_states_close(state, want_state, atol=1e-12)
    weights = rand64(*reads.shape, seed=9)
    got = (weights * reads).sum() + state.w1.sum() + state.w2.sum()
    want = (weights * want_reads).sum() + want_state.w1.sum() + want_state.w2.sum()
    grads = torch.autograd.grad(got, leaves(fast, gen))
    want_grads = torch.autograd.grad(want, leaves(fast, gen))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)
    assert min(float(g.abs().max()) for g in grads) > 0  # every input reaches the reads


def test_a_partial_segment_reads_what_the_whole_one_reads() -> None:
    """Streaming at the kernel level: reads of tokens [0, 6) from a 6-token segment
    equal the same tokens' reads once the segment has all L tokens."""
    fast, gen = segment_inputs()
    part = Generated(*(t[:, :, :6] for t in (gen.k, gen.v, gen.q, gen.eta, gen.alpha)))
    early, none = frozen_segment(fast, part, read_spans(0, 6, R), False, R, "l2", True, "torch")
    whole, _ = frozen_segment(fast, gen, read_spans(0, L, R), True, R, "l2", True, "torch")
    assert none is None
    torch.testing.assert_close(early, whole[:, :, :6], rtol=0, atol=1e-13)


def test_cut_spans_detach_exactly_the_tokens_before_the_cut() -> None:
    """A span's cut and base flag: the read's value is unchanged, and its gradient
    reaches the writing tokens at or after the cut (and the segment-start state only
    with ``base_graph``)."""
    fast, gen = segment_inputs()
    plain = ReadSpan(8, 8, 10)
    for span in (plain, ReadSpan(8, 8, 10, cut=5), ReadSpan(8, 8, 10, cut=8, base_graph=False)):
        read, _ = frozen_segment(fast, gen, (span,), False, R, "l2", True, "torch")
        base, _ = frozen_segment(fast, gen, (plain,), False, R, "l2", True, "torch")
        torch.testing.assert_close(read, base, rtol=0, atol=0)
        g_w1, g_k = torch.autograd.grad(read.sum(), [fast.w1, gen.k], allow_unused=True)
        reached = g_k.abs().sum(dim=(0, 1, 3)) > 0  # [L]: which tokens' keys reach it
        assert reached.tolist() == [span.cut <= t < 8 for t in range(L)], span
        assert (g_w1 is not None and g_w1.abs().max() > 0) == span.base_graph, span


def test_pass_a_spans_keep_their_own_piece_only() -> None:
    """Pieces of 3 tokens from call token 1 (offset 2), a segment from call token 0:
    every read is cut at its piece's first token (at most its bound), and split where
    a piece ends."""
    spans = read_spans(0, 10, 4, pieces=PieceGrid(3, 2), at=0, live_from=0)
    got = [(s.bound, s.lo, s.hi, s.cut) for s in spans]
    assert got == [(0, 0, 1, 0), (0, 1, 4, 0), (4, 4, 7, 4), (4, 7, 8, 4), (8, 8, 10, 7)]
    # the segment-start state holds graph from a piece before the read's: detached whole
    held = read_spans(4, 10, 4, pieces=PieceGrid(3, 0), at=-4, live_from=-5)
    assert [(s.cut, s.base_graph) for s in held] == [(4, False), (4, False), (8, False)]
    stop = read_spans(0, 10, 4, stopgrad=True)
    assert [(s.cut, s.base_graph) for s in stop] == [(0, True), (4, False), (8, False)]


def smt_pair(**knobs: object) -> tuple[SelfModifyingTitans, ModelConfig]:
    cfg = ModelConfig(
        dim=8, n_heads=2, smt_chunk=8, smt_mem_chunk=8, smt_read_chunk=2, vocab_size=16,
        smt_eta_scale=0.2, smt_retention_init=0.9, **knobs,  # type: ignore[arg-type]
    )  # fmt: skip
    torch.manual_seed(0)
    return SelfModifyingTitans(cfg.smt_config()).to(F64), cfg


def test_smt_frozen_fast_path_equals_its_naive_twin_with_gradients() -> None:
    smt, _ = smt_pair()
    x = rand64(2, 21, 8, seed=3).requires_grad_()
    fast, fast_state = smt(x)
    naive, naive_state = smt(x, backend="naive")
    torch.testing.assert_close(fast, naive, rtol=0, atol=1e-12)
    assert_states_close(fast_state.memories, naive_state.memories, atol=1e-12)
    params = [x, *smt.parameters()]
    weights = rand64(*fast.shape, seed=4)
    grads = torch.autograd.grad((weights * fast).sum(), params)
    want = torch.autograd.grad((weights * naive).sum(), params)
    for name, g, w in zip(["x", *dict(smt.named_parameters())], grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10, msg=name)


@pytest.mark.usefixtures("compile_without_codegen")
def test_compiled_frozen_segments_equal_eager_in_checkpointed_segments() -> None:
    """backend="compile" traces the frozen segment (partial and whole) like the other
    chunk-step functions; with loop checkpointing: same outputs, state, gradients."""
    smt, _ = smt_pair(smt_checkpoint_chunks=2)
    x = rand64(2, 21, 8, seed=3)
    runs = {}
    for backend in ("compile", "torch"):
        params = list(smt.parameters())
        y, state = smt(x, backend=backend)
        runs[backend] = (y, state, torch.autograd.grad(y.square().sum(), params))
    torch.testing.assert_close(runs["compile"][0], runs["torch"][0], rtol=0, atol=1e-12)
    assert_states_close(runs["compile"][1], runs["torch"][1], atol=1e-12)
    for g, w in zip(runs["compile"][2], runs["torch"][2], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_read_chunk_of_a_whole_chunk_is_the_exact_smt_and_finer_reads_differ() -> None:
    frozen, cfg = smt_pair()
    exact = SelfModifyingTitans(dataclasses.replace(cfg, smt_read_chunk=None).smt_config())
    whole = SelfModifyingTitans(dataclasses.replace(cfg, smt_read_chunk=8).smt_config())
    for other in (exact, whole):
        other.to(F64).load_state_dict(frozen.state_dict())
    x = rand64(2, 21, 8, seed=3)
    assert torch.equal(whole(x)[0], exact(x)[0])
    diff = (frozen(x)[0] - exact(x)[0]).abs().amax(dim=(0, 2))  # per token
    # tokens 0-1 of each 8-token chunk read its start state in both; later ones do not
    assert diff[:2].max() < 1e-14 and diff[2:8].min() > 1e-6


def test_stopgrad_reads_past_the_segment_start_have_no_path_to_earlier_tokens() -> None:
    for write_grad, linked in (("stopgrad", False), ("full", True)):
        smt, _ = smt_pair(smt_conv_window=0, write_grad=write_grad)
        x = rand64(1, 8, 8, seed=5).requires_grad_()
        y, _ = smt(x)
        (grad,) = torch.autograd.grad(y[0, 6].sum(), x)  # token 6 reads the state at 6
        assert (grad[0, :6].abs().max() > 0) == linked, write_grad
        assert grad[0, 7].abs().max() == 0  # causal


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"smt_read_chunk": 3}, "smt_read_chunk=3 must divide model.smt_chunk=8"),
        ({"smt_mem_chunk": 16}, "smt_mem_chunk=16 equal to model.smt_chunk=8"),
        ({"smt_momentum": 0.5}, "smt_momentum=0.5 must be 0"),
    ],
)
def test_bad_read_chunks_are_refused_naming_the_key(knobs: dict, message: str) -> None:
    _, cfg = smt_pair()
    with pytest.raises(ValueError, match=message):
        SelfModifyingTitans(dataclasses.replace(cfg, **knobs).smt_config())

"""Teach pass A with SMT chunks coarser than the CMS grid (MECHANISMS §8.3b, §3).

The SMT runs pass A as one call that cuts its own cross-piece paths, so C_o and C_m
need not divide C1. Here C1 = 2 while C_o = 4 and C_m = 8: every SMT chunk spans
two or more pieces. float64 throughout.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import hope
from conftest import F64
from hope.memory.conv import CausalDepthwiseConv
from hope.memory.fast_state import detach_state, tensor_leaves
from hope.memory.ops import dispatch
from hope.memory.pieces import PieceGrid
from hope.model.hope import AttentionMixer, HopeLM
from hope.model.teach import IGNORE_INDEX, head_signal, teach_signal, token_ce, token_entropy

VOCAB = 64
T = 16
C1 = 2


def coarse_model(*extra: str, seed: int = 0) -> HopeLM:
    cfg = hope.load_config(
        None,
        [
            "model.variant=hope",
            "model.cms_mode=teach_pass",
            "model.dim=16",
            "model.n_layers=2",
            "model.n_heads=2",
            f"tokenizer.vocab_size={VOCAB}",
            f"model.cms_periods=[{C1}, {2 * C1}]",
            "model.smt_chunk=4",
            "model.smt_mem_chunk=8",
            "model.cms_lr=1.0",
            "model.smt_eta_scale=0.05",
            "model.smt_retention_init=0.9",
            *extra,
        ],
    )
    torch.manual_seed(seed)
    model = hope.build_model(cfg.model)
    assert isinstance(model, HopeLM)
    return model.to(F64)


@pytest.fixture(params=["torch", "fused"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both memory backends: under ``fused`` the SMT's complete chunks run as one
    ``hope::smt_step`` each, cut between pieces from outside the operator."""
    dispatch.set_default_backend(request.param)
    yield request.param
    dispatch.set_default_backend("torch")


def data(batch: int = 2, length: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, VOCAB, (batch, length), generator=gen),
        torch.randint(0, VOCAB, (batch, length), generator=gen),
    )


def test_conv_cut_keeps_values_and_drops_cross_piece_gradients() -> None:
    torch.manual_seed(0)
    conv = CausalDepthwiseConv(3, 4).to(F64)
    with torch.no_grad():
        conv.weight.add_(torch.randn_like(conv.weight))  # every tap clearly non-zero
    x = torch.randn(1, 7, 3, dtype=F64, requires_grad=True)
    tail = torch.randn(1, 3, 3, dtype=F64)
    grid = PieceGrid(3, 1)  # pieces: {0, 1}, {2, 3, 4}, {5, 6}
    plain, plain_tail = conv(x, tail)
    cut, cut_tail = conv(x, tail, grid)
    torch.testing.assert_close(cut, plain, rtol=0, atol=1e-14)
    assert torch.equal(cut_tail, plain_tail)
    for t in range(7):
        (grad,) = torch.autograd.grad(cut[0, t].sum(), x, retain_graph=True)
        reached = grad[0].abs().sum(dim=-1) > 0  # [T]: which inputs y_t depends on
        want = [grid.piece_of(s) == grid.piece_of(t) and t - 3 <= s <= t for s in range(7)]
        assert reached.tolist() == want, t


@pytest.mark.parametrize(("size", "offset"), ((1, 0), (2, 0), (2, 1), (3, 2), (8, 0)))
@pytest.mark.usefixtures("backend")
def test_smt_pass_a_call_has_the_values_of_a_plain_call(size: int, offset: int) -> None:
    model = coarse_model()
    block = model.hope_blocks()[1]
    x = torch.randn(2, 13, 16, dtype=F64)  # odd length: a partial final SMT chunk
    state = block.init_state(2, torch.device("cpu"))
    plain, plain_state = block.mix(x, state.mixer, 0)
    cut, cut_state = block.mix_pieces(x, state.mixer, 0, PieceGrid(size, offset))
    torch.testing.assert_close(cut, plain, rtol=0, atol=1e-13)
    for a, b in zip(tensor_leaves(cut_state), tensor_leaves(plain_state), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
        assert not a.requires_grad


def uncut_theta0_graph(
    model: HopeLM, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The one-call θ0-CMS model with nothing detached: (level outputs, per-token CE)."""
    h = model.embed(x)
    outputs: list[torch.Tensor] = []
    state = model.init_state(x.shape[0])
    for block, block_state in zip(model.hope_blocks(), state.blocks, strict=True):
        h, _ = block.mix(h, block_state.mixer, 0)
        h, taps = block.cms.read(h)
        outputs.extend(tap.output for tap in taps)
    losses = F.cross_entropy(model.logits(h).flatten(0, 1), y.flatten(), reduction="none")
    return outputs, losses.view(y.shape)


def per_piece_gradient(model: HopeLM, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """δ by definition: for each piece, ∂(Σ CE over that piece)/∂(level outputs of that
    piece) on the uncut one-call graph. With pieces aligned to the SMT chunk grid (C1
    divides C_o), no path between two tokens of one piece crosses another piece, so
    this equals pass A's cut graph."""
    outputs, losses = uncut_theta0_graph(model, x, y)
    deltas = [torch.zeros_like(o) for o in outputs]
    for start in range(0, x.shape[1], C1):
        stop = min(x.shape[1], start + C1)
        grads = torch.autograd.grad(losses[:, start:stop].sum(), outputs, retain_graph=True)
        for delta, grad in zip(deltas, grads, strict=True):
            delta[:, start:stop] = grad[:, start:stop]
    return deltas


# HOPE's frozen-base reads (memory/smt_frozen.py): 8-token write chunks read every C1
FROZEN = ("model.smt_chunk=8", "model.smt_mem_chunk=8", f"model.smt_read_chunk={C1}")


@pytest.mark.parametrize("knobs", [(), FROZEN], ids=["chunked", "frozen"])
@pytest.mark.usefixtures("backend")
def test_pass_a_delta_is_the_per_piece_gradient_with_coarse_smt_chunks(
    knobs: tuple[str, ...],
) -> None:
    model = coarse_model(*knobs)
    x, y = data()
    signal = teach_signal(model, x, y, model.init_state(2))
    got = [d for layer in signal.deltas for d in layer]
    want = per_piece_gradient(model, x, y)
    for delta, expected in zip(got, want, strict=True):
        torch.testing.assert_close(delta, expected, rtol=0, atol=1e-12)
    # Later pieces do reach an earlier piece through the SMT write and the conv (the
    # leak pass A cuts): the full backward of Σ CE differs on the first piece.
    outputs, losses = uncut_theta0_graph(model, x, y)
    leaky = torch.autograd.grad(losses.sum(), outputs)
    assert (leaky[0][:, :C1] - got[0][:, :C1]).abs().max() > 1e-8


@pytest.mark.parametrize("knobs", [(), FROZEN], ids=["chunked", "frozen"])
@pytest.mark.usefixtures("backend")
def test_pass_a_delta_of_a_piece_ignores_every_other_piece(knobs: tuple[str, ...]) -> None:
    """With a pending offset (the grid shifted against the SMT chunks): δ of piece
    [3, 5) does not move when targets outside it or tokens after it change."""
    model = coarse_model(*knobs)
    x, y = data(length=T + 1)
    _, state = model.forward_teach(x[:, :1], y[:, :1])  # one pending token: offset 1
    assert state.blocks[0].cms[0].pending == 1
    x, y = x[:, 1:], y[:, 1:]
    base = teach_signal(model, x, y, state).deltas
    lo, hi = 3, 5  # call tokens 3, 4: one piece of the shifted grid
    xp, yp = x.clone(), y.clone()
    yp[:, :lo] = (yp[:, :lo] + 5) % VOCAB
    yp[:, hi:] = (yp[:, hi:] + 5) % VOCAB
    xp[:, hi:] = (xp[:, hi:] + 7) % VOCAB
    moved = teach_signal(model, xp, yp, state).deltas
    for layer, layer_moved in zip(base, moved, strict=True):
        for delta, delta_moved in zip(layer, layer_moved, strict=True):
            torch.testing.assert_close(delta_moved[:, lo:hi], delta[:, lo:hi], rtol=0, atol=1e-13)
    assert (moved[0][0][:, hi:] - base[0][0][:, hi:]).abs().max() > 1e-6


def test_coarse_smt_forward_teach_is_causal_and_trains() -> None:
    model = coarse_model()
    x, y = data()
    logits, state = model.forward_teach(x, y)
    yp = y.clone()
    yp[:, 5] = (yp[:, 5] + 3) % VOCAB  # piece [4, 6): first acts on Δ in force from 6 on
    logits_p, _ = model.forward_teach(x, yp)
    torch.testing.assert_close(logits_p[:, :6], logits[:, :6], rtol=0, atol=1e-12)
    assert (logits_p[:, 6:] - logits[:, 6:]).abs().max() > 1e-6
    assert state.blocks[0].cms[0].delta_in.abs().max() > 1e-6
    model.training_loss(x, y).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    assert dead == []


@pytest.mark.parametrize("metric", ("loss", "entropy", None))
def test_head_signal_equals_autograd_of_the_summed_ce(metric: str | None) -> None:
    gate = (
        ()
        if metric is None
        else (f"model.surprise_metric={metric}", "model.surprise_threshold=0.5")
    )
    model = coarse_model(*gate)
    normed = torch.randn(2, 5, 16, dtype=F64, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    targets[1, 2] = IGNORE_INDEX  # no loss, no teach signal
    head = head_signal(model, normed, targets)
    logits = F.linear(normed, model.embed.weight)
    losses = token_ce(logits, targets)
    (want,) = torch.autograd.grad(losses.sum(), normed)
    torch.testing.assert_close(head.grad, want, rtol=0, atol=1e-12)
    assert head.grad[1, 2].abs().max() == 0
    if metric is None:  # no surprise gate: neither input is made
        assert head.token_loss is None and head.token_entropy is None
    elif metric == "loss":
        assert head.token_loss is not None and head.token_entropy is None
        torch.testing.assert_close(head.token_loss, losses.detach(), rtol=0, atol=1e-12)
    else:
        assert head.token_entropy is not None and head.token_loss is None
        torch.testing.assert_close(head.token_entropy, token_entropy(logits), rtol=0, atol=1e-12)


def test_attention_pass_a_call_keeps_values_and_cuts_other_pieces() -> None:
    torch.manual_seed(0)
    mixer = AttentionMixer(coarse_model().cfg).to(F64)
    x = torch.randn(1, 7, 16, dtype=F64, requires_grad=True)
    cache = mixer.init_state(1, torch.device("cpu"))
    _, cache = mixer(torch.randn(1, 3, 16, dtype=F64), cache, 0)  # a past, then detached
    cache = detach_state(cache)
    grid = PieceGrid(3, 1)  # call pieces: {0, 1}, {2, 3, 4}, {5, 6}
    plain, plain_cache = mixer(x, cache, 3)
    cut, cut_cache = mixer.forward_pieces(x, cache, 3, grid)
    torch.testing.assert_close(cut, plain, rtol=0, atol=1e-13)
    torch.testing.assert_close(cut_cache.k, plain_cache.k, rtol=0, atol=0)
    for t in range(7):
        (grad,) = torch.autograd.grad(cut[0, t].sum(), x, retain_graph=True)
        reached = grad[0].abs().sum(dim=-1) > 0
        want = [grid.piece_of(s) == grid.piece_of(t) and s <= t for s in range(7)]
        assert reached.tolist() == want, t

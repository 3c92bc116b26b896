"""``hope::smt_walk``: a run of the SMT's chunk steps as one operator. Its values and
gradients are those of the ``hope::smt_step`` calls it replaces (float64), it is one
launch each way, and the SMT under ``fused`` walks each checkpointed segment (and a
whole call without grad) to the torch backend's values. Its Triton kernels are
compared with these forms in Triton's interpreter (``tests/triton_worker.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from hope.bench.measure import LaunchCounter
from hope.memory import smt_fused
from hope.memory.ops import dispatch
from hope.memory.ops.smt_step import smt_step
from hope.memory.ops.smt_walk import smt_walk
from hope.memory.smt import SelfModifyingTitans
from hope.model.config import ModelConfig

DT = torch.float64


def walk_inputs(
    own: bool, adaptive: bool, chunks: int, seed: int = 1, size: int = 4
) -> tuple[Any, ...]:
    """(w1, w2, x, query, r1, r2, b_alpha [H], scale), generators: a stack of 4 (or 5,
    adaptive q) generators plus M_mem when ``own``, else M_mem apart; x [2, 3, N C, 8]."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d, m = 2, 3, 8, 12

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=DT) * scale).requires_grad_()

    g = 5 if adaptive else 4
    w1, w2 = rand(b, (g + own) * h, d, m, scale=0.3), rand(b, (g + own) * h, m, d, scale=0.5)
    x = rand(b, h, chunks * size, d)
    query = None if adaptive else rand(b, h, chunks * size, d)
    r1, r2 = (None, None) if own else (rand(b, h, d, m, scale=0.3), rand(b, h, m, d, scale=0.5))
    flags = torch.tensor([1.0] * (g - 2) + [0.0, 0.0] + [1.0] * own, dtype=DT)
    return (w1, w2, x, query, r1, r2, rand(h), flags.repeat_interleave(h)), g


def chained_steps(
    inputs: tuple[Any, ...], g: int, size: int, period: int, cut: int = 0
) -> tuple[Any, ...]:
    """The walk's outputs from one ``hope::smt_step`` per chunk, as the SMT runs them;
    ``cut``: the state detached after every ``cut`` chunks (teach pass A's pieces)."""
    w1, w2, x, query, r1, r2, bias, scale = inputs
    carried = bias.expand(x.shape[0], -1)
    pending: tuple[Any, Any] = (None, None)
    reads, out = [], ()
    for c in range(x.shape[2] // size):
        if cut and c and c % cut == 0:
            w1, w2 = w1.detach(), w2.detach()
            r1, r2 = (None, None) if r1 is None else (r1.detach(), r2.detach())
        flush = r1 is not None and c % period == period - 1
        span = slice(c * size, (c + 1) * size)
        q = None if query is None else query[:, :, span]
        out = smt_step(w1, w2, x[:, :, span], q, r1, r2, carried, scale, *pending, False, False,
                       0.3, g, flush)  # fmt: skip
        w1, w2, carried = out[0], out[1], out[11]
        reads.append(out[6])
        if r1 is not None:
            r1, r2 = out[7], out[8]
            pending = (None, None) if flush else (out[4], out[5])
    return (*out[:4], torch.cat(reads, dim=2), *out[7:11], out[11])


WALKS = [  # M_mem apart or in the stack, adaptive q, kept forward, a cut every N chunks
    (False, False, False, 0), (False, True, False, 0), (True, False, False, 0),
    (False, False, True, 0), (False, False, True, 3), (True, True, True, 2),
    (False, True, False, 3),
]  # fmt: skip


@pytest.mark.parametrize(("own", "adaptive", "keep", "cut"), WALKS)
def test_walk_equals_the_chunk_steps_it_runs(
    own: bool, adaptive: bool, keep: bool, cut: int
) -> None:
    """Outputs bit for bit and every input's gradient (all outputs probed, and the reads
    alone) equal the chained ``hope::smt_step`` calls, the state detached at each cut;
    the forward kept or rerun; one launch each way against N."""
    period = 1 if own else 3
    inputs, g = walk_inputs(own, adaptive, chunks=6)
    bias = inputs[6]
    with LaunchCounter() as forward:
        got = smt_walk(*inputs[:6], bias.expand(2, -1), inputs[7], False, False, 0.3, g, 4,
                       period, cut, keep)  # fmt: skip
    kept = [t for j, t in enumerate(got[10:]) if not (own and j in (2, 3))]  # M_mem's: none
    assert len(got) == 16 and all(t.numel() > 0 for t in kept) == keep
    with LaunchCounter() as steps:
        want = chained_steps(inputs, g, 4, period, cut)
    for x_, y_ in zip(got, want, strict=False):
        torch.testing.assert_close(x_, y_, rtol=0, atol=0)
    leaves = [t for t in inputs[:7] if t is not None]
    present = [j for j, y in enumerate(want) if y.numel()]
    gen = torch.Generator().manual_seed(5)
    probes = [torch.randn(want[j].shape, generator=gen, dtype=DT) for j in present]
    for outputs in (present, [4]):
        chosen = [probes[present.index(j)] for j in outputs]
        with LaunchCounter() as backward:
            got_grads = torch.autograd.grad([got[j] for j in outputs], leaves, chosen,
                                            retain_graph=True, allow_unused=True)  # fmt: skip
        want_grads = torch.autograd.grad([want[j] for j in outputs], leaves, chosen,
                                         retain_graph=True, allow_unused=True)  # fmt: skip
        for x_, y_, like in zip(got_grads, want_grads, leaves, strict=True):
            x_, y_ = (torch.zeros_like(like) if t is None else t for t in (x_, y_))
            torch.testing.assert_close(x_, y_, rtol=1e-12, atol=1e-14)
    # backward: the walk's, and b_alpha's gradient summed over the batch (its expand)
    assert (forward.count, backward.count) == (1, 2)
    assert steps.count >= 6


def test_walk_fakes_distinct_outputs_and_checks_its_span() -> None:
    """What compile and CUDA graphs trace: one storage per output, the kept forward's
    shapes those of the reference. A span that is not whole periods of whole chunks,
    or cuts inside a period, are refused, naming the sizes."""
    inputs, g = walk_inputs(False, False, chunks=4)
    real = [None if t is None else t.detach() for t in inputs]
    real[6] = real[6].expand(2, -1)
    kept = smt_walk(*real, False, False, 0.3, g, 4, 2, 0, True)
    with FakeTensorMode() as fake_mode:
        args = [None if t is None else fake_mode.from_tensor(t) for t in real]
        for keep in (False, True):
            traced = torch.ops.hope.smt_walk.default(*args, False, False, 0.3, g, 4, 2, 0, keep)
            storages = {StorageWeakRef(t.untyped_storage()) for t in traced}
            assert len(storages) == len(traced) == 16
    assert [t.shape for t in traced] == [t.shape for t in kept]
    assert traced[4].shape == (2, 3, 16, 8)
    with pytest.raises(ValueError, match="16 tokens are not whole periods of 3 chunks of 4"):
        smt_walk(*real, False, False, 0.3, g, 4, 3, 0, False)
    with pytest.raises(ValueError, match="a cut every 3 chunks is not after whole periods"):
        smt_walk(*real, False, False, 0.3, g, 4, 2, 3, False)


def _smt(overrides: dict[str, Any]) -> SelfModifyingTitans:
    torch.manual_seed(0)
    base = {"dim": 8, "n_heads": 2, "smt_expansion": 2, "smt_chunk": 3, "smt_mem_chunk": 6,
            "smt_eta_scale": 0.05, "smt_retention_init": 0.9, "smt_conv_window": 3}  # fmt: skip
    cfg = dataclasses.replace(ModelConfig(), **(base | overrides))
    return SelfModifyingTitans(cfg.smt_config()).to(DT)


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens of each ``smt_walk`` call the SMT makes."""
    spans: list[int] = []

    def counted(*args: Any) -> Any:
        spans.append(args[2].shape[2])
        return smt_walk(*args)

    monkeypatch.setattr(smt_fused, "smt_walk", counted)
    return spans


@pytest.mark.parametrize(
    ("overrides", "walked"),
    [({"smt_checkpoint_chunks": 4}, [12, 12]),
     ({"smt_mem_chunk": 9, "smt_checkpoint_chunks": 6}, [18]),
     ({"smt_chunk": 3, "smt_mem_chunk": 3, "smt_checkpoint_chunks": 3}, [9, 9, 6])],
    ids=["two_groups", "two_groups-not_whole_periods", "one_group"],
)  # fmt: skip
def test_fused_smt_walks_its_checkpointed_segments(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any], walked: list[int]
) -> None:
    """Each checkpointed segment of whole periods is one walk (one that is not whole
    periods is checkpointed chunk by chunk), and the output and gradients equal the
    torch backend's."""
    module = _smt(overrides)
    x = torch.randn(2, 24, 8, dtype=DT, generator=torch.Generator().manual_seed(1))
    results = []
    for backend in ("torch", "fused"):
        spans = _walks(monkeypatch)
        dispatch.set_default_backend(backend)
        try:
            leaf = x.clone().requires_grad_(True)
            y, _ = module(leaf)
            grads = torch.autograd.grad(y.pow(2).sum(), [leaf, *module.parameters()],
                                        allow_unused=True)  # fmt: skip
        finally:
            dispatch.set_default_backend("torch")
        results.append((y, grads))
        assert spans == ([] if backend == "torch" else walked)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-12)
    for g, w in zip(results[1][1], results[0][1], strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_fused_smt_walks_a_whole_call_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without grad (evaluation, generation) a call of whole periods is one walk; a call
    off the chunk grid steps chunk by chunk. The values are the torch backend's."""
    module = _smt({})
    x = torch.randn(2, 24, 8, dtype=DT, generator=torch.Generator().manual_seed(2))
    spans = _walks(monkeypatch)
    with torch.no_grad():
        want, _ = module(x)
        dispatch.set_default_backend("fused")
        try:
            got, _ = module(x)
            state = module.init_state(2)
            first, state = module(x[:, :4], state)
            rest, _ = module(x[:, 4:], state)
        finally:
            dispatch.set_default_backend("torch")
    assert spans == [24]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat((first, rest), 1), want, rtol=0, atol=1e-12)

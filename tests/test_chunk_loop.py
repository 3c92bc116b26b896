"""The shared chunk loop (memory/chunk_loop.py) on a toy memory whose gradients are known.

The toy writes m_j = 2 m_{j-1} + x_j per chunk and reads m_j, so the read of chunk j
depends on x_i with derivative 2^(j-i) while the graph is kept. The SMT and Titans
memories run the same loop (their own tests check them against their naive twins).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

from conftest import F64
from hope.memory.chunk_loop import LoopPolicy, chunk_sizes, run_chunks
from hope.memory.pieces import PieceGrid


@dataclass(frozen=True)
class Toy:
    memory: Tensor
    chunks_done: int
    live_from: int = 0
    cuts: tuple[int, ...] = ()  # the token at which each piece cut happened

    def detach_memories(self) -> Toy:
        return replace(self, memory=self.memory.detach())

    def cut_at(self, start: int) -> Toy:
        return replace(self, memory=self.memory.detach(), live_from=start, cuts=(*self.cuts, start))


class Stepper:
    """The toy step, counting its calls (a checkpointed segment reruns them)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, carry: Toy, start: int, x: Tensor) -> tuple[Toy, Tensor]:
        self.calls += 1
        # The product saves a tensor for backward in every step (so a checkpointed
        # segment reruns all its steps); its derivative is exactly 1.
        memory = 2.0 * carry.memory + x * torch.ones_like(x)
        return replace(carry, memory=memory, chunks_done=carry.chunks_done + 1), memory


def _run(policy: LoopPolicy, n: int = 5, pieces: PieceGrid | None = None, size: int = 4):
    xs = torch.arange(1.0, n + 1.0, dtype=F64).requires_grad_(True)
    stepper = Stepper()
    chunks = [(size * j, xs[j]) for j in range(n)]
    carry, reads = run_chunks(stepper, Toy(torch.zeros((), dtype=F64), 0), chunks, policy, pieces)
    return xs, carry, reads, stepper


def _jacobian(xs: Tensor, reads: list[Tensor]) -> Tensor:
    """d read_j / d x_i as [n, n] (zero where no graph joins them)."""
    rows = []
    for read in reads:
        if not read.requires_grad:
            rows.append(torch.zeros_like(xs))
            continue
        (grad,) = torch.autograd.grad(read, xs, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros_like(xs) if grad is None else grad)
    return torch.stack(rows)


def _expected(n: int, reaches: list[int]) -> Tensor:
    """2^(j-i) for every i in [reaches[j], j], else 0."""
    out = torch.zeros(n, n, dtype=F64)
    for j in range(n):
        for i in range(reaches[j], j + 1):
            out[j, i] = 2.0 ** (j - i)
    return out


@pytest.mark.parametrize(
    ("held", "new", "size", "sizes"),
    [
        (0, 10, 4, [4, 4, 2]),
        (3, 10, 4, [1, 4, 4, 1]),
        (3, 1, 4, [1]),
        (1, 2, 4, [2]),
        (0, 8, 4, [4, 4]),
        (0, 3, 1, [1, 1, 1]),
        (2, 0, 4, []),
    ],
)
def test_chunk_sizes_complete_the_pending_chunk_first(held, new, size, sizes):
    assert chunk_sizes(held, new, size) == sizes
    assert sum(sizes) == new


@pytest.mark.parametrize(
    ("write_grad", "window", "reaches"),
    [
        ("full", 2, [0, 0, 0, 0, 0]),
        ("truncated", 2, [0, 0, 2, 2, 4]),  # detached after chunks 2 and 4
        ("truncated", 3, [0, 0, 0, 3, 3]),
        ("stopgrad", 1, [0, 1, 2, 3, 4]),
    ],
)
def test_write_gradient_truncation_cuts_after_every_window(write_grad, window, reaches):
    xs, carry, reads, _ = _run(LoopPolicy(write_grad, window, 0))
    torch.testing.assert_close(_jacobian(xs, reads), _expected(5, reaches), rtol=0, atol=0)
    assert carry.chunks_done == 5
    # Values never depend on the cuts: m_j = sum_i 2^(j-i) x_i.
    torch.testing.assert_close(torch.stack(reads).detach(), _expected(5, [0] * 5) @ xs.detach())


@pytest.mark.parametrize("span", [1, 2, 5])
def test_checkpointed_segments_rerun_in_backward_with_the_same_gradients(span):
    xs, _, reads, stepper = _run(LoopPolicy("truncated", 3, span))
    assert stepper.calls == 5
    loss = sum((j + 1) * r for j, r in enumerate(reads))
    assert isinstance(loss, Tensor)
    (grad,) = torch.autograd.grad(loss, xs)
    assert stepper.calls == 10  # every segment's steps ran once more in backward
    ref_xs, _, ref_reads, ref_stepper = _run(LoopPolicy("truncated", 3, 0))
    ref_loss = sum((j + 1) * r for j, r in enumerate(ref_reads))
    assert isinstance(ref_loss, Tensor)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_xs)
    assert ref_stepper.calls == 5
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


def test_no_checkpoint_without_grad():
    with torch.no_grad():
        _, _, reads, stepper = _run(LoopPolicy("full", 1, 2))
    assert stepper.calls == 5 and not any(r.requires_grad for r in reads)


def test_pass_a_cuts_the_carry_at_each_new_piece():
    """Chunks of 4 tokens on pieces of 8 (offset 4): the chunk starting at token 4
    opens piece 1, at 12 piece 2; checkpointing is off in pass A."""
    pieces = PieceGrid(8, offset=4)
    xs, carry, reads, stepper = _run(LoopPolicy("full", 1, 2), pieces=pieces)
    assert carry.cuts == (4, 12)  # tokens 0, 8, 16 share the piece of what is held
    assert stepper.calls == 5
    # The read of chunk j reaches back to the first chunk of its piece.
    torch.testing.assert_close(_jacobian(xs, reads), _expected(5, [0, 1, 1, 3, 3]), rtol=0, atol=0)

"""The chunk loop that the sequential test-time memories share (the SMT, the Titans LMM).

A memory written once per chunk of C tokens (NL-arXiv eq. 88, Ti eqs. 16-18) runs
the same outer loop whatever its update rule: cut the call's tokens into chunks (the
first one completing the partial chunk an earlier call left pending), then step the
memory chunk by chunk from a carry (its fast weights and whatever else it holds
between chunks). Three decisions about that loop are made here, once:

- write-gradient truncation (``model.write_grad``): ``full`` keeps every write in
  the outer graph; ``truncated`` detaches the memories after every
  ``write_grad_window``-th written chunk; ``stopgrad`` after every written chunk;
- activation checkpointing of the loop (MECHANISMS §8.1): segments of
  ``checkpoint_chunks`` chunks, one carry kept per segment boundary and the
  segment's steps rerun in backward (same values and gradients);
- teach pass A's piece cuts (MECHANISMS §8.3b): before a chunk that starts in a
  later piece than the first token the carry still holds in graph, everything the
  carry holds is detached, so no gradient path crosses a piece boundary.

The memory supplies the step ``(carry, first token, chunk) -> (carry, read)``, which must leave
its input carry as it was (a checkpointed segment reruns from it), and the carry,
which knows how to detach itself. It may supply a walk too, ``(carry, chunks,
pieces, keep) -> (carry, reads) or None``: a run of chunks as one operator, cutting
at teach pass A's ``pieces`` itself (None where it cannot take those chunks: they are
stepped as above). With checkpointing each segment is a walk that keeps only its
inputs and reruns in backward (``keep`` False), teach pass A's too; otherwise the
whole call is one walk, keeping what its backward reads (with grad).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import torch
from torch import Tensor

from hope.memory.config import WriteGrad
from hope.memory.pieces import PieceGrid
from hope.memory.recompute import checkpointed


class Carry(Protocol):
    """What a memory carries from one chunk to the next."""

    @property
    def chunks_done(self) -> int:
        """Chunks written so far (truncation windows count them across calls)."""
        ...

    def detach_memories(self) -> Carry:
        """The carry with its fast weights cut from the outer graph (truncation)."""
        ...


class PieceCarry(Carry, Protocol):
    """A carry that teach pass A can cut at piece boundaries."""

    @property
    def live_from(self) -> int:
        """The first token whose contributions the carry still holds in graph."""
        ...

    def cut_at(self, start: int) -> PieceCarry:
        """Everything detached; live from token ``start``."""
        ...


C = TypeVar("C", bound=Carry)
X = TypeVar("X")
Walk = Callable[[C, Sequence[tuple[int, X]], PieceGrid | None, bool], tuple[C, Tensor] | None]


@dataclass(frozen=True)
class LoopPolicy:
    """The per-memory knobs of the loop (from ``SMTConfig`` / ``TitansMemoryConfig``)."""

    write_grad: WriteGrad
    write_grad_window: int
    checkpoint_chunks: int

    def detaches_after(self, chunks_done: int) -> bool:
        """Whether the memories leave the graph once ``chunks_done`` chunks are written."""
        if self.write_grad == "stopgrad":
            return True
        return self.write_grad == "truncated" and chunks_done % self.write_grad_window == 0


def chunk_sizes(held: int, new: int, size: int) -> list[int]:
    """How ``new`` tokens are cut when ``held`` tokens of a partial chunk are pending:
    the first chunk completes that one (one split, a cheap backward, not T/C slices),
    then whole chunks, then what is left (a partial chunk, kept pending)."""
    if new <= 0:
        return []
    first = min(size - held % size, new)
    rest = new - first
    return [first] + [size] * (rest // size) + ([rest % size] if rest % size else [])


def run_chunks(
    step: Callable[[C, int, X], tuple[C, Tensor]],
    carry: C,
    chunks: Sequence[tuple[int, X]],
    policy: LoopPolicy,
    pieces: PieceGrid | None = None,
    walk: Walk[C, X] | None = None,
) -> tuple[C, list[Tensor]]:
    """Step the memory over ``chunks`` ((first token, the chunk's inputs) each) from
    ``carry``; returns the final carry and the reads (one per chunk, or per walk).

    Checkpointed segments run only with grad enabled; pass A's chunk steps are not
    checkpointed (its piece cuts already bound what their graph holds), its walks are."""
    grad = torch.is_grad_enabled()
    span = policy.checkpoint_chunks if grad else 0
    # a walk's graph holds every write: no truncation inside one
    walks = walk is not None and (policy.write_grad == "full" or not grad)
    if walks and not span:
        walked = walk(carry, chunks, pieces, grad)  # type: ignore[misc]
        if walked is not None:
            return walked[0], [walked[1]]
    if not span or (pieces is not None and not walks):
        return _segment(step, policy, pieces, carry, chunks)
    reads: list[Tensor] = []
    for first in range(0, len(chunks), span):
        segment = chunks[first : first + span]
        walked = walk(carry, segment, pieces, False) if walks else None  # type: ignore[misc]
        if walked is not None:
            carry = walked[0]
            reads.append(walked[1])
            continue
        if pieces is not None:
            carry, out = _segment(step, policy, pieces, carry, segment)
            reads += out
            continue
        # The carry and the chunks' inputs held for the rerun are saved as inputs.
        carry, out = checkpointed(_segment, step, policy, pieces, carry, segment)
        reads += out
    return carry, reads


def _segment(
    step: Callable[[C, int, X], tuple[C, Tensor]],
    policy: LoopPolicy,
    pieces: PieceGrid | None,
    carry: C,
    chunks: Sequence[tuple[int, X]],
) -> tuple[C, list[Tensor]]:
    reads = []
    for start, inputs in chunks:
        if pieces is not None:
            held = cast(PieceCarry, carry)
            if pieces.piece_of(held.live_from) != pieces.piece_of(start):
                carry = cast(C, held.cut_at(start))
        before = carry.chunks_done
        carry, read = step(carry, start, inputs)
        if carry.chunks_done != before and policy.detaches_after(carry.chunks_done):
            carry = cast(C, carry.detach_memories())
        reads.append(read)
    return carry, reads

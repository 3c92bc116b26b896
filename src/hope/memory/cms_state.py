"""Per-sample fast state of a CMS level and the layout of one call's tokens in chunks
(``memory/cms.py``, MECHANISMS §5)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from hope.memory.fast_state import where_samples

# The version a fresh state's zero tensor had when made (``fresh_zeros``).
_ZERO_AT = "_hope_fresh_zero_at"


def fresh_zeros(*shape: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Zeros for a fresh fast state, marked so that reads can leave out their terms
    (``is_known_zero``)."""
    zeros = torch.zeros(*shape, device=device, dtype=dtype)
    setattr(zeros, _ZERO_AT, zeros._version)
    return zeros


def is_known_zero(tensor: Tensor | None) -> bool:
    """Whether ``tensor`` is absent or a ``fresh_zeros`` tensor not written since. A
    write either makes a new tensor (unmarked) or writes in place (its version moves
    on), so a marked tensor at its marked version still holds zeros. Decided on the
    host from Python attributes: no device read."""
    if tensor is None:
        return True
    marked = getattr(tensor, _ZERO_AT, None)
    return marked is not None and not tensor.is_inference() and marked == tensor._version


@dataclass
class LevelState:
    """Per-sample fast state of one CMS level (MECHANISMS §5); every tensor has leading B."""

    FAST_WEIGHTS: ClassVar[tuple[str, ...]] = ("delta_in", "delta_out")  # fast_weight_norms

    delta_in: Tensor  # [B, h, d]  fast delta of W_in
    delta_out: Tensor  # [B, d, h]  fast delta of W_out
    mom_in: Tensor | None  # [B, h, d] or None (rule without momentum)
    mom_out: Tensor | None  # [B, d, h]
    pending_inputs: Tensor  # [B, P, d]  level inputs not yet written, P < C
    pending_teach: Tensor  # [B, P, d]  their (masked) teach signals δ
    pending_scores: Tensor  # [B, P]     their per-token surprise scores
    updates: Tensor  # [B]  updates fired with the gate open (device counter, read at log time)
    boundaries: int = 0  # chunk boundaries crossed (static)

    @property
    def pending(self) -> int:
        return self.pending_inputs.shape[1]

    def carries_nothing(self) -> bool:
        """Δ and momenta are still a fresh context's zeros (``is_known_zero``), so a read
        through θ0 + Δ is a read through θ0: the Δ terms can be left out (at training
        every row starts so; a stream carries Δ after its first write)."""
        tensors = (self.delta_in, self.delta_out, self.mom_in, self.mom_out)
        return all(is_known_zero(t) for t in tensors)

    def reset_where(self, fresh: LevelState, reset_mask: Tensor) -> LevelState:
        """Per-sample reset to ``fresh`` (Δ, momenta, counters). The chunk phase is
        batch-wide, so a reset sample keeps the pending length with its pending tokens
        zeroed: they add nothing to its next write."""

        def take(old: Tensor | None, new: Tensor | None) -> Tensor | None:
            return None if old is None or new is None else where_samples(reset_mask, new, old)

        def clear(old: Tensor) -> Tensor:
            return where_samples(reset_mask, torch.zeros_like(old), old)

        return replace(
            self,
            delta_in=where_samples(reset_mask, fresh.delta_in, self.delta_in),
            delta_out=where_samples(reset_mask, fresh.delta_out, self.delta_out),
            mom_in=take(self.mom_in, fresh.mom_in),
            mom_out=take(self.mom_out, fresh.mom_out),
            pending_inputs=clear(self.pending_inputs),
            pending_teach=clear(self.pending_teach),
            pending_scores=clear(self.pending_scores),
            updates=where_samples(reset_mask, fresh.updates, self.updates),
        )


@dataclass
class ChunkLayout:
    """A call's tokens laid out as [pending prefix | new tokens | pad] in chunks of C."""

    inputs: Tensor  # [B, n, C, d]  level inputs a (detached, teach dtype)
    teach: Tensor  # [B, n, C, d]  masked δ
    gates: Tensor | None  # [B, n_fire] surprise gates, None when the gate is off
    n_fire: int  # chunks written in this call (the first n_fire of the n)
    offset: int  # pending tokens before the first new token
    pending_inputs: Tensor  # what stays buffered after the call
    pending_teach: Tensor
    pending_scores: Tensor


@dataclass
class ChunkDeltas:
    """Deltas in force per chunk of a call laid out as [pending prefix | new tokens | pad]."""

    delta_in: Tensor  # [B, n, h, d]
    delta_out: Tensor  # [B, n, d, h]
    offset: int  # pending tokens before the first new token (chunk 0 starts with them)
    chunk: int  # C

"""Oracle twins of the CMS writes (tests, float64): chunk by chunk, read with the
current Δ, then write that chunk's δ, exactly as NL eq. 31 reads online.

``naive_online_level`` twins ``CMSLevel.teach_forward``; ``naive_online_chain`` twins
``CMS.teach_forward`` (and is what ``cms_mode=exact_online`` computes per layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hope.memory.cms import CMSLevel
from hope.memory.cms_chain import CMS
from hope.memory.cms_state import LevelState


def _slice_opt(value: Tensor | None, start: int, stop: int) -> Tensor | None:
    return None if value is None else value[:, start:stop]


def naive_online_level(
    level: CMSLevel,
    x_norm: Tensor,
    teach: Tensor,
    state: LevelState,
    *,
    token_loss: Tensor | None = None,
    token_entropy: Tensor | None = None,
) -> tuple[Tensor, LevelState]:
    """Oracle twin of ``teach_forward`` (exact_online): per chunk, read with the current Δ,
    then write that chunk's tokens (one update at most per segment)."""
    length, outputs, start = x_norm.shape[1], [], 0
    while start < length:
        stop = min(length, start + level.period - state.pending)
        seg = slice(start, stop)
        outputs.append(level(x_norm[:, seg], state))
        state = level.write(
            x_norm[:, seg],
            teach[:, seg],
            state,
            token_loss=_slice_opt(token_loss, start, stop),
            token_entropy=_slice_opt(token_entropy, start, stop),
        )
        start = stop
    return torch.cat(outputs, dim=1), state


def naive_online_chain(
    cms: CMS,
    x: Tensor,
    teaches: Sequence[Tensor],
    state: list[LevelState],
) -> tuple[Tensor, list[LevelState]]:
    """Oracle twin of ``CMS.teach_forward``: loop over chunks of the shortest period
    (every boundary of every level falls on that grid), read all levels, then write."""
    length, outputs, start = x.shape[1], [], 0
    first: int = cms.levels[0].period  # type: ignore[assignment]
    while start < length:
        stop = min(length, start + first - state[0].pending)
        x_seg, taps = cms.read(x[:, start:stop], state)
        seg_teach = [t[:, start:stop] for t in teaches]
        state = cms.write(taps, seg_teach, state)
        outputs.append(x_seg)
        start = stop
    return torch.cat(outputs, dim=1), state

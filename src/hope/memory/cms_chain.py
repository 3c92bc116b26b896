"""The CMS chain (NL eq. 30): x ← x + MLP_ℓ(N_ℓ(x)) over the levels ℓ = 1..k, each a
``CMSLevel`` (``memory/cms.py``) with its own period; or the levels side by side on one
input (``layout="independent"``). The MLP budget Σ h_ℓ = mlp_ratio·d is split evenly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hope.memory.cms import CMSLevel, Layout
from hope.memory.cms_state import LevelState
from hope.memory.config import CMSConfig
from hope.memory.norm import RMSNorm
from hope.optim.inner import InnerRule, make_inner_rule


def split_hidden(total: int, levels: int) -> list[int]:
    """Split the MLP budget Σ h_ℓ = total as evenly as possible (MECHANISMS §1)."""
    if levels < 1 or total < levels:
        raise ValueError(f"cannot split an MLP budget of {total} over {levels} CMS levels")
    base, extra = divmod(total, levels)
    return [base + (1 if i < extra else 0) for i in range(levels)]


@dataclass
class LevelTap:
    """What pass A hands the model for one level: its input and (in-graph) output."""

    inputs: Tensor  # a = N_ℓ(x) [B, T, d]
    output: Tensor  # y = MLP_ℓ(a) [B, T, d]; autograd.grad(loss, output) gives δ_ℓ


class CMS(nn.Module):
    """The chain x ← x + MLP_ℓ(N_ℓ(x)), ℓ = 1..k (NL eq. 30, pre-norm residual), or the
    same levels side by side on one input (``layout="independent"``)."""

    def __init__(
        self,
        dim: int,
        hiddens: Sequence[int],
        periods: Sequence[int],
        rule: InnerRule,
        *,
        norm_eps: float = 1e-6,
        layout: Layout = "chain",
        **level_kwargs: object,
    ) -> None:
        super().__init__()
        if layout not in ("chain", "independent"):
            raise ValueError(f"CMS: layout must be chain|independent, got {layout!r}")
        # chain: x <- x + MLP_l(N_l(x)) in turn (eq. 30); independent: every level reads
        # the block input, y = x + sum_l MLP_l(N_l(x)) (the levels in parallel, summed).
        self.layout = layout
        periods = list(periods)
        if not periods or len(periods) != len(hiddens):
            raise ValueError(
                f"cms_periods {periods} must be non-empty and match {len(hiddens)} levels"
            )
        if any(p % periods[0] for p in periods) or sorted(periods) != periods:
            raise ValueError(
                f"cms_periods {periods} must increase and each be a multiple of the first"
            )
        self.norms = nn.ModuleList(RMSNorm(dim, norm_eps) for _ in periods)
        self.levels = nn.ModuleList(
            CMSLevel(dim, h, p, rule, **level_kwargs)  # type: ignore[arg-type]
            for h, p in zip(hiddens, periods, strict=True)
        )

    @classmethod
    def from_config(cls, cfg: CMSConfig) -> CMS:
        rule = make_inner_rule(
            cfg.rule, cfg.lr, cfg.retention, cfg.momentum, cfg.erase, cfg.momentum_width
        )
        return cls(
            cfg.dim,
            split_hidden(cfg.hidden, len(cfg.periods)),
            cfg.periods,
            rule,
            norm_eps=cfg.norm_eps,
            surprise_threshold=cfg.surprise_threshold,
            surprise_metric=cfg.surprise_metric,
            init_std=cfg.init_std,
            adaptive_lr=cfg.adaptive_lr,
            layout=cfg.layout,
            read_block=cfg.read_block,
        )

    def init_state(
        self, batch_size: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> list[LevelState]:
        return [lvl.init_state(batch_size, device, dtype) for lvl in self.levels]  # type: ignore[operator]

    def read(
        self, x: Tensor, state: list[LevelState] | None = None
    ) -> tuple[Tensor, list[LevelTap]]:
        """Pass A / one exact_online chunk: read with each level's current Δ (θ0 if no state)."""
        taps, block_input = [], x
        for i, (norm, level) in enumerate(zip(self.norms, self.levels, strict=True)):
            inputs = norm(self._level_input(x, block_input))
            output = level(inputs, None if state is None else state[i])
            taps.append(LevelTap(inputs, output))
            x = x + output
        return x, taps

    def _level_input(self, x: Tensor, block_input: Tensor) -> Tensor:
        """What level ℓ reads: the running sum (chain) or the block input (independent)."""
        return block_input if self.layout == "independent" else x

    def write(
        self,
        taps: Sequence[LevelTap],
        teaches: Sequence[Tensor],
        state: list[LevelState],
        **kwargs: object,
    ) -> list[LevelState]:
        """exact_online: write each level's chunk (inputs from ``read``, δ_ℓ from the model)."""
        return [
            lvl.write(tap.inputs, dlt, st, **kwargs)  # type: ignore[operator]
            for lvl, tap, dlt, st in zip(self.levels, taps, teaches, state, strict=True)
        ]

    def teach_forward(
        self, x: Tensor, teaches: Sequence[Tensor], state: list[LevelState], **kwargs: object
    ) -> tuple[Tensor, list[LevelState]]:
        """Pass B of teach_pass: level ℓ reads with θ0 + sg(Δ_n) built from its pass-B
        inputs and δ_ℓ of pass A (MECHANISMS §8.3b)."""
        new_state, block_input = [], x
        for norm, level, teach, st in zip(self.norms, self.levels, teaches, state, strict=True):
            inputs = norm(self._level_input(x, block_input))
            out, st = level.teach_forward(inputs, teach, st, **kwargs)  # type: ignore[operator]
            x = x + out
            new_state.append(st)
        return x, new_state

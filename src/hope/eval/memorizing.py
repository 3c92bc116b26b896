"""Test-time memorisation in the evaluators: the ``memorize`` section, read once.

Every evaluator that memorises (zero-shot, NIAH and long-context when their
``memorize`` switch is on; continual always) builds its hope.model.memorize
configuration here, so a bad ``memorize.*`` value is named the same way everywhere,
and reports its adaptive numbers beside the plain ones with ``side_by_side``:
``adaptive_<metric>`` and ``delta_<metric>`` = adaptive - plain.

What "a sample" is, per evaluator (``memorize.reset``; null = the evaluator's own):

- zeroshot: one lm-eval document (reset) / the task's documents in order (carry);
- niah: one prompt (reset) / the trials of a cell in order (carry);
- longctx: one long sequence (reset; carry is refused: sequences are read in parallel);
- continual: one segment (reset: each written into a fresh state, the no-interference
  control) / the ordered segments (carry, the protocol's own default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from hope.config import MemorizeParams
from hope.errors import ConfigError
from hope.model.lm import LanguageModel
from hope.model.memorize import MemorizeConfig

Reset = Literal["reset_per_sample", "carry_across_samples"]


def memorize_config(
    params: MemorizeParams,
    evaluator: str,
    own_reset: Reset,
    model: LanguageModel | None = None,
    online_chunk_size: int | None = None,
) -> MemorizeConfig:
    """The evaluator's MemorizeConfig from the ``memorize`` section; a ConfigError
    naming the key when it cannot hold for this evaluator or model."""
    if model is not None:
        n_layers = model.cfg.n_layers
        bad = [layer for layer in params.layers or [] if layer >= n_layers]
        if bad:
            raise ConfigError(
                f"memorize.layers: {bad[0]} is not a block of this {n_layers}-layer model"
            )
    if params.use_correct_answer and evaluator != "zeroshot":
        raise ConfigError(
            f"memorize.use_correct_answer: only zero-shot documents have answers; "
            f"{evaluator} has none (set it to false)"
        )
    try:
        return MemorizeConfig(
            paths=None if params.paths is None else tuple(params.paths),
            layers=None if params.layers is None else tuple(params.layers),
            surprise_threshold=params.surprise_threshold,
            online_chunk_size=online_chunk_size,
            steps=params.steps,
            reset=params.reset or own_reset,
        )
    except ValueError as err:
        raise ConfigError(f"memorize: {err}") from None


def side_by_side(plain: Mapping[str, Any], adaptive: Mapping[str, Any]) -> dict[str, Any]:
    """``plain`` with every number of ``adaptive`` beside it as ``adaptive_<key>`` and
    the difference as ``delta_<key>`` (null when either side is null). Counts and
    stderrs keep only their adaptive value."""
    row = dict(plain)
    for key, value in adaptive.items():
        row[f"adaptive_{key}"] = value
        base = plain.get(key)
        if key == "n" or key.endswith("_stderr"):
            continue
        if isinstance(value, int | float) and isinstance(base, int | float):
            row[f"delta_{key}"] = value - base
        elif value is None or base is None:
            row[f"delta_{key}"] = None
    return row

"""The bench's fixed shapes (``bench.shapes``; :mod:`hope.bench.run`).

- ``tiny``: the resolved ``model`` section (the preset's shape) at ``data.seq_len``
  and ``bench.batch_size``;
- ``smoke``: the predecessor's smoke shape (docs/ANCHORS.md "Speed"): dim 128,
  2 layers, 4 heads, vocab 32,000, seq 64, batch 4, CMS periods 1/4/16, Titans
  level period 8: both SMT chunks and the Titans chunk are 8 (the predecessor
  updates its Titans level every 8 tokens), the CMS periods are kept exactly.
- ``pilot_chunks``: the pilot preset's chunking and head size (CMS periods
  16/64/256, SMT chunks 8/16, expansion 4, Titans chunk 64 and window 1024, head
  dim 64) in one layer of dim 128 at T = 1024, batch 1: the launches a paper-scale
  step pays per layer, at a size a CPU measures in seconds. Its CMS levels read in
  the form the pilot's widths choose at this context (the dual read for all three;
  dim 128 alone would choose the materialised read for the two slow levels, a
  different launch count than the pilot pays).
- ``pilot_frozen``: ``pilot_chunks`` with HOPE's throughput mode (SMT write chunks of
  64 tokens, M_mem read every 16 inside them; ``memory/smt_frozen.py``).
- ``pilot``: the pilot preset's dims and chunking (dim 1024, 16 heads, vocab
  32,000) in two layers at T = 4096, batch 4: a GPU shape (scripts/gpu_check.sh).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from hope.config import Config, load_config
from hope.errors import ConfigError
from hope.memory.cms import CMSLevel, level_read_block, prefers_dual_read
from hope.memory.cms_chain import CMS, split_hidden
from hope.model.config import ModelConfig

SMOKE_MODEL: dict[str, Any] = {
    "dim": 128,
    "n_layers": 2,
    "n_heads": 4,
    "vocab_size": 32_000,
    "cms_periods": [1, 4, 16],
    "smt_chunk": 8,
    "smt_mem_chunk": 8,
    "titans_chunk": 8,
}
SMOKE_SEQ_LEN = 64
SMOKE_BATCH = 4
PILOT_CHUNKS_MODEL: dict[str, Any] = {
    "dim": 128,
    "n_layers": 1,
    "n_heads": 2,
    "cms_periods": [16, 64, 256],
    "smt_chunk": 8,
    "smt_mem_chunk": 16,
    "smt_expansion": 4,
    "titans_chunk": 64,
    "titans_expansion": 4,
    "titans_window": 1024,
}
PILOT_CHUNKS_SEQ_LEN = 1024
# HOPE's throughput mode at that shape (memory/smt_frozen.py): the SMT written every
# 64 tokens, M_mem read every 16 (the pilot's C_m) inside each write; other variants
# are the same models as at pilot_chunks, measured again for the ratios.
FROZEN_SMT: dict[str, Any] = {"smt_chunk": 64, "smt_mem_chunk": 64, "smt_read_chunk": 16}
PILOT_FROZEN_MODEL: dict[str, Any] = {**PILOT_CHUNKS_MODEL, **FROZEN_SMT}
# The pilot preset's dims and chunking in two layers at its context (a GPU shape:
# scripts/gpu_check.sh; far too slow for a CPU).
PILOT_MODEL: dict[str, Any] = {
    **PILOT_CHUNKS_MODEL,
    "dim": 1024,
    "n_layers": 2,
    "n_heads": 16,
    "vocab_size": 32_000,
}
PILOT_SEQ_LEN = 4096
PILOT_BATCH = 4
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "vocab_size")


@dataclass(frozen=True)
class Shape:
    name: str
    model: ModelConfig  # its ``variant`` is replaced per measurement
    seq_len: int
    batch_size: int
    cms_read_forms: tuple[str, ...] | None = None  # None: what the widths choose

    def record(self) -> dict[str, Any]:
        """The exact shape, for the report: model knobs that define it plus seq and batch."""
        keys = {
            "smoke": SMOKE_MODEL,
            "pilot_chunks": PILOT_CHUNKS_MODEL,
            "pilot_frozen": PILOT_FROZEN_MODEL,
            "pilot": PILOT_MODEL,
        }
        keys = keys.get(self.name, {})
        model = {k: getattr(self.model, k) for k in (*keys, *SHAPE_KEYS)}
        record = {**model, "seq_len": self.seq_len, "batch_size": self.batch_size}
        if self.cms_read_forms is not None:
            record["cms_read_forms"] = list(self.cms_read_forms)
        return record


def preset_read_forms(cfg: ModelConfig, seq_len: int) -> list[str]:
    """Per CMS level, the read form a model of ``cfg``'s widths chooses at ``seq_len``
    (``prefers_dual_read``: the choice depends on the widths, the launches on it), for
    a whole block of ``cms_read_block`` tokens when the context holds more."""
    hiddens = split_hidden(int(round(cfg.mlp_ratio * cfg.dim)), len(cfg.cms_periods))
    forms = []
    for period, hidden in zip(cfg.cms_periods, hiddens, strict=True):
        block = level_read_block(cfg.cms_read_block, period)
        length = min(seq_len, block) if block else seq_len
        dual = prefers_dual_read(period, length // period, hidden, cfg.dim)
        forms.append("dual" if dual else "materialized")
    return forms


def read_blocks_within(cfg: ModelConfig, seq_len: int) -> list[int]:
    """The CMS levels' dual-read blocks shorter than ``seq_len`` (a context of several
    blocks)."""
    blocks = (level_read_block(cfg.cms_read_block, period) for period in cfg.cms_periods)
    return [block for block in blocks if 0 < block < seq_len]


def apply_read_forms(model: nn.Module, forms: Sequence[str]) -> None:
    """Give every CMS level of ``model`` whose rule has both forms the read form of its
    position in ``forms``."""
    for module in model.modules():
        if isinstance(module, CMS):
            for level, form in zip(module.levels, forms, strict=True):
                assert isinstance(level, CMSLevel)
                if level.rule.linear and not level.adaptive_lr:
                    level.read_form = form  # type: ignore[assignment]


def bench_shape(cfg: Config, name: str) -> Shape:
    if name == "tiny":
        return Shape(name, cfg.model, cfg.data.seq_len, cfg.bench.batch_size)
    if name == "smoke":
        model = dataclasses.replace(cfg.model, **SMOKE_MODEL)
        return Shape(name, model, SMOKE_SEQ_LEN, SMOKE_BATCH)
    if name in ("pilot_chunks", "pilot_frozen"):
        chunking = PILOT_CHUNKS_MODEL if name == "pilot_chunks" else PILOT_FROZEN_MODEL
        model = dataclasses.replace(cfg.model, **chunking)
        # The CMS reads as the pilot's widths make it read at this context.
        widths = dataclasses.replace(model, dim=PILOT_MODEL["dim"])
        forms = preset_read_forms(widths, PILOT_CHUNKS_SEQ_LEN)
        return Shape(name, model, PILOT_CHUNKS_SEQ_LEN, 1, tuple(forms))
    if name == "pilot":
        # The pilot preset's CMS inner rate too: the run's own (tiny) rate diverges at
        # this width (configs/presets/pilot.yaml), which the step's values would show.
        pilot_rate = load_config(None, ["preset=pilot"]).model.cms_lr
        model = dataclasses.replace(cfg.model, **PILOT_MODEL, cms_lr=pilot_rate)
        return Shape(name, model, PILOT_SEQ_LEN, PILOT_BATCH)
    raise ConfigError(
        f"bench.shapes: unknown shape {name!r} (tiny, smoke, pilot_chunks, pilot_frozen, pilot)"
    )

"""The executed-work term of the FLOP estimate (``hope.bench.flops``) against torch's
FLOP counter, on the meta device (shapes only, no arithmetic)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hope.bench import flops
from hope.bench.shapes import preset_read_forms
from hope.model.config import ModelConfig
from hope.model.zoo import build_model

# A HOPE layer whose fast CMS level reads in the dual form and whose slow level in the
# materialised one at every length below (h·d = 8·32: n_fire·2² <= 256 < n_fire·16²),
# each in one block.
CFG = ModelConfig(
    variant="hope", dim=32, n_heads=2, n_layers=1, vocab_size=64, mlp_ratio=0.5,
    cms_periods=[2, 16], smt_chunk=4, smt_mem_chunk=4, cms_read_block=0,
)  # fmt: skip
LENGTHS = (32, 64, 96)


def counted_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Matmul FLOPs of one training step's forward and backward, one row."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(cfg)
    model.train()
    tokens = torch.zeros(1, seq_len + 1, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        model.training_loss(tokens[:, :-1], tokens[:, 1:]).backward()
    return counter.get_total_flops()


def second_difference(values: list[float]) -> float:
    """f(3s) - 2 f(2s) + f(s): zero for every term of f that is affine in T."""
    return values[2] - 2 * values[1] + values[0]


@pytest.mark.parametrize("mode", ["teach_pass", "exact_online"])
def test_dual_read_term_is_the_counted_growth_with_the_context(mode: str) -> None:
    """Everything in a HOPE step but the CMS dual read is affine in the context (chunk
    loops, per-token matmuls; the materialised read included), so the counted step's
    second difference over T, 2T, 3T is the dual read's alone: it equals the
    formula's, to the FLOP. exact_online has no dual read: both are zero."""
    cfg = dataclasses.replace(CFG, cms_mode=mode)  # type: ignore[arg-type]
    for length in LENGTHS:
        assert preset_read_forms(cfg, length) == ["dual", "materialized"]
    counted = [float(counted_flops(cfg, length)) for length in LENGTHS]
    formula = [flops.cms_dual_read_flops(cfg, length) * length for length in LENGTHS]
    assert second_difference(counted) == pytest.approx(second_difference(formula), rel=1e-12)
    if mode == "teach_pass":
        assert formula[2] > 0.05 * counted[2]  # a term worth counting
    else:
        assert second_difference(counted) == 0 and formula == [0.0, 0.0, 0.0]


RULES = [{"cms_rule": "gd"}, {"cms_rule": "momentum", "cms_momentum": 0.5}]


@pytest.mark.parametrize("rule", RULES)
def test_blocked_dual_read_term_is_the_counted_difference(rule: dict[str, object]) -> None:
    """``cms_read_block``: the counted step with the dual read in blocks of 8 tokens
    differs from the one-block step by exactly the formula's difference (the blocks'
    smaller score matrices, and the carried Δ and momentum read after the first)."""
    cfg = dataclasses.replace(CFG, cms_periods=[2, 4], **rule)  # type: ignore[arg-type]
    blocked = dataclasses.replace(cfg, cms_read_block=8)
    assert preset_read_forms(cfg, 64) == preset_read_forms(blocked, 8) == ["dual", "dual"]
    counted = counted_flops(blocked, 64) - counted_flops(cfg, 64)
    formula = flops.cms_dual_read_flops(blocked, 64) - flops.cms_dual_read_flops(cfg, 64)
    assert counted == pytest.approx(64 * formula, rel=1e-12)
    assert counted < 0


def test_executed_flops_add_what_checkpointing_reruns() -> None:
    """Checkpointed SMT segments rerun the SMT's forward once; checkpointed blocks rerun
    every block's forward, both teach passes' for HOPE; both at once add both. A
    checkpointed Titans memory reruns its forward; the useful count never changes."""
    cfg = dataclasses.replace(CFG, n_layers=3)
    base = flops.executed_training_flops_per_token(cfg, 64)
    layer, smt = flops.layer_forward_flops(cfg, 64)
    runs = {
        "segments": (dataclasses.replace(cfg, smt_checkpoint_chunks=4), 3 * smt),
        "blocks": (dataclasses.replace(cfg, checkpoint_blocks=True), 3 * 2 * layer),
        "both": (dataclasses.replace(cfg, checkpoint_blocks=True, smt_checkpoint_chunks=4),
                 3 * 2 * layer + 3 * smt),
    }  # fmt: skip
    for name, (checkpointed, rerun) in runs.items():
        assert flops.executed_training_flops_per_token(checkpointed, 64) == pytest.approx(
            base + rerun
        ), name
        assert flops.training_flops_per_token(checkpointed, 64) == (
            flops.training_flops_per_token(cfg, 64)
        )
    titans = dataclasses.replace(cfg, variant="titans_lmm")
    _, memory = flops.layer_forward_flops(titans, 64)
    rerun = dataclasses.replace(titans, titans_checkpoint_chunks=2)
    assert flops.executed_training_flops_per_token(rerun, 64) == pytest.approx(
        flops.executed_training_flops_per_token(titans, 64) + 3 * memory
    )
    assert smt > 0 and memory > 0


def test_executed_flops_add_the_dual_read_per_layer() -> None:
    cfg = dataclasses.replace(CFG, n_layers=3)
    useful = flops.training_flops_per_token(cfg, 64)
    executed = flops.executed_training_flops_per_token(cfg, 64)
    assert executed == pytest.approx(useful + 3 * flops.cms_dual_read_flops(cfg, 64))
    transformer = dataclasses.replace(cfg, variant="transformer")
    assert flops.executed_training_flops_per_token(transformer, 64) == (
        flops.training_flops_per_token(transformer, 64)
    )


def test_recurrent_flops_are_the_memory_recurrence_in_every_pass_that_runs_it() -> None:
    """The share the fused backend runs in one program per (sample, head): the SMT's
    80u (u = e·d²/H) or the Titans memory's 14u (MAC: 18u, its retrieval read too),
    times forward + backward (3), backprop through the writes (+0.9 unless
    stopgrad), teach pass A (+2 for HOPE) and checkpointing's reruns; none for the
    variants without a memory recurrence. Always within the executed work."""
    cfg = dataclasses.replace(CFG, n_layers=3)
    unit = cfg.smt_expansion * cfg.dim**2 / cfg.n_heads
    assert flops.recurrent_forward_flops(cfg) == 80 * unit
    per_token = flops.recurrent_training_flops_per_token
    assert per_token(cfg, 64) == pytest.approx(3 * 80 * unit * (3 + 0.9 + 2))
    stopgrad = dataclasses.replace(cfg, write_grad="stopgrad")
    assert per_token(stopgrad, 64) == pytest.approx(3 * 80 * unit * (3 + 2))
    segments = dataclasses.replace(cfg, smt_checkpoint_chunks=4)
    assert per_token(segments, 64) == pytest.approx(per_token(cfg, 64) + 3 * 80 * unit)
    blocks = dataclasses.replace(cfg, checkpoint_blocks=True)
    assert per_token(blocks, 64) == pytest.approx(per_token(cfg, 64) + 2 * 3 * 80 * unit)
    titans_unit = cfg.titans_expansion * cfg.dim**2 / cfg.n_heads
    for variant, reads in (("titans_lmm", 14), ("titans_mac", 18)):
        titans = dataclasses.replace(cfg, variant=variant)
        assert per_token(titans, 64) == pytest.approx(3 * reads * titans_unit * (3 + 0.9))
    for variant in ("transformer", "hope_attention"):
        assert per_token(dataclasses.replace(cfg, variant=variant), 64) == 0.0
    for variant in ("hope", "titans_mac", "titans_mal"):
        for checkpointed in (False, True):
            run = dataclasses.replace(cfg, variant=variant, checkpoint_blocks=checkpointed)
            assert 0 < per_token(run, 64) < flops.executed_training_flops_per_token(run, 64)

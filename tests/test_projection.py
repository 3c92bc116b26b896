"""The GPU projection of the bench (hope.bench.projection): exact launch model,
read forms of the preset widths, and the step-time arithmetic."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hope.bench import flops
from hope.bench import projection as p
from hope.bench import run as bench_run
from hope.bench.measure import LaunchCounter
from hope.bench.shapes import preset_read_forms
from hope.config import OptimConfig, load_config
from hope.memory.ops import dispatch
from hope.model.config import ModelConfig
from hope.model.zoo import build_model
from hope.optim.outer import build_optimizer
from hope.train.step import train_step

ROOT = Path(__file__).resolve().parents[1]
# Small chunking: periods 4/8, SMT chunks 2/4, Titans chunk 4 (counting lengths 16, 32).
SMALL_CHUNKS = {
    "cms_periods": [4, 8], "smt_chunk": 2, "smt_mem_chunk": 4, "titans_chunk": 4,
    "titans_window": 8, "n_heads": 2, "vocab_size": 64,
}  # fmt: skip


FROZEN = {"smt_chunk": 4, "smt_mem_chunk": 4, "smt_read_chunk": 2}


@pytest.mark.parametrize(
    ("variant", "frozen"),
    [("hope", False), ("hope", True), ("titans_mac", False), ("transformer", False)],
)
def test_launch_fit_predicts_a_direct_count_at_another_depth_and_length(
    variant: str, frozen: bool
) -> None:
    """Four counts (1-2 layers x T1, 2·T1) fix the affine model; it predicts a direct
    count of three layers at a third length exactly (hope's first layer is cheaper:
    pass A reuses its mixer), with HOPE's frozen-base reads too."""
    chunks = {**SMALL_CHUNKS, **(FROZEN if frozen else {})}
    cfg = ModelConfig(variant=variant, **chunks)  # type: ignore[arg-type]
    assert p.counting_lengths(cfg) == (16, 32)
    fit = p.fit_launches(cfg, 40)
    forms = preset_read_forms(cfg, 40)
    assert fit.predict(3, 40) == p.count_step_launches(cfg, 40, 3, forms)
    if variant != "transformer":
        assert fit.layer_per_token > 0  # the chunk loops launch per chunk
    else:
        assert fit.layer_per_token == 0 and fit.base_per_token == 0


@pytest.mark.parametrize("variant", ["transformer", "hope"])
def test_a_count_is_of_a_steady_step_not_the_first(variant: str) -> None:
    """The counted step launches what the third step of a training run does: not the
    optimizer's first-step state (AdamW's moments, one ``zeros_like`` each), which
    the first step pays once."""
    cfg = ModelConfig(variant=variant, **SMALL_CHUNKS)  # type: ignore[arg-type]
    forms = preset_read_forms(cfg, 16)
    narrow = dataclasses.replace(cfg, dim=p.COUNT_WIDTH_PER_HEAD * cfg.n_heads, n_layers=1)
    torch.manual_seed(0)
    model = build_model(narrow)
    model.train()
    optimizer = build_optimizer(model, OptimConfig())
    tokens = torch.randint(0, 64, (1, 17))
    counts = []
    for _ in range(3):
        with LaunchCounter() as counter:
            train_step(model, optimizer, None, tokens[:, :-1], tokens[:, 1:], 1.0, None)
        counts.append(counter.count)
    params = sum(1 for _ in model.parameters())
    assert counts[0] - counts[1] >= 2 * params and counts[1] == counts[2]
    assert p.count_step_launches(cfg, 16, 1, forms) == counts[2]


def test_counts_are_made_once_per_narrow_model_context_forms_and_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Presets whose narrow counting models coincide (mid and target: same chunking and
    heads, other widths) share a count; another dim of the same preset, another read
    form or another memory backend is counted anew."""
    made: list[int] = []
    monkeypatch.setattr(p, "_COUNTS", {})
    monkeypatch.setattr(p, "_count", lambda narrow, length, forms: made.append(length) or 7)
    cfg = ModelConfig(variant="hope", **SMALL_CHUNKS)  # type: ignore[arg-type]
    wider = dataclasses.replace(cfg, dim=4 * cfg.dim)  # narrowed to the same counting model
    forms = ["dual", "materialized"]
    assert p.count_step_launches(cfg, 16, 1, forms) == 7
    assert p.count_step_launches(wider, 16, 1, forms) == 7 and made == [16]
    p.count_step_launches(cfg, 16, 1, ["dual", "dual"])
    p.count_step_launches(cfg, 16, 2, forms)
    monkeypatch.setattr("hope.memory.ops.dispatch._default_backend", "compile")
    p.count_step_launches(cfg, 16, 1, forms)
    assert made == [16, 16, 16, 16]


def test_read_forms_are_the_ones_the_preset_widths_choose() -> None:
    """n_fire·C² <= h·d per read block (1,024 tokens) of the preset's context: every
    level of every preset reads in the dual form; in one block of 4,096 tokens mid's
    1024-token level (h = d = 1536) would be materialised, and target's sits on the
    boundary (4·1024² = 2048·2048) and reads dual."""
    assert preset_read_forms(p.preset_model("pilot", "hope"), 4096) == ["dual"] * 3
    assert preset_read_forms(p.preset_model("mid", "hope"), 4096) == ["dual"] * 4
    assert preset_read_forms(p.preset_model("target", "hope"), 4096) == ["dual"] * 4
    one_block = dataclasses.replace(p.preset_model("mid", "hope"), cms_read_block=0)
    assert preset_read_forms(one_block, 4096) == ["dual"] * 3 + ["materialized"]
    target = dataclasses.replace(p.preset_model("target", "hope"), cms_read_block=0)
    assert preset_read_forms(target, 4096) == ["dual"] * 4


def test_launch_fit_counts_whole_read_blocks() -> None:
    """A context of several CMS read blocks: the counts are made at whole blocks (the
    first block, with nothing carried, launches fewer), and the fit predicts a direct
    count at five blocks exactly."""
    cfg = ModelConfig(variant="hope_attention", cms_read_block=8, **SMALL_CHUNKS)  # type: ignore[arg-type]
    assert p.counting_lengths(cfg, 40) == (16, 32) and p.counting_lengths(cfg, 8) == (16, 32)
    wide_block = dataclasses.replace(cfg, cms_read_block=24)
    assert p.counting_lengths(wide_block, 48) == (24, 48)
    fit = p.fit_launches(cfg, 40)
    forms = preset_read_forms(cfg, 40)
    assert fit.predict(2, 40) == p.count_step_launches(cfg, 40, 2, forms)
    unblocked = p.fit_launches(dataclasses.replace(cfg, cms_read_block=0), 40)
    assert fit.layer_per_token > unblocked.layer_per_token  # a block's launches


def test_step_projection_arithmetic() -> None:
    cfg = p.preset_model("pilot", "transformer")
    row = p.project_step(cfg, 4096, 8, launches=1000, params=10**8)
    tokens = 8 * 4096
    step_flops = 6 * (10 * (8 * 1024**2 + 4 * 1024 * 2048 + 6 * 1024 * 2752)) * tokens / 2
    assert row["tokens"] == tokens and row["launches"] == 1000
    assert row["flops"] > 0 and row["bytes"] == 36 * 10**8 + 68 * 1024 * 10 * tokens
    h200 = row["devices"]["H200"]
    floor = max(row["flops"] / (989e12 * 0.4), row["bytes"] / 4.8e12)
    assert h200["floor_ms"] == pytest.approx(floor * 1e3)
    assert h200["eager_ms"] == pytest.approx((floor + 1000 * p.EAGER_LAUNCH_S) * 1e3)
    assert h200["graph_ms"] == pytest.approx((floor + 1000 * p.GRAPH_LAUNCH_S) * 1e3)
    assert h200["mfu_eager"] == pytest.approx(row["flops"] / (h200["eager_ms"] / 1e3 * 989e12))
    assert h200["mfu_eager"] < h200["mfu_graph"] <= p.ACHIEVABLE
    # A100: same FLOPs, a third of the peak -> a longer floor
    assert row["devices"]["A100"]["floor_ms"] > h200["floor_ms"]
    assert step_flops > 0  # (the exact FLOPs formula is tested in test_bench.py)


def test_memory_bound_step_uses_bandwidth() -> None:
    cfg = dataclasses.replace(p.preset_model("pilot", "transformer"), n_layers=1)
    row = p.project_step(cfg, 16, 1, launches=0, params=10**10)  # huge optimizer traffic
    h100 = row["devices"]["H100"]
    assert h100["floor_ms"] == pytest.approx(row["bytes"] / 3.35e12 * 1e3)


def test_step_spends_the_executed_work_and_is_compared_with_the_useful() -> None:
    """The projected step pays the FLOPs its forms execute (the CMS dual read's [T, F]
    scores included); its floor and MFU count the useful work only. At the pilot
    preset the dual read (in blocks of 1,024 tokens) adds over half of
    hope_attention's matmul work again."""
    cfg = p.preset_model("pilot", "hope_attention")
    row = p.project_step(cfg, 4096, 1, launches=1000, params=1)
    per_token = flops.executed_training_flops_per_token(cfg, 4096)
    assert row["executed_flops"] == pytest.approx(per_token * 4096)
    assert row["executed_flops"] > 1.5 * row["flops"]
    h200 = row["devices"]["H200"]
    assert h200["floor_ms"] == pytest.approx(row["flops"] / (989e12 * p.ACHIEVABLE) * 1e3)
    assert h200["work_ms"] == pytest.approx(row["executed_flops"] / (989e12 * p.ACHIEVABLE) * 1e3)
    assert h200["graph_ms"] == pytest.approx(h200["work_ms"] + 1000 * p.GRAPH_LAUNCH_S * 1e3)
    assert h200["graph_over_floor"] == pytest.approx(h200["graph_ms"] / h200["floor_ms"])
    assert h200["mfu_graph"] == pytest.approx(row["flops"] / (h200["graph_ms"] / 1e3 * 989e12))
    plain = p.project_step(p.preset_model("pilot", "transformer"), 4096, 1, 1000, params=1)
    assert plain["executed_flops"] == plain["flops"]


def test_fused_recurrences_run_on_the_multiprocessors_their_programs_occupy() -> None:
    """Under ``fused`` the memories' recurrent work runs in one program per (sample,
    head), teach pass A's checkpointed walks rerunning theirs: at the pilot's two
    rows of 16 heads, 32 of an H200's 132 multiprocessors, so that share costs 132/32
    times its FLOP time at the peak of its fp32 products (TF32 in a bf16 run, the FMA
    units' in an fp32 one); at 8 rows (mid), 128 of 132. The torch backend's batched ops
    and a variant without a memory recurrence pay no occupancy; the floor (useful
    work on the whole device) never changes."""
    cfg = p.preset_model("pilot", "hope")
    torch_row = p.project_step(cfg, 4096, 2, 1000, params=1, backend="torch")
    fused = p.project_step(cfg, 4096, 2, 1000, params=1, backend="fused")
    assert (torch_row["programs"], torch_row["recurrent_flops"]) == (0, 0.0)
    assert fused["programs"] == 2 * 16
    # the pilot checkpoints the SMT chunk loop: under fused, teach pass A's walks rerun
    assert cfg.smt_checkpoint_chunks
    pass_a = cfg.n_layers * flops.recurrent_forward_flops(cfg) * 2 * 4096
    assert fused["executed_flops"] == pytest.approx(torch_row["executed_flops"] + pass_a)
    recurrent = flops.recurrent_training_flops_per_token(cfg, 4096, fused=True) * 2 * 4096
    assert recurrent == pytest.approx(
        flops.recurrent_training_flops_per_token(cfg, 4096) * 2 * 4096 + pass_a
    )
    assert fused["recurrent_flops"] == pytest.approx(recurrent)
    # fp32 products: TF32 tensor cores in a bf16 run, the FMA units in an fp32 one
    strict = p.project_step(cfg, 4096, 2, 1000, params=1, backend="fused", precision="fp32")
    assert (fused["recurrent_dot"], strict["recurrent_dot"], torch_row["recurrent_dot"]) == (
        "tf32", "ieee", None,
    )  # fmt: skip
    for name, sms, tf32, fma in (("H200", 132, 494.5e12, 67e12), ("A100", 108, 156e12, 19.5e12)):
        peak = p.DEVICES[name][0] * p.ACHIEVABLE
        device, plain = fused["devices"][name], torch_row["devices"][name]
        assert device["occupancy"] == pytest.approx(32 / sms) and plain["occupancy"] == 1.0
        rest = (fused["executed_flops"] - recurrent) / peak
        expected = rest + recurrent * sms / 32 / (tf32 * p.ACHIEVABLE)
        assert device["work_ms"] == pytest.approx(expected * 1e3)
        slow = rest + recurrent * sms / 32 / (fma * p.ACHIEVABLE)
        assert strict["devices"][name]["work_ms"] == pytest.approx(slow * 1e3)
        assert plain["work_ms"] == pytest.approx(torch_row["executed_flops"] / peak * 1e3)
        assert device["floor_ms"] == plain["floor_ms"] < plain["work_ms"] < device["work_ms"]
        assert device["work_ms"] < strict["devices"][name]["work_ms"]
    eight = p.project_step(cfg, 4096, 8, 1000, params=1, backend="fused")["devices"]["H200"]
    assert eight["occupancy"] == pytest.approx(128 / 132)
    transformer = p.preset_model("pilot", "transformer")
    none = p.project_step(transformer, 4096, 2, 1000, params=1, backend="fused")
    assert none["programs"] == 0 and none["devices"]["H200"]["occupancy"] == 1.0


def test_bench_report_holds_the_projection(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "params.yaml",
        ["model.dim=32", "model.n_heads=2", "tokenizer.vocab_size=64", "data.seq_len=16",
         "bench.batch_size=2", "bench.warmup=1", "bench.steps=1", "bench.shapes=[tiny]",
         "bench.device=cpu", "bench.variants=[transformer]", "bench.project_presets=[pilot]"],
    )  # fmt: skip
    report = bench_run.run_bench(cfg, tmp_path / "bench.json", isolate=False)
    projected = report["projection"]
    assert projected["constants"]["achievable_fraction_of_peak"] == p.ACHIEVABLE
    row = projected["presets"]["pilot"]["transformer"]
    # the preset's own micro-batch: pilot runs two 4K rows per forward/backward
    assert (row["micro_batch"]["rows"], row["micro_batch"]["tokens"]) == (2, 2 * 4096)
    assert set(row["micro_batch"]["devices"]) == {"H200", "H100", "A100"}
    shape = row["bench_pilot_shape"]
    assert shape["tokens"] == 4 * 4096
    assert shape["launches"] == round(row["launch_fit"]["base"] + 2 * row["launches_per_layer"])


def test_a_preset_is_projected_at_its_own_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The micro-batch a preset runs (``train.micro_batch_size``, else one rank's whole
    batch) is the one projected: the launches are paid per micro-batch, so a preset
    that fits two rows per forward pays them for those two alone."""
    assert (p.preset_micro_batch("pilot"), p.preset_micro_batch("mid")) == (2, 4)
    assert p.preset_micro_batch("tiny") == load_config(None, ["preset=tiny"]).train.batch_size
    monkeypatch.setattr(p, "fit_launches", lambda cfg, seq_len: p.LaunchFit(0, 0, 0, 1.0, (1, 2)))
    pilot = p.project_variant("pilot", "transformer")["micro_batch"]
    mid = p.project_variant("mid", "transformer")["micro_batch"]
    assert (pilot["rows"], pilot["tokens"]) == (2, 2 * 4096)
    assert (mid["rows"], mid["tokens"]) == (4, 4 * 4096)
    # the same launches over 1 row instead of 8: an eighth of the (FLOP-bound) floor,
    # so the launches' share of the step over the floor is 8 times larger
    cfg = p.preset_model("pilot", "transformer")
    one, eight = (p.project_step(cfg, 4096, rows, 40_000, 10**8) for rows in (1, 8))
    h200 = [step["devices"]["H200"] for step in (one, eight)]
    assert h200[0]["floor_ms"] == pytest.approx(h200[1]["floor_ms"] / 8)
    over = [device["graph_over_floor"] - 1 for device in h200]
    assert over[0] == pytest.approx(8 * over[1]) and over[0] > 4


def test_pilot_hope_projection_adds_the_frozen_read_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pilot preset's hope row projects the bench's pilot_frozen chunking too (the
    launch counts stubbed here: the real fits take minutes, the fit test covers them)."""
    fitted: list[ModelConfig] = []

    def fake_fit(cfg: ModelConfig, seq_len: int) -> p.LaunchFit:
        fitted.append(cfg)
        per_token = 10.0 if cfg.smt_read_chunk else 100.0
        return p.LaunchFit(0.0, 0.0, 0.0, per_token, (256, 512))

    monkeypatch.setattr(p, "fit_launches", fake_fit)
    row = p.project_variant("pilot", "hope")
    assert [c.smt_read_chunk for c in fitted] == [None, 16]
    assert (fitted[1].smt_chunk, fitted[1].smt_mem_chunk) == (64, 64)
    frozen = row["frozen_reads"]
    assert (frozen["launches_per_layer"], row["launches_per_layer"]) == (40960, 409600)
    assert frozen["micro_batch"]["launches"] == 10 * 40960
    eager = frozen["micro_batch"]["devices"]["H200"]["eager_ms"]
    assert eager < row["micro_batch"]["devices"]["H200"]["eager_ms"]
    assert "frozen_reads" not in p.project_variant("mid", "transformer")


@pytest.mark.parametrize(("bench_backend", "counted"), [("fused", "fused"), ("compile", "torch")])
def test_bench_projects_with_its_memory_backend(
    monkeypatch: pytest.MonkeyPatch, bench_backend: str, counted: str
) -> None:
    """``bench.memory_backend=fused`` projects the launches the fused operators make (the
    dispatch count sees what a GPU runs); backends whose steps it cannot count are
    projected as torch. The process's default backend is left as it was. (Counts
    stubbed: the real fits take minutes.)"""
    seen: list[str] = []

    def fake_fit(cfg: ModelConfig, seq_len: int) -> p.LaunchFit:
        seen.append(dispatch.resolve_backend(None))
        return p.LaunchFit(0.0, 0.0, 0.0, 1.0, (256, 512))

    monkeypatch.setattr(p, "fit_launches", fake_fit)
    cfg = load_config(
        ROOT / "params.yaml",
        [f"bench.memory_backend={bench_backend}", "bench.variants=[transformer]",
         "bench.project_presets=[mid]"],
    )  # fmt: skip
    report = bench_run._project(cfg, ["transformer"], {})
    assert seen == [counted] and report["memory_backend"] == counted
    assert dispatch.resolve_backend(None) == "torch"


def test_projections_counted_in_worker_processes_equal_the_in_process_ones() -> None:
    """The stage counts the (preset, variant) projections in ``bench.num_threads``
    fresh processes side by side: the same rows as one after another here, in the
    configured order; a projection that fails in a worker is skipped with its reason
    and the others are kept."""
    cfg = load_config(
        ROOT / "params.yaml",
        ["bench.variants=[transformer, hope_attention]", "bench.project_presets=[pilot]"],
    )
    here_skipped: dict[str, dict[str, str]] = {}
    here = bench_run._project(cfg, ["transformer", "hope_attention"], here_skipped, workers=1)
    bad = dataclasses.replace(cfg.bench, project_presets=["pilot", "nonexistent"])
    apart_skipped: dict[str, dict[str, str]] = {}
    apart = bench_run._project(
        dataclasses.replace(cfg, bench=bad), ["transformer", "hope_attention"], apart_skipped,
        workers=2,
    )  # fmt: skip
    assert here_skipped == {}
    assert apart["presets"]["pilot"] == here["presets"]["pilot"]
    assert list(apart["presets"]["pilot"]) == ["transformer", "hope_attention"]
    assert apart["presets"]["nonexistent"] == {}
    reasons = apart_skipped["projection/nonexistent"]
    assert set(reasons) == {"transformer", "hope_attention"}
    assert all("nonexistent" in reason for reason in reasons.values()), reasons


def test_projections_sharing_their_counts_run_as_one_task() -> None:
    """mid and target share their narrow counting models: each variant's two jobs form
    one task (the second reads the first's counts from the worker's cache), pilot's
    jobs count their own, every job is in exactly one task, and a preset that does not
    load stays a task of its own (it reports why)."""
    variants = ["transformer", "hope"]
    jobs = [(preset, v) for preset in ("pilot", "mid", "target", "nonexistent") for v in variants]
    tasks = bench_run.counting_tasks(jobs)
    assert sorted(job for task in tasks for job in task) == sorted(jobs)
    assert sorted(map(sorted, tasks)) == sorted(
        [[("nonexistent", v)] for v in variants]
        + [[("pilot", v)] for v in variants]
        + [[("mid", v), ("target", v)] for v in variants]
    )
    assert tasks[0][0][0] == "nonexistent"  # it fails at once, so it goes first
    assert p.counting_group("mid", "hope") == p.counting_group("target", "hope")
    assert p.counting_group("mid", "hope") != p.counting_group("mid", "transformer")

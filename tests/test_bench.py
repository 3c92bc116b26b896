"""The bench stage: report shape, sync counting, FLOPs formulas, skips and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hope
from conftest import CLASSIC_SHELL
from hope.bench import flops
from hope.bench import run as bench_run
from hope.bench.measure import (
    LaunchCounter,
    ProfiledLaunchCounter,
    count_host_syncs,
    enable_cpu_kernel_events,
)
from hope.bench.report_files import split_report
from hope.config import Config, load_config
from hope.errors import ConfigError
from hope.memory.ops import dispatch

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"
ROW_KEYS = {
    "tokens_per_s", "step_ms", "step_ms_min", "peak_mem_mb", "mem_baseline_mb",
    "host_syncs_per_step", "launches_per_step", "params", "flops_per_token",
    "achieved_gflops_per_s", "mfu",
    "loss", "precision", "relative_to_transformer", "step_time_ratio_vs_transformer",
}  # fmt: skip
SMALL = (
    "model.dim=32", "model.n_heads=2", "tokenizer.vocab_size=64", "data.seq_len=16",
    "bench.batch_size=2", "bench.warmup=1", "bench.steps=2",
    "bench.shapes=[tiny]", "bench.device=cpu", "bench.project_presets=[]",
)  # fmt: skip


def small_cfg(*extra: str) -> Config:
    return load_config(PARAMS, [*SMALL, *extra])


def test_report_rows_are_finite_positive_and_relative_to_transformer(tmp_path: Path) -> None:
    cfg = small_cfg("bench.variants=[transformer,hope_attention,no_such_variant]", *CLASSIC_SHELL)
    report = bench_run.run_bench(cfg, tmp_path / "bench.json", isolate=False)
    metrics, meta = split_report(report)
    assert json.loads((tmp_path / "bench.json").read_text()) == metrics
    assert json.loads((tmp_path / "bench_meta.json").read_text()) == meta
    rows = report["tiny"]
    assert set(rows) == {"transformer", "hope_attention"}
    for variant, row in rows.items():
        assert set(row) == ROW_KEYS, variant
        for key in ("tokens_per_s", "step_ms", "peak_mem_mb", "params", "flops_per_token"):
            assert math.isfinite(row[key]) and row[key] > 0, (variant, key)
        assert row["mfu"] is None and row["precision"] == "fp32"  # CPU: no bf16 peak
        assert row["tokens_per_s"] == pytest.approx(2 * 16 / (row["step_ms"] / 1e3))
        assert row["host_syncs_per_step"] == 0 and row["launches_per_step"] > 100
    base, other = rows["transformer"], rows["hope_attention"]
    assert other["launches_per_step"] > base["launches_per_step"]
    assert base["relative_to_transformer"] == 1.0
    assert base["step_time_ratio_vs_transformer"] == 1.0
    assert other["relative_to_transformer"] == other["tokens_per_s"] / base["tokens_per_s"]
    model = hope.build_model(dataclasses.replace(cfg.model, variant="transformer"))
    assert base["params"] == model.num_parameters()
    # Random tokens: the initial loss is near ln(V).
    assert base["loss"] == pytest.approx(math.log(64), abs=0.3)
    reason = report["skipped"]["tiny"]["no_such_variant"]
    assert "not registered" in reason and "transformer" in reason
    machine = report["machine"]
    assert machine["torch"] == torch.__version__ and machine["gpu"] is None
    assert machine["torch_threads"] == torch.get_num_threads() and machine["logical_cores"] >= 1
    assert report["config"]["shapes_used"]["tiny"] == {
        "dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64, "seq_len": 16, "batch_size": 2,
    }  # fmt: skip


def _probe_builder(n_items: int) -> Any:
    """build_model whose training_loss makes ``n_items`` `.item()` calls plus one bool()."""
    real_build = hope.build_model

    def build(model_cfg: Any) -> Any:
        model = real_build(model_cfg)
        loss_fn = model.training_loss

        def training_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(x, y)
            for _ in range(n_items):
                loss.item()
            bool(loss > 0)
            return loss

        model.training_loss = training_loss  # type: ignore[method-assign]
        return model

    return build


@pytest.mark.parametrize("n_items", [1, 3])
def test_host_sync_counter_sees_injected_syncs(
    monkeypatch: pytest.MonkeyPatch, n_items: int
) -> None:
    monkeypatch.setattr(bench_run, "build_model", _probe_builder(n_items))
    row = bench_run.measure_variant(small_cfg(), "transformer", "tiny")
    assert row["host_syncs_per_step"] == n_items + 1


def test_sync_counter_restores_tensor_methods() -> None:
    original = torch.Tensor.item
    with count_host_syncs() as calls:
        torch.ones(()).item()
        torch.ones(2).tolist()
    assert calls == ["item", "tolist"]
    assert torch.Tensor.item is original


def test_failing_measurement_is_skipped_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = hope.build_model

    def build(model_cfg: Any) -> Any:
        if model_cfg.variant == "hope_attention":
            raise RuntimeError("deliberately broken")
        return real_build(model_cfg)

    monkeypatch.setattr(bench_run, "build_model", build)
    cfg = small_cfg("bench.variants=[hope_attention,transformer]")
    report = bench_run.run_bench(cfg, tmp_path / "bench.json", isolate=False)
    assert set(report["tiny"]) == {"transformer"}
    assert report["skipped"] == {"tiny": {"hope_attention": "RuntimeError: deliberately broken"}}


def test_isolated_measurement_raises_the_measuring_process_error() -> None:
    """A measurement in its own process returns the row of one in this process (the
    counts are deterministic) and fails with the measuring process's own exception."""
    cfg = small_cfg("bench.num_threads=1")
    row = bench_run.measure_isolated(cfg, "transformer", "tiny")
    here = bench_run.measure_variant(cfg, "transformer", "tiny")
    assert (row["launches_per_step"], row["params"]) == (here["launches_per_step"], here["params"])
    assert row["loss"] == pytest.approx(here["loss"], rel=1e-6)
    with pytest.raises(ConfigError, match="unknown shape 'nope'"):
        bench_run.measure_isolated(cfg, "transformer", "nope")


def test_without_transformer_the_ratios_are_null(tmp_path: Path) -> None:
    report = bench_run.run_bench(
        small_cfg("bench.variants=[titans_lmm]"), tmp_path / "b.json", isolate=False
    )
    assert report["tiny"]["titans_lmm"]["relative_to_transformer"] is None


def test_transformer_flops_match_hand_computation() -> None:
    cfg = dataclasses.replace(
        Config().model, variant="transformer", dim=64, n_layers=2, n_heads=4, vocab_size=100
    )
    # SwiGLU hidden: round(2*4*64/3) = 171 -> 176 (multiple of 8).
    # Per layer: 8*64^2 (qkv, out) + 2*32*64 (causal scores+values, T=32) + 6*64*176 (MLP)
    #          = 32768 + 4096 + 67584 = 104448; two layers + head 2*64*100 = 221696.
    assert flops.forward_flops_per_token(cfg, 32) == 221696
    assert flops.training_flops_per_token(cfg, 32) == 3 * 221696


def test_transformer_flops_follow_the_6n_rule_of_the_real_model() -> None:
    cfg = load_config(PARAMS, ["model.variant=transformer"]).model
    model = hope.build_model(cfg)
    matmul_params = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    seq_len = 128
    attention = 6 * cfg.n_layers * seq_len * cfg.dim  # 3 x 2Td per layer
    assert flops.training_flops_per_token(cfg, seq_len) == 6 * matmul_params + attention


def test_teach_pass_and_write_backprop_add_their_documented_cost() -> None:
    base = dataclasses.replace(Config().model, variant="hope", vocab_size=256)
    static = dataclasses.replace(base, cms_mode="static", write_grad="stopgrad")
    forward = flops.forward_flops_per_token(static, 64)
    assert flops.training_flops_per_token(static, 64) == 3 * forward
    teach = dataclasses.replace(static, cms_mode="teach_pass")
    assert flops.training_flops_per_token(teach, 64) == 5 * forward
    full = dataclasses.replace(static, write_grad="full")
    smt = flops.smt_flops(base)
    assert flops.training_flops_per_token(full, 64) == pytest.approx(
        3 * forward + 0.3 * 3 * base.n_layers * smt
    )


def test_peak_flops_table() -> None:
    assert flops.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert flops.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.peak_bf16_flops("cpu") is None and flops.peak_bf16_flops(None) is None


def test_smoke_shape_is_valid_for_every_bench_variant() -> None:
    cfg = load_config(PARAMS)
    shape = bench_run.bench_shape(cfg, "smoke")
    assert (shape.seq_len, shape.batch_size) == (64, 4)
    for variant in cfg.bench.variants:
        model = hope.build_model(dataclasses.replace(shape.model, variant=variant))  # type: ignore[arg-type]
        assert model.embed.weight.shape == (32_000, 128), variant


def test_pilot_chunks_shape_is_the_pilot_chunking_in_one_small_layer() -> None:
    cfg = load_config(PARAMS)
    pilot = load_config(None, ["preset=pilot"]).model
    shape = bench_run.bench_shape(cfg, "pilot_chunks")
    assert (shape.seq_len, shape.batch_size, shape.model.n_layers) == (1024, 1, 1)
    for key in ("cms_periods", "smt_chunk", "smt_mem_chunk", "smt_expansion", "titans_chunk",
                "titans_expansion"):  # fmt: skip
        assert getattr(shape.model, key) == getattr(pilot, key), key
    assert shape.model.dim // shape.model.n_heads == pilot.dim // pilot.n_heads
    for variant in cfg.bench.variants:
        hope.build_model(dataclasses.replace(shape.model, variant=variant))  # type: ignore[arg-type]


def test_pilot_frozen_shape_is_pilot_chunks_with_frozen_reads_of_the_pilot_c_m() -> None:
    cfg = load_config(PARAMS)
    chunks, frozen = (bench_run.bench_shape(cfg, n) for n in ("pilot_chunks", "pilot_frozen"))
    assert (frozen.seq_len, frozen.batch_size) == (chunks.seq_len, chunks.batch_size)
    assert frozen.model.smt_read_chunk == chunks.model.smt_mem_chunk == 16
    assert frozen.model.smt_chunk == frozen.model.smt_mem_chunk == 64
    differ = {
        f.name
        for f in dataclasses.fields(frozen.model)
        if getattr(frozen.model, f.name) != getattr(chunks.model, f.name)
    }
    assert differ == {"smt_chunk", "smt_mem_chunk", "smt_read_chunk"}
    assert frozen.record()["smt_read_chunk"] == 16


def test_pilot_shape_is_the_pilot_preset_in_two_layers_at_its_context() -> None:
    cfg = load_config(PARAMS)
    pilot = load_config(None, ["preset=pilot"])
    shape = bench_run.bench_shape(cfg, "pilot")
    assert (shape.seq_len, shape.model.n_layers) == (pilot.data.seq_len, 2)
    for key in ("dim", "n_heads", "vocab_size", "cms_periods", "cms_lr", "smt_chunk",
                "smt_mem_chunk", "smt_expansion", "titans_chunk", "titans_expansion",
                "titans_window"):  # fmt: skip
        assert getattr(shape.model, key) == getattr(pilot.model, key), key


def test_launch_counter_counts_kernels_not_views_or_allocations() -> None:
    x = torch.randn(4, 4)
    with LaunchCounter() as launches:
        y = x.view(16).add(1).mul(2)  # a view, then two kernels
        y.t() if y.dim() == 2 else y.unsqueeze(0).transpose(0, 1)  # views only
        torch.empty(3, 3)  # an allocation, no kernel
        x.exp_().sum()  # two kernels
        torch.ones(2, 4, 4) @ x  # one mm kernel, then a metadata-only _unsafe_view
        empty = torch.zeros(4, 0, 3)  # zero elements: no kernel on CUDA, none counted
        torch.cat((empty, empty.clone()), dim=1).sum()  # only the sum's fill of 0 runs
    assert launches.count == 5 + 1 + 1  # + the fill of torch.ones, + the empty sum's fill


def test_profiled_counter_counts_generated_kernels_and_extern_calls() -> None:
    """The compiled-path rule on a toy whose kernels are known: inductor makes one
    fused kernel of tanh, scale, shift and sum, and calls mm as an extern kernel;
    the profiler sees both, where a dispatch mode would turn compilation off."""
    enable_cpu_kernel_events()
    torch._dynamo.reset()

    def toy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w) * 2 + 1).sum()

    compiled = torch.compile(toy, dynamic=False)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    with torch.no_grad():
        expected = toy(x, w)
        torch.testing.assert_close(compiled(x, w), expected)  # compiled before counting
        with ProfiledLaunchCounter() as launches:
            compiled(x, w)
        with ProfiledLaunchCounter() as eager:  # mm, tanh, mul, add, sum
            toy(x, w)
    assert (launches.count, eager.count) == (2, 5)


def test_profiled_counter_matches_the_dispatch_counter_on_eager_steps() -> None:
    """On an eager training step both rules count the same kernels (within 1%): the
    profiler looks through composite ops (cross-entropy = log-softmax + NLL, linear =
    addmm) as the dispatch counter, below autograd, sees them. The profiler does not
    see outputs, so it also counts the ops on empty tensors the dispatch counter
    leaves out (``LaunchCounter.empty``)."""
    for variant in ("transformer", "hope"):
        cfg = small_cfg(f"model.variant={variant}", "model.smt_chunk=4", "model.smt_mem_chunk=4")
        torch.manual_seed(0)
        model = hope.build_model(cfg.model)
        tokens = torch.randint(0, 64, (2, 33))
        counters = LaunchCounter(), ProfiledLaunchCounter()
        for counter in counters:  # the same step, from no gradients, twice
            model.zero_grad(set_to_none=True)
            with counter:
                model.training_loss(tokens[:, :-1], tokens[:, 1:]).backward()
        dispatched, profiled = counters
        seen = dispatched.count + dispatched.empty
        assert abs(profiled.count - seen) <= 0.01 * dispatched.count, variant
        assert dispatched.count > 200


def _step_launches(variant: str, seq_len: int) -> int:
    cfg = small_cfg(f"model.variant={variant}", "model.smt_chunk=4", "model.smt_mem_chunk=4")
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    tokens = torch.randint(0, 64, (2, seq_len + 1))
    with LaunchCounter() as launches:
        model.training_loss(tokens[:, :-1], tokens[:, 1:]).backward()
    return launches.count


def test_launches_are_flat_in_length_for_attention_and_grow_with_the_chunk_loops() -> None:
    """The transformer's step launches the same kernels at any length; the memories'
    chunk loops add launches per chunk (MECHANISMS §8: the host cost at paper scale)."""
    assert _step_launches("transformer", 32) == _step_launches("transformer", 64)
    short, long = _step_launches("hope", 32), _step_launches("hope", 64)
    assert 1.5 * short < long < 2.5 * short


@pytest.mark.usefixtures("compile_without_codegen")
def test_compile_memory_backend_measures_the_same_training(tmp_path: Path) -> None:
    """bench.memory_backend=compile reaches the measuring step (via setup_runtime):
    the compiled SMT chunk step (traced without inductor's code generation, whose
    kernels test_smt.py checks) trains to the same loss as the eager one."""
    losses = {}
    for backend in ("torch", "compile"):
        cfg = small_cfg("bench.variants=[hope]", f"bench.memory_backend={backend}")
        report = bench_run.run_bench(cfg, tmp_path / f"{backend}.json", isolate=False)
        assert report["config"]["memory_backend"] == backend
        assert report["tiny"]["hope"]["host_syncs_per_step"] == 0
        assert report["tiny"]["hope"]["launches_per_step"] > 0
        losses[backend] = report["tiny"]["hope"]["loss"]
    assert dispatch.resolve_backend(None) == "compile"
    dispatch.set_default_backend("torch")
    assert losses["compile"] == pytest.approx(losses["torch"], rel=1e-5)


def test_bad_bench_knobs_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"bench\.steps must be >= 1"):
        bench_run.run_bench(small_cfg("bench.steps=0"), tmp_path / "b.json")
    with pytest.raises(ConfigError, match=r"bench\.shapes"):
        load_config(PARAMS, ["bench.shapes=[huge]"])


def _strings(tree: object, path: str = "") -> list[str]:
    """Paths of the non-numeric leaves of a JSON tree (None counts as a number: n/a)."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _strings(v, f"{path}.{k}")]
    if isinstance(tree, list):
        return [p for i, v in enumerate(tree) for p in _strings(v, f"{path}[{i}]")]
    return [] if tree is None or isinstance(tree, (int, float)) else [path]


def test_stage_cli_writes_the_report_with_isolated_measurements(tmp_path: Path) -> None:
    # The ambient thread count (2) loses to the params' (1).
    env = {**os.environ, "OMP_NUM_THREADS": "2", "WANDB_MODE": "disabled"}
    sets = [*SMALL, "bench.variants=[transformer]", "bench.shapes=[tiny,smoke]"]
    sets.append("bench.num_threads=1")
    args = [arg for s in sets for arg in ("--set", s)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "stages/bench.py"), "--params", str(PARAMS), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "reports/bench.json").read_text())
    meta = json.loads((tmp_path / "reports/bench_meta.json").read_text())
    assert "bench tiny/transformer" in proc.stdout
    # Numbers only in the metrics file (`dvc metrics show` reads it as a table);
    # the machine, config, skipped variants and constants beside it.
    assert set(report) == {"tiny", "smoke", "wall_s", "projection"}
    assert set(meta) == {
        "machine", "config", "skipped", "precision", "projection_constants", "projection_records",
    }  # fmt: skip
    assert not _strings(report), _strings(report)
    assert report["projection"]["presets"] == {} and meta["skipped"] == {}
    assert meta["precision"]["tiny"]["transformer"] == "fp32"
    for shape, tokens in (("tiny", 2 * 16), ("smoke", 4 * 64)):
        row = report[shape]["transformer"]
        assert row["peak_mem_mb"] >= row["mem_baseline_mb"] > 0
        assert row["host_syncs_per_step"] == 0
        assert row["tokens_per_s"] == pytest.approx(tokens / (row["step_ms"] / 1e3))
    assert meta["machine"]["torch_threads"] == 1  # from the measuring subprocess's params
    assert report["smoke"]["transformer"]["params"] > 32_000 * 128


def test_bad_override_fails_the_stage_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "stages/bench.py"), "--params", str(PARAMS),
         "--set", "bench.warmup=-1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "bench.warmup must be >= 0" in proc.stderr
    assert not (tmp_path / "reports/bench.json").exists()

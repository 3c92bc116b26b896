"""The headline figures each stage hands DVC (hope.report.headline): a few scalars
per stage, names that no two stages share, and at the default params few enough
columns for `dvc metrics show --md` to fit on one screen (<= 40 with its Path)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import hope
from hope.io import headline_path, write_metrics
from hope.report import headline

ROOT = Path(__file__).resolve().parents[1]


def _reports(cfg: hope.Config) -> dict[str, dict[str, Any]]:
    """Full reports in the shapes the stages write, for the params' variants, tasks and
    lengths (numbers chosen so every headline figure is distinguishable)."""
    row = {
        "tokens_per_s": 1000.0,
        "step_ms": 50.0,
        "launches_per_step": 900,
        "host_syncs_per_step": 0,
        "step_time_ratio_vs_transformer": 2.0,
    }
    bench_rows = {v: dict(row, tokens_per_s=1000.0 + i) for i, v in enumerate(cfg.bench.variants)}
    niah_cell = {"acc": 0.5, "acc_ci_low": 0.1, "acc_ci_high": 0.9, "chance": 0.25}
    return {
        "train": {
            "train_loss": 5.0,
            "val_subset_loss": 5.2,
            "tokens_per_s": 900.0,
            "steps": 250,
            "params": 961288,
            "tokens_seen": 512000,
        },
        "eval": {
            "val": {"loss": 5.5, "ppl": 244.7, "bpb": 2.1, "tokens": 56960},
            "passkey": {"len_64": {"acc": 0.25}, "len_128": {"acc": 0.75}},
            "step": 250,
        },
        "zeroshot": {
            "hope_cloze": {"acc": 0.1, "perplexity": 300.0},
            "hope_choice": {"acc": 0.3, "acc_norm": 0.3},
            "hope_rolling": {"bits_per_byte": 2.0},
            "step": 250,
        },
        "niah": {
            **{task: {f"len_{n}": niah_cell for n in cfg.niah.lengths} for task in cfg.niah.tasks},
            "step": 250,
        },
        "longctx": {
            "loss": 5.1,
            "fresh_loss": 5.4,
            "stream_gain": 0.3,
            "fast_weight_norm_max": 3.7,
            "by_position": {"0": 5.0},
        },
        "continual": {"bwt": 0.02, "mean_forgetting": 0.01, "after": {"0_json": {"json": 4.0}}},
        "bench": {shape: bench_rows for shape in cfg.bench.shapes} | {"wall_s": 60.0},
        "recall": {
            "variants": {v: {"accuracy": 0.5, "chance": 0.125} for v in cfg.recall.variants}
        },
    }


def _headlines(cfg: hope.Config) -> dict[str, dict[str, Any]]:
    reports = _reports(cfg)
    plain = {
        "train": headline.train,
        "eval": headline.evaluation,
        "zeroshot": headline.zeroshot,
        "niah": headline.niah,
        "longctx": headline.longctx,
        "continual": headline.continual,
        "recall": headline.recall,
    }
    out = {stage: fn(reports[stage]) for stage, fn in plain.items()}
    out["bench"] = headline.bench(reports["bench"], cfg.bench.shapes[0])
    return out


def test_default_params_give_one_screen_of_columns_no_two_stages_share() -> None:
    cfg = hope.load_config(ROOT / "params.yaml")
    headlines = _headlines(cfg)
    assert set(headlines) == {
        "train",
        "eval",
        "zeroshot",
        "niah",
        "longctx",
        "continual",
        "bench",
        "recall",
    }
    names = [name for figures in headlines.values() for name in figures]
    assert len(names) == len(set(names)), "two stages share a headline name"
    # + the Path column dvc prints first
    assert len(names) + 1 <= 40, len(names)
    assert len(names) == 3 + 4 + 1 + (len(cfg.niah.tasks) + 1) + 4 + 2 + (
        3 * len(cfg.bench.variants) + 2
    ) + len(cfg.recall.variants)


def test_each_headline_picks_its_report_numbers() -> None:
    cfg = hope.load_config(ROOT / "params.yaml")
    h = _headlines(cfg)
    assert h["train"] == {"train_loss": 5.0, "val_subset_loss": 5.2, "train_tokens_per_s": 900.0}
    assert h["eval"] == {"val_loss": 5.5, "val_ppl": 244.7, "val_bpb": 2.1, "passkey_acc": 0.5}
    assert h["zeroshot"] == {"zeroshot_acc": pytest.approx(0.2)}  # rolling has no accuracy
    assert h["niah"]["niah_acc"] == 0.5 and h["niah"]["niah_s_niah_1_acc"] == 0.5
    assert h["longctx"]["longctx_stream_gain"] == 0.3
    assert h["continual"] == {"continual_bwt": 0.02, "continual_forgetting": 0.01}
    first = cfg.bench.variants[1]
    assert h["bench"][f"{first}.tokens_per_s"] == 1001.0 and h["bench"]["hope_step_ratio"] == 2.0
    assert h["bench"]["host_syncs_max"] == 0
    assert h["recall"] == {f"{v}.recall_acc": 0.5 for v in cfg.recall.variants}


def test_a_non_finite_figure_is_null_and_the_headline_lands_beside_the_report(
    tmp_path: Path,
) -> None:
    figures = headline.longctx(
        {"loss": math.inf, "fresh_loss": 5.0, "stream_gain": math.nan, "fast_weight_norm_max": None}
    )
    assert figures == {
        "longctx_loss": None,
        "longctx_fresh_loss": 5.0,
        "longctx_stream_gain": None,
        "fast_weight_norm_max": None,
    }
    report = tmp_path / "reports/longctx.json"
    report.parent.mkdir()
    write_metrics(report, {"loss": 5.0}, {"config": {}}, {"longctx_loss": 5.0})
    assert headline_path(report) == tmp_path / "reports/metrics/longctx.json"
    assert json.loads(headline_path(report).read_text()) == {"longctx_loss": 5.0}
    with pytest.raises(ValueError, match="numbers only"):
        write_metrics(report, {"loss": 5.0}, {}, {"name": "hope"})

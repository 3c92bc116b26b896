"""The headline numbers of each stage: what a reviewer compares in ``dvc metrics show``
and ``dvc metrics diff``.

A stage writes its full numbers to ``reports/<stage>.json`` (every length, depth,
task, shape and interval; an ``out``), its records to ``reports/<stage>_meta.json``,
and the few figures below to ``reports/metrics/<stage>.json``, the file ``dvc.yaml``
declares under ``metrics:``. Every name here is used by one stage only, so the
columns of ``dvc metrics show --md`` are the union of these dicts: at the default
params 35 of them (tests/test_headline.py), one screen.

Each function maps a stage's full numbers to a flat dict of scalars; a number the
report does not hold (a task not run, a variant skipped) is left out, and a
non-finite one is None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

Headline = dict[str, float | int | None]


def _num(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def _mean(values: Iterable[Any]) -> float | None:
    kept = [float(v) for v in values if _num(v) is not None]
    return sum(kept) / len(kept) if kept else None


def train(report: dict[str, Any]) -> Headline:
    """The last logged losses and the run's throughput (``val_subset_loss``: the first
    ``train.val_batches`` windows of the split; the whole split is eval's ``val_loss``)."""
    return {
        "train_loss": _num(report["train_loss"]),
        "val_subset_loss": _num(report["val_subset_loss"]),
        "train_tokens_per_s": _num(report["tokens_per_s"]),
    }


def evaluation(report: dict[str, Any]) -> Headline:
    """Validation loss, perplexity and bits per byte over the scored split; passkey
    accuracy averaged over the lengths."""
    val = report["val"]
    out: Headline = {"val_loss": _num(val["loss"]), "val_ppl": _num(val["ppl"])}
    if "bpb" in val:
        out["val_bpb"] = _num(val["bpb"])
    out["passkey_acc"] = _mean(cell["acc"] for cell in report["passkey"].values())
    return out


def zeroshot(report: dict[str, Any]) -> Headline:
    """Accuracy averaged over the tasks that report one (rolling perplexity does not)."""
    tasks = [v for v in report.values() if isinstance(v, dict) and "acc" in v]
    return {"zeroshot_acc": _mean(task["acc"] for task in tasks)}


def niah(report: dict[str, Any]) -> Headline:
    """Accuracy of each task averaged over its lengths, and over every task and length."""
    out: Headline = {}
    cells = []
    for task, lengths in report.items():
        if not isinstance(lengths, dict):
            continue  # the step
        accs = [cell["acc"] for cell in lengths.values()]
        out[f"niah_{task}_acc"] = _mean(accs)
        cells += accs
    out["niah_acc"] = _mean(cells)
    return out


def longctx(report: dict[str, Any]) -> Headline:
    """Streamed and fresh-window loss over the long sequences, their difference and the
    largest fast-weight norm a stream reached."""
    return {
        "longctx_loss": _num(report["loss"]),
        "longctx_fresh_loss": _num(report["fresh_loss"]),
        "longctx_stream_gain": _num(report["stream_gain"]),
        "fast_weight_norm_max": _num(report["fast_weight_norm_max"]),
    }


def continual(report: dict[str, Any]) -> Headline:
    """Backward transfer and mean forgetting (in loss: > 0 means later writes hurt)."""
    return {
        "continual_bwt": _num(report["bwt"]),
        "continual_forgetting": _num(report["mean_forgetting"]),
    }


def bench(report: dict[str, Any], shape: str) -> Headline:
    """At the headline shape (``bench.shapes[0]``): each variant's tokens/s, step time
    and kernel launches per step; hope's step time over the transformer's; the most
    host syncs any variant made per step (0 on every path today)."""
    rows: dict[str, dict[str, Any]] = report.get(shape, {})
    out: Headline = {}
    for variant, row in rows.items():
        out[f"{variant}.tokens_per_s"] = _num(row["tokens_per_s"])
        out[f"{variant}.step_ms"] = _num(row["step_ms"])
        out[f"{variant}.launches_per_step"] = _num(row.get("launches_per_step"))
    if "hope" in rows and "step_time_ratio_vs_transformer" in rows["hope"]:
        out["hope_step_ratio"] = _num(rows["hope"]["step_time_ratio_vs_transformer"])
    syncs = [row["host_syncs_per_step"] for row in rows.values()]
    out["host_syncs_max"] = max(syncs) if syncs else None
    return out


def recall(report: dict[str, Any]) -> Headline:
    """MQAR accuracy of each variant."""
    return {f"{v}.recall_acc": _num(row["accuracy"]) for v, row in report["variants"].items()}

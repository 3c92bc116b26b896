"""What the bench stage writes: numbers, records beside them, a step-time table.

``reports/bench.json`` is a DVC metric, so it holds numbers only and ``dvc metrics
show/diff`` read it as a table; ``reports/bench_meta.json`` keeps the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hope.io import atomic_write_text, split_non_numbers

META_KEYS = ("machine", "config", "skipped")


def split_report(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, records): numbers only for ``dvc metrics show/diff`` (shape -> variant ->
    measurement, wall time, projected GPU steps); the machine, the bench config, skipped
    variants, each row's precision and the projection's constants and sample lengths go
    beside them."""
    metrics = {k: v for k, v in report.items() if k not in META_KEYS}
    meta = {k: report[k] for k in META_KEYS}
    meta["precision"] = {}
    for shape in report["config"]["shapes"]:
        rows = metrics.get(shape, {})
        meta["precision"][shape] = {v: row["precision"] for v, row in rows.items()}
        metrics[shape] = {
            v: {k: x for k, x in row.items() if k != "precision"} for v, row in rows.items()
        }
    projection = dict(metrics["projection"])
    meta["projection_constants"] = projection.pop("constants")
    # The launch fits' sample lengths (lists) go beside their fitted numbers.
    metrics["projection"], meta["projection_records"] = split_non_numbers(projection)
    return metrics, meta


STEP_TABLE = "bench_step_ms.tsv"  # beside bench.json; dvc.yaml plots it per variant


def write_step_table(path: Path, metrics: dict[str, Any], shapes: Sequence[str]) -> None:
    """One row per measured shape and variant (``<shape>/<variant>``): its step time
    and tokens/s, the table ``dvc plots show`` draws as bars."""
    rows = ["variant\tstep_ms\ttokens_per_s"]
    for shape in shapes:
        for variant, row in metrics.get(shape, {}).items():
            rows.append(f"{shape}/{variant}\t{row['step_ms']}\t{row['tokens_per_s']}")
    atomic_write_text(path, "\n".join(rows) + "\n")

"""The papers' tables from several runs' evaluation outputs, as Markdown and CSV.

    python -m hope.report.tables RUN [RUN ...] [--names a,b] [--out reports/tables]

A RUN is a folder holding ``reports/`` (a pipeline checkout, e.g. one per variant or
per ``dvc exp``, checked out with ``dvc exp apply``) or a release bundle (its
``metrics/``). Written: ``table1.md``/``.csv`` (the Nested Learning paper's Table 1
columns: WikiText ppl, LAMBADA ppl/acc, PIQA, HellaSwag, WinoGrande, ARC-e, ARC-c,
SIQA, BoolQ, and their average accuracy; the offline tasks stand in for the paper's
when a run has only those: hope_rolling for WikiText, hope_cloze for LAMBADA,
hope_choice for HellaSwag) and ``table2.md``/``.csv`` (the Titans paper's S-NIAH
columns: task x context length). A missing number is an empty cell, never a zero.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hope.errors import StageError
from hope.io import atomic_write_text

# (column, lm-eval task, metric, offline stand-in task, its metric); lm-eval's own
# metric choice per task (acc_norm where the harness reports the paper's number).
TABLE1 = (
    ("Wiki. ppl", "wikitext", "word_perplexity", "hope_rolling", "word_perplexity"),
    ("LMB. ppl", "lambada_openai", "perplexity", "hope_cloze", "perplexity"),
    ("LMB. acc", "lambada_openai", "acc", "hope_cloze", "acc"),
    ("PIQA", "piqa", "acc", None, None),
    ("Hella.", "hellaswag", "acc_norm", "hope_choice", "acc_norm"),
    ("Wino.", "winogrande", "acc", None, None),
    ("ARC-e", "arc_easy", "acc", None, None),
    ("ARC-c", "arc_challenge", "acc_norm", None, None),
    ("SIQA", "social_iqa", "acc", None, None),
    ("BoolQ", "boolq", "acc", None, None),
)
ACCURACY_COLUMNS = ("LMB. acc", "PIQA", "Hella.", "Wino.", "ARC-e", "ARC-c", "SIQA", "BoolQ")


def _reports(run: Path) -> Path:
    for sub in ("reports", "metrics"):
        if (run / sub).is_dir():
            return run / sub
    raise StageError(f"{run}: no reports/ (pipeline checkout) or metrics/ (release bundle)")


def _read(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise StageError(f"{path}: not valid JSON: {err}") from None
    return data if isinstance(data, dict) else {}


def table1_row(zeroshot: dict[str, Any]) -> dict[str, float | None]:
    row: dict[str, float | None] = {}
    for column, task, metric, stand_in, stand_metric in TABLE1:
        value = zeroshot.get(task, {}).get(metric)
        if value is None and stand_in is not None:
            value = zeroshot.get(stand_in, {}).get(stand_metric)
        row[column] = value
    accs = [row[c] for c in ACCURACY_COLUMNS if row[c] is not None]
    row["Avg. acc"] = sum(accs) / len(accs) if accs else None  # type: ignore[arg-type]
    return row


def table2_row(niah: dict[str, Any]) -> dict[str, float | None]:
    """``S-NIAH-k <length>`` columns from reports/niah.json (accuracy)."""
    row: dict[str, float | None] = {}
    for task in ("s_niah_1", "s_niah_2", "s_niah_3", "mk_niah"):
        for name, cell in sorted(
            niah.get(task, {}).items(), key=lambda kv: int(kv[0].removeprefix("len_"))
        ):
            label = task.upper().replace("_", "-")  # S-NIAH-1 ... MK-NIAH
            row[f"{label} {name.removeprefix('len_')}"] = cell.get("acc")
    return row


def _fmt(value: float | None, column: str) -> str:
    if value is None:
        return ""
    return f"{value:.2f}" if "ppl" in column else f"{100 * value:.1f}"


def render(rows: dict[str, dict[str, float | None]]) -> tuple[str, str]:
    """(Markdown, CSV) of rows keyed by run name; accuracies in %, perplexities as is;
    the CSV keeps the raw numbers."""
    columns: list[str] = []
    for row in rows.values():
        columns += [c for c in row if c not in columns]
    md = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        md.append(f"| {name} | " + " | ".join(_fmt(row.get(c), c) for c in columns) + " |")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["model", *columns])
    for name, row in rows.items():
        writer.writerow([name, *("" if row.get(c) is None else row[c] for c in columns)])
    return "\n".join(md) + "\n", buffer.getvalue()


def build_tables(runs: Sequence[Path], names: Sequence[str], out: Path) -> list[Path]:
    folders = [_reports(Path(run)) for run in runs]
    table1 = {n: table1_row(_read(f, "zeroshot.json")) for n, f in zip(names, folders, strict=True)}
    table2 = {n: table2_row(_read(f, "niah.json")) for n, f in zip(names, folders, strict=True)}
    written = []
    for stem, rows in (("table1", table1), ("table2", table2)):
        md, text = render(rows)
        for suffix, body in ((".md", md), (".csv", text)):
            atomic_write_text(out / f"{stem}{suffix}", body)
            written.append(out / f"{stem}{suffix}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hope.report.tables",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--names", help="comma-separated row names (default: folder names)")
    parser.add_argument("--out", type=Path, default=Path("reports/tables"))
    args = parser.parse_args(argv)
    names = args.names.split(",") if args.names else [Path(r).resolve().name for r in args.runs]
    try:
        if len(names) != len(args.runs):
            raise StageError(f"--names gives {len(names)} names for {len(args.runs)} runs")
        for path in build_tables(args.runs, names, args.out):
            print(path)
    except StageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

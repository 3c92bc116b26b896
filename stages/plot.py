"""python stages/plot.py [--params params.yaml]

Draw reports/plots/{loss,passkey,lr}.png from reports/train_log.tsv and
reports/eval.json (deterministic PNGs: same numbers, same bytes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config

REPORT_DIR = Path("reports")


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.report.plots import make_plots

    paths = make_plots(REPORT_DIR / "train_log.tsv", REPORT_DIR / "eval.json", REPORT_DIR / "plots")
    print("plot: " + ", ".join(str(p) for p in paths))


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT_DIR,))


if __name__ == "__main__":
    raise SystemExit(main())

"""python stages/continual.py [--params params.yaml] [--set continual.segments=[json,email] ...]

Continual learning in the fast state (hope.eval.continual): the latest checkpoint in
models/checkpoints memorises continual.segments in order (standard-library packages'
docstrings, tokenised with data/tokenizer/spm.model); every segment's held-out loss
after each: reports/continual.json (loss matrix, forgetting, backward transfer,
memorised delta), reports/continual_meta.json, reports/continual.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config
from hope.io import write_metrics
from hope.report import headline

CKPT_DIR = Path("models/checkpoints")
TOKENIZER_MODEL = Path("data/tokenizer/spm.model")
REPORT = Path("reports/continual.json")
PLOT = Path("reports/continual.png")


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.eval.continual import run_continual
    from hope.report.plots import plot_continual

    metrics, records = run_continual(
        cfg.continual, cfg.memorize, CKPT_DIR, TOKENIZER_MODEL, cfg.train
    )
    write_metrics(REPORT, metrics, records, headline.continual(metrics))
    plot_continual(cfg.continual.segments, metrics, PLOT)
    print(
        f"continual: BWT {metrics['bwt']:+.4f}, mean forgetting {metrics['mean_forgetting']:.4f}; "
        f"memorised delta {metrics['memorised_delta']}"
    )


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT.parent,))


if __name__ == "__main__":
    raise SystemExit(main())

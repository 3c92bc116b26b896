"""python stages/niah.py [--params params.yaml] [--set niah.lengths=[256,512] ...]

Needle in a haystack (RULER-style S-NIAH-1/2/3 and multi-key, hope.eval.niah) on the
latest checkpoint in models/checkpoints, haystacks from data/raw/val.jsonl, over
niah.lengths x niah.depths: reports/niah.json (accuracy per task, length and depth,
with a 95% interval and chance), reports/niah_meta.json, reports/niah_heatmap.png.
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
RAW_VAL = Path("data/raw/val.jsonl")
REPORT = Path("reports/niah.json")
HEATMAP = Path("reports/niah_heatmap.png")


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.eval.niah import run_niah
    from hope.report.plots import plot_niah

    metrics, records = run_niah(
        cfg.niah, CKPT_DIR, TOKENIZER_MODEL, RAW_VAL, cfg.train, cfg.memorize
    )
    write_metrics(REPORT, metrics, records, headline.niah(metrics))
    plot_niah({k: v for k, v in metrics.items() if k != "step"}, HEATMAP)
    for task in cfg.niah.tasks:
        accs = ", ".join(
            f"{n} {row['acc']:.2f}"
            + (f" (memorised {row['adaptive_acc']:.2f})" if "adaptive_acc" in row else "")
            for n, row in metrics[task].items()
        )
        print(f"niah {task} (chance {1 / cfg.niah.candidates:.2f}): {accs}")


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT.parent,))


if __name__ == "__main__":
    raise SystemExit(main())

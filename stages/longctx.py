"""python stages/longctx.py [--params params.yaml] [--set longctx.length=2048 ...]

Long-context perplexity by position (the PG-19 protocol, hope.eval.longctx) of the
latest checkpoint in models/checkpoints: long sequences from data/raw/val.jsonl (or
longctx.hf_name) read through the model's state beyond the training context:
reports/longctx.json (loss, perplexity, loss per position bucket, streamed and in
fresh windows of the training context; the largest fast-weight norm),
reports/longctx_meta.json, reports/longctx.png (loss vs position).
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
REPORT = Path("reports/longctx.json")
PLOT = Path("reports/longctx.png")


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.eval.longctx import run_longctx
    from hope.report.plots import plot_longctx

    metrics, records = run_longctx(
        cfg.longctx, CKPT_DIR, TOKENIZER_MODEL, RAW_VAL, cfg.train, cfg.memorize
    )
    write_metrics(REPORT, metrics, records, headline.longctx(metrics))
    curves = {
        "streamed (state carried)": metrics["by_position"],
        "fresh windows": metrics["fresh_by_position"],
    }
    if "adaptive_by_position" in metrics:
        curves["streamed, memorised"] = metrics["adaptive_by_position"]
    plot_longctx(curves, records["trained_context"], PLOT)
    print(
        f"longctx: loss {metrics['loss']} streamed, {metrics['fresh_loss']} in fresh windows "
        f"over {metrics['tokens']} tokens (gain {metrics['stream_gain']}); max fast-weight "
        f"norm {metrics['fast_weight_norm_max']}"
    )


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT.parent,))


if __name__ == "__main__":
    raise SystemExit(main())

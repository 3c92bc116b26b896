"""python stages/eval.py [--params params.yaml] [--set eval.passkey_lengths=[64,128] ...]

Evaluate the latest checkpoint in models/checkpoints on the val split of
data/shards (validation loss, perplexity, unigram baseline, bits per byte when
the tokenizer recorded byte counts) and on synthetic passkey retrieval built
with data/tokenizer/spm.model: reports/eval.json (numbers), reports/eval_meta.json
(variant, runtime) and reports/eval_config.yaml.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config, save_config
from hope.io import split_records, write_metrics
from hope.report import headline

CKPT_DIR = Path("models/checkpoints")
SHARD_DIR = Path("data/shards")
TOKENIZER_MODEL = Path("data/tokenizer/spm.model")
REPORT_DIR = Path("reports")
RECORDS = ("variant", "runtime")  # to eval_meta.json: eval.json holds numbers only


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.eval.run import evaluate

    metrics = evaluate(cfg, CKPT_DIR, SHARD_DIR, TOKENIZER_MODEL)
    numbers, records = split_records(metrics, RECORDS)
    write_metrics(REPORT_DIR / "eval.json", numbers, records, headline.evaluation(numbers))
    save_config(cfg, REPORT_DIR / "eval_config.yaml")
    passkey = ", ".join(f"{k} {v['acc']:.2f}" for k, v in metrics["passkey"].items())
    print(
        f"eval: step {metrics['step']} val_loss {metrics['val']['loss']:.4f} "
        f"over {metrics['val']['tokens']} tokens "
        f"(ppl {metrics['val']['ppl']:.1f}); passkey acc {passkey}"
    )


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT_DIR,))


if __name__ == "__main__":
    raise SystemExit(main())

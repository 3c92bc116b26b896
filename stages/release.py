"""python stages/release.py [--params params.yaml] | python stages/release.py --verify release

Build release/ from the latest checkpoint in models/checkpoints, the tokenizer
in data/tokenizer, reports/{train,eval}.json and dvc.lock: safetensors weights,
tokenizer.model, config.yaml, metrics/, environment.json, a README.md model card
and a sha256 MANIFEST. With --verify DIR, re-hash DIR against its MANIFEST and
exit non-zero naming every changed, missing or unlisted file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config
from hope.errors import StageError

CKPT_DIR = Path("models/checkpoints")
TOKENIZER_DIR = Path("data/tokenizer")
REPORT_DIR = Path("reports")
RELEASE_DIR = Path("release")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verify", metavar="DIR", help="check an existing bundle instead of building one"
    )


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.report.bundle import build_bundle, verify_bundle

    if args.verify is None:
        out = build_bundle(cfg, CKPT_DIR, TOKENIZER_DIR, REPORT_DIR, RELEASE_DIR)
        args.verify = str(out)
    problems = verify_bundle(args.verify)
    if problems:
        for problem in problems:
            print(problem)
        raise StageError(f"{args.verify}: {len(problems)} problem(s)")
    count = sum(1 for line in (Path(args.verify) / "MANIFEST").read_text().splitlines() if line)
    print(f"ok: {count} files verified")


def main() -> int:
    return run_stage(__doc__, body, extra_args=add_args)


if __name__ == "__main__":
    raise SystemExit(main())

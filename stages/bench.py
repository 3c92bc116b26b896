"""python stages/bench.py [--params params.yaml] [--set bench.steps=5 ...]

Time one full training step (forward, backward, AdamW) of every variant in
bench.variants at the bench.shapes (tiny, smoke, pilot_chunks) on seeded random
tokens: tokens/s, step time, peak memory, host syncs and kernel launches per step,
parameters, estimated FLOPs per token and MFU, each relative to the transformer,
plus the machine they ran on:
reports/bench.json (a DVC metric; compare runs with `dvc metrics diff`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config

REPORT = Path("reports/bench.json")


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.bench.run import run_bench

    report = run_bench(cfg, REPORT)
    for shape in cfg.bench.shapes:
        for variant, row in report[shape].items():
            print(
                f"bench {shape}/{variant}: {row['tokens_per_s']:.0f} tokens/s, "
                f"{row['step_ms']:.1f} ms/step, {row['host_syncs_per_step']} syncs/step, "
                f"x{row['relative_to_transformer'] or float('nan'):.3f} of transformer"
            )
    for shape, skipped in report["skipped"].items():
        for variant, reason in skipped.items():
            print(f"bench {shape}/{variant}: skipped ({reason})")
    print(f"bench: {report['wall_s']:.1f} s in all; wrote {REPORT}")


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT.parent,))


if __name__ == "__main__":
    raise SystemExit(main())

"""Run logging: per-step TSV (rewritten atomically), optional wandb, a progress bar."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hope.config import Config
from hope.io import atomic_write_text

COLUMNS = ("step", "train_loss", "val_subset_loss", "lr", "tokens", "tokens_per_s")
WANDB_DIR = Path(".wandb")  # gitignored; wandb writes its offline runs here


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_tsv(rows: list[dict[str, Any]]) -> str:
    lines = ["\t".join(COLUMNS)]
    lines += ["\t".join(_cell(row.get(col)) for col in COLUMNS) for row in rows]
    return "\n".join(lines) + "\n"


def write_tsv(report_dir: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write_text(Path(report_dir) / "train_log.tsv", format_tsv(rows))


class TrainLogger:
    """Appends to the run's log rows (earlier segments included, for resumes)."""

    def __init__(
        self, cfg: Config, report_dir: Path, rows: list[dict[str, Any]], start_step: int
    ) -> None:
        self.report_dir = Path(report_dir)
        self.rows = rows  # shared with the trainer, which checkpoints them
        mode = cfg.train.wandb_mode
        if os.environ.get("WANDB_MODE") == "disabled":
            mode = "disabled"
        self.wandb_run: Any = None
        if mode != "disabled":
            import wandb

            WANDB_DIR.mkdir(parents=True, exist_ok=True)
            self.wandb_run = wandb.init(
                mode=mode, project=cfg.train.wandb_project, config=cfg.to_dict(), dir=WANDB_DIR
            )
        self.bar = tqdm(
            total=cfg.train.steps,
            initial=start_step,
            desc="train",
            unit="step",
            disable=not sys.stderr.isatty(),
        )

    def advance(self) -> None:
        self.bar.update(1)

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        write_tsv(self.report_dir, self.rows)
        postfix = {k: row[k] for k in ("train_loss", "val_subset_loss") if row.get(k) is not None}
        self.bar.set_postfix(tok_s=f"{row['tokens_per_s']:.0f}", **postfix)
        if self.wandb_run is not None:
            values = {k: v for k, v in row.items() if k != "step" and v is not None}
            self.wandb_run.log(values, step=row["step"])

    def close(self) -> None:
        self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


class SilentLogger:
    """The logger of a non-zero rank: rank 0 alone writes logs, bars and wandb runs."""

    def advance(self) -> None:
        pass

    def log(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

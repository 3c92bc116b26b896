"""Report figures: loss and learning rate against step, passkey accuracy per length.

Agg backend, fixed size and dpi, no software/date metadata: the same inputs give
byte-identical PNGs, so DVC sees a plot change only when the numbers change.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from hope.errors import StageError  # noqa: E402
from hope.io import atomic_write  # noqa: E402

FIGSIZE = (6.0, 4.0)
DPI = 100
LOG_COLUMNS = ("step", "train_loss", "val_subset_loss", "lr")
# "Software" would embed the matplotlib version; PNGs from savefig carry no date.
PNG_METADATA: dict[str, Any] = {"Software": None}


def read_train_log(path: Path) -> dict[str, list[float | None]]:
    """Columns of ``train_log.tsv`` as floats (None for empty cells, e.g. steps without val)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise StageError(f"training log {path} not found; run `python stages/train.py`") from None
    rows = list(csv.DictReader(text.splitlines(), delimiter="\t"))
    header = text.splitlines()[0].split("\t") if text.strip() else []
    missing = [c for c in LOG_COLUMNS if c not in header]
    if missing:
        raise StageError(f"{path}: missing column(s) {', '.join(missing)}")
    columns: dict[str, list[float | None]] = {c: [] for c in header}
    for number, row in enumerate(rows, 2):
        for col in header:
            cell = (row.get(col) or "").strip()
            try:
                columns[col].append(float(cell) if cell else None)
            except ValueError:
                raise StageError(f"{path} line {number}: {col}={cell!r} is not a number") from None
    return columns


def read_eval(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise StageError(f"eval report {path} not found; run `python stages/eval.py`") from None
    except json.JSONDecodeError as err:
        raise StageError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("passkey"), dict):
        raise StageError(f"{path}: expected an object with a 'passkey' section")
    return data


def _pairs(
    xs: Sequence[float | None], ys: Sequence[float | None]
) -> tuple[list[float], list[float]]:
    kept = [(x, y) for x, y in zip(xs, ys, strict=True) if x is not None and y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def _save(fig: Figure, path: Path) -> None:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI, metadata=PNG_METADATA))
    plt.close(fig)


def plot_loss(log: Mapping[str, Sequence[float | None]], path: Path, title: str = "") -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(*_pairs(log["step"], log["train_loss"]), label="train", linewidth=1.2)
    val_steps, val_loss = _pairs(log["step"], log["val_subset_loss"])
    if val_steps:
        ax.plot(val_steps, val_loss, "o-", label="val (subset)", linewidth=1.2, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def plot_lr(log: Mapping[str, Sequence[float | None]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(*_pairs(log["step"], log["lr"]), linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("learning-rate schedule")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def _length_of(name: str) -> int:
    try:
        return int(name.removeprefix("len_"))
    except ValueError:
        raise StageError(f"eval.json passkey entry {name!r} is not named len_<tokens>") from None


def plot_passkey(passkey: Mapping[str, Mapping[str, float]], path: Path, title: str = "") -> None:
    names = sorted(passkey, key=_length_of)
    accs = [passkey[n]["acc"] for n in names]
    fig, ax = plt.subplots(figsize=FIGSIZE)
    positions = list(range(len(names)))
    ax.bar(positions, accs, color="tab:blue", width=0.6, label="accuracy")
    chances = {passkey[n]["chance"] for n in names}
    for chance in sorted(chances):
        ax.axhline(
            chance, color="tab:red", linestyle="--", linewidth=1.0, label=f"chance {chance:.2f}"
        )
    ax.set_xticks(positions, [str(_length_of(n)) for n in names])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("passkey accuracy")
    ax.set_ylim(0.0, 1.05)
    ax.set_title(title or "passkey retrieval")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def make_plots(train_log: Path, eval_json: Path, out_dir: Path) -> list[Path]:
    """Read both reports first (so a missing one fails before anything is written), then plot."""
    log = read_train_log(train_log)
    evaluation = read_eval(eval_json)
    out_dir = Path(out_dir)
    variant = str(evaluation.get("variant", ""))
    paths = [out_dir / "loss.png", out_dir / "passkey.png", out_dir / "lr.png"]
    plot_loss(log, paths[0], f"loss ({variant})" if variant else "")
    plot_passkey(
        evaluation["passkey"], paths[1], f"passkey retrieval ({variant})" if variant else ""
    )
    plot_lr(log, paths[2])
    return paths


def plot_niah(report: Mapping[str, Mapping[str, Mapping[str, float]]], path: Path) -> None:
    """One length x depth accuracy heatmap per NIAH task (reports/niah.json's layout)."""
    tasks = sorted(report)
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.0), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        rows = sorted(report[task], key=_length_of)
        depths = sorted(
            {k for row in report[task].values() for k in row if k.startswith("depth_")},
            key=lambda k: float(k.removeprefix("depth_")),
        )
        grid = [[report[task][r][d] for d in depths] for r in rows]
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(depths)), [d.removeprefix("depth_") for d in depths])
        ax.set_yticks(range(len(rows)), [str(_length_of(r)) for r in rows])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context tokens")
        ax.set_title(task)
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white")
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
    _save(fig, path)


def plot_longctx(
    curves: Mapping[str, Mapping[str, float | None]], trained_context: int, path: Path
) -> None:
    """Mean next-token loss by position (reports/longctx.json), one line per read
    (streamed, fresh windows, memorised), the training context marked; a null bucket
    (diverged) is left out."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for label, curve in curves.items():
        points = sorted((int(s), v) for s, v in curve.items() if v is not None)
        xs, ys = [s for s, _ in points], [v for _, v in points]
        ax.plot(xs, ys, marker="o", linewidth=1.2, label=label)
    ax.axvline(trained_context, color="grey", linestyle="--", label="training context")
    ax.set_xlabel("position (bucket start, tokens)")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend()
    _save(fig, path)


def plot_continual(names: Sequence[str], metrics: Mapping[str, Any], path: Path) -> None:
    """Forgetting curves: each segment's held-out loss from a fresh state, then after
    each segment is written (reports/continual.json)."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    after = list(metrics["after"].values())
    xs = list(range(len(after) + 1))
    for name in names:
        ys = [metrics["base"][name], *(row[name] for row in after)]
        ax.plot(xs, ys, marker="o", linewidth=1.2, label=name)
    ax.set_xticks(xs, ["fresh", *(f"+{n}" for n in names)])
    ax.set_xlabel("segments memorised")
    ax.set_ylabel("held-out loss (nats)")
    ax.legend()
    _save(fig, path)

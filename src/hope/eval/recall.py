"""Multi-query associative recall (MQAR; Zoology, Arora et al. 2023), trained and scored.

Every sequence of ``seq_len + 1`` tokens starts with ``num_pairs`` key-value pairs
``k1 v1 k2 v2 ...`` (distinct keys from [1, V/2), distinct values from [V/2, V)); the rest
is 0 except at ``num_pairs`` random even offsets, where each key appears once more
(in random order) followed by its value. The model reads ``seq[:-1]`` and must
predict, at every repeated key, the value bound to it earlier in the context: only
those positions are scored. Chance is 1 / num_pairs (guessing among the values in
the context); the papers' in-context recall claims need far more.

Each variant is a fresh small model (``recall.dim``, ``n_layers``, ``n_heads``,
``vocab_size``; every other knob from the ``model`` section) trained for
``recall.steps`` steps on freshly sampled sequences with the project's outer
optimizer and schedule, then scored on a fixed held-out set. The forward is
``forward_teach`` with the next-token targets, as in language-model training, so
the memories learn in context exactly as they do there; the loss is the
cross-entropy at the query positions only. The step has no host sync.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from hope.config import Config, OptimConfig, RecallConfig
from hope.errors import ConfigError
from hope.model.config import ModelConfig
from hope.model.lm import LanguageModel
from hope.model.zoo import build_model
from hope.optim.outer import build_optimizer
from hope.train.device import autocast_dtype, resolve_device, setup_runtime
from hope.train.schedule import build_scheduler
from hope.train.step import autocast, train_step

log = logging.getLogger("hope.recall")


@dataclasses.dataclass(frozen=True)
class RecallBatch:
    inputs: torch.Tensor  # [B, T] tokens the model reads
    targets: torch.Tensor  # [B, T] next tokens (the teach targets)
    query_mask: torch.Tensor  # [B, T] bool: positions holding a repeated key

    def to(self, device: torch.device) -> RecallBatch:
        return RecallBatch(*(t.to(device) for t in (self.inputs, self.targets, self.query_mask)))


def check_recall_config(recall: RecallConfig) -> None:
    """Refuse impossible MQAR settings before any work, naming the knob."""
    half = recall.vocab_size // 2
    checks = [
        (recall.num_pairs >= 1, f"recall.num_pairs={recall.num_pairs} must be >= 1"),
        (
            half - 1 >= recall.num_pairs and recall.vocab_size - half >= recall.num_pairs,
            f"recall.vocab_size={recall.vocab_size} leaves {half - 1} keys for "
            f"recall.num_pairs={recall.num_pairs} distinct keys",
        ),
        (
            recall.seq_len + 1 >= 4 * recall.num_pairs,
            f"recall.seq_len={recall.seq_len} is too short for recall.num_pairs="
            f"{recall.num_pairs} (needs >= {4 * recall.num_pairs - 1}: the pairs, then "
            "one key-value slot per query)",
        ),
        (recall.steps >= 1, f"recall.steps={recall.steps} must be >= 1"),
        (recall.batch_size >= 1, f"recall.batch_size={recall.batch_size} must be >= 1"),
        (recall.eval_sequences >= 1, "recall.eval_sequences must be >= 1"),
        (recall.eval_every >= 1, f"recall.eval_every={recall.eval_every} must be >= 1"),
        (recall.num_threads >= 1, f"recall.num_threads={recall.num_threads} must be >= 1"),
        (len(set(recall.variants)) == len(recall.variants), "recall.variants repeats a name"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def mqar_batch(
    batch_size: int, seq_len: int, num_pairs: int, vocab_size: int, generator: torch.Generator
) -> RecallBatch:
    """``batch_size`` MQAR sequences (module doc), drawn from ``generator`` (CPU)."""
    half = vocab_size // 2
    rows = torch.arange(batch_size).unsqueeze(1)
    # Distinct keys and distinct values per row (so guessing among the context's
    # values scores exactly 1/num_pairs): the first num_pairs of random permutations.
    keys = torch.rand(batch_size, half - 1, generator=generator).argsort(dim=1)[:, :num_pairs] + 1
    values = torch.rand(batch_size, vocab_size - half, generator=generator).argsort(dim=1)
    values = values[:, :num_pairs] + half
    seq = torch.zeros(batch_size, seq_len + 1, dtype=torch.long)
    seq[:, 0 : 2 * num_pairs : 2] = keys
    seq[:, 1 : 2 * num_pairs : 2] = values
    slots = (seq_len + 1 - 2 * num_pairs) // 2  # key-value slots after the context
    slot = torch.rand(batch_size, slots, generator=generator).argsort(dim=1)[:, :num_pairs]
    where = 2 * num_pairs + 2 * slot  # [B, N] positions of the repeated keys
    order = torch.rand(batch_size, num_pairs, generator=generator).argsort(dim=1)
    seq[rows, where] = keys.gather(1, order)
    seq[rows, where + 1] = values.gather(1, order)
    mask = torch.zeros(batch_size, seq_len + 1, dtype=torch.bool)
    mask[rows, where] = True
    return RecallBatch(seq[:, :-1], seq[:, 1:], mask[:, :-1])


def query_loss(logits: torch.Tensor, batch: RecallBatch) -> torch.Tensor:
    """Mean CE over the query positions; a weighted mean, so no host sync (no nonzero)."""
    work = torch.promote_types(logits.dtype, torch.float32)
    per_token = F.cross_entropy(
        logits.to(work).flatten(0, 1), batch.targets.flatten(), reduction="none"
    )
    weight = batch.query_mask.flatten().to(work)
    return (per_token * weight).sum() / weight.sum()


@torch.no_grad()
def recall_accuracy(model: LanguageModel, batch: RecallBatch) -> torch.Tensor:
    """Fraction of query positions whose argmax is the bound value (on device)."""
    was_training = model.training
    model.eval()
    logits, _ = model.forward_teach(batch.inputs, batch.targets)
    model.train(was_training)
    hit = (logits.argmax(dim=-1) == batch.targets) & batch.query_mask
    return hit.sum() / batch.query_mask.sum()


def recall_model_config(cfg: Config, variant: str) -> ModelConfig:
    """The ``model`` section at recall's shape, as ``variant``."""
    recall = cfg.recall
    shape = {
        "dim": recall.dim, "n_layers": recall.n_layers, "n_heads": recall.n_heads,
        "vocab_size": recall.vocab_size,
    }  # fmt: skip
    return dataclasses.replace(cfg.model, variant=variant, **shape)  # type: ignore[arg-type]


def train_recall(cfg: Config, variant: str) -> dict[str, Any]:
    """Train and score one variant (module doc); the row of ``reports/recall.json``."""
    recall = cfg.recall
    device = resolve_device(cfg.train.device)
    # The train section's numerics (device, precision, determinism), recall's seed/threads.
    runtime = dataclasses.replace(cfg.train, seed=recall.seed, num_threads=recall.num_threads)
    setup_runtime(runtime, device)
    amp_dtype = autocast_dtype(device, cfg.train.precision)
    model = build_model(recall_model_config(cfg, variant)).to(device)
    model.train()
    optim_cfg = OptimConfig(lr=recall.lr, warmup_steps=min(25, recall.steps // 10))
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, recall.steps)
    train_gen = torch.Generator().manual_seed(recall.seed)
    held_out = mqar_batch(
        recall.eval_sequences, recall.seq_len, recall.num_pairs, recall.vocab_size,
        torch.Generator().manual_seed(recall.seed + 1_000_003),
    ).to(device)  # fmt: skip

    curve: list[tuple[int, torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    started = time.perf_counter()
    for step in range(1, recall.steps + 1):
        batch = mqar_batch(
            recall.batch_size, recall.seq_len, recall.num_pairs, recall.vocab_size, train_gen
        ).to(device)

        def loss_fn(x: torch.Tensor, y: torch.Tensor, batch: RecallBatch = batch) -> torch.Tensor:
            return query_loss(model.forward_teach(x, y)[0], batch)

        losses.append(
            train_step(
                model,
                optimizer,
                scheduler,
                batch.inputs,
                batch.targets,
                optim_cfg.grad_clip,
                amp_dtype,
                loss_fn,
            )  # fmt: skip
        )
        if step % recall.eval_every == 0 or step == recall.steps:
            with autocast(device, amp_dtype):
                curve.append((step, recall_accuracy(model, held_out)))
    seconds = time.perf_counter() - started
    # One host transfer for the whole run (the loop above never syncs).
    accs = torch.stack([acc for _, acc in curve]).tolist()
    final_loss = float(torch.stack(losses[-10:]).mean())
    if not math.isfinite(final_loss):
        raise RuntimeError(f"recall: {variant} reached a non-finite loss")
    accuracy = accs[-1]
    queries = recall.eval_sequences * recall.num_pairs
    half_width = 1.96 * math.sqrt(max(accuracy * (1 - accuracy), 1e-12) / queries)
    log.info("recall %s: accuracy %.3f after %d steps (%.0f s)", variant, accuracy, step, seconds)
    return {
        "accuracy": accuracy,
        "accuracy_ci95_low": max(0.0, accuracy - half_width),
        "accuracy_ci95_high": min(1.0, accuracy + half_width),
        "chance": 1.0 / recall.num_pairs,
        "final_query_loss": final_loss,
        "curve": [[s, a] for (s, _), a in zip(curve, accs, strict=True)],
        "params": model.num_parameters(),
        "train_seconds": seconds,
    }


def run_recall(cfg: Config) -> dict[str, Any]:
    """Every ``recall.variants`` entry, trained and scored; the ``reports/recall.json`` body."""
    from hope.model.zoo import VARIANTS

    check_recall_config(cfg.recall)
    unknown = [v for v in cfg.recall.variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(
            f"recall.variants: unknown variant {unknown[0]!r}; available: {', '.join(VARIANTS)}"
        )
    rows = {variant: train_recall(cfg, variant) for variant in cfg.recall.variants}
    return {"variants": rows, "config": dataclasses.asdict(cfg.recall)}


def split_recall_report(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, records): ``reports/recall.json`` holds one row of numbers per variant;
    the accuracy curves and the recall config go to ``recall_meta.json``."""
    rows = report["variants"]
    metrics = {
        "variants": {v: {k: x for k, x in r.items() if k != "curve"} for v, r in rows.items()}
    }
    records = {"config": report["config"], "curves": {v: r["curve"] for v, r in rows.items()}}
    return metrics, records

"""The training loop: AdamW + warmup/cosine, periodic validation, resumable checkpoints.

Batches are a pure function of ``(train.seed, step)``, and the checkpoint carries
model, optimizer, scheduler, RNG state, log rows and the partial log interval, so
an interrupted run that resumes ends with exactly the metrics of an uninterrupted one.
Host syncs happen only at log, validation and checkpoint steps.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from hope.config import Config, save_config
from hope.data.batches import eval_batches, random_batch
from hope.data.shards import ShardedTokens, load_split
from hope.errors import StageError
from hope.io import headline_path, meta_path, split_records, write_metrics
from hope.model.zoo import build_model
from hope.optim.outer import build_optimizer
from hope.report import headline
from hope.train import checkpoint as ckpt
from hope.train import distributed as dist_env
from hope.train import graphed, state_dicts
from hope.train.device import autocast_dtype, resolve_device, runtime_record, setup_runtime, upload
from hope.train.guard import NonFiniteWatch, RunLock, divergence_error
from hope.train.logger import SilentLogger, TrainLogger, write_tsv
from hope.train.schedule import build_scheduler, current_lr
from hope.train.step import evaluate_loss, rank_share_sums, train_step

log = logging.getLogger("hope.train")


class Trainer:
    """One run: builds everything from ``cfg``, resumes if a matching checkpoint exists."""

    def __init__(
        self,
        cfg: Config,
        train_tokens: ShardedTokens,
        val_tokens: ShardedTokens,
        ckpt_dir: Path,
        report_dir: Path,
    ) -> None:
        self.cfg, self.ckpt_dir, self.report_dir = cfg, Path(ckpt_dir), Path(report_dir)
        self.train_tokens = train_tokens
        self.env = dist_env.from_environment()
        dist_env.check_world(cfg, self.env)
        self.device = dist_env.device_for(self.env, resolve_device(cfg.train.device))
        setup_runtime(cfg.train, self.device)
        self.amp_dtype = autocast_dtype(self.device, cfg.train.precision)
        self.model = build_model(cfg.model).to(self.device)
        block_dtype = torch.bfloat16 if cfg.train.fsdp_param_dtype == "bf16" else None
        self.ddp = dist_env.wrap(self.model, self.env, self.device, cfg.train.parallel, block_dtype)
        self.by_name = cfg.train.parallel == "fsdp"  # checkpoint layout (state_dicts)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        # One optimizer step on this rank's rows (x, y); the loop steps the scheduler.
        self.run_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = functools.partial(
            train_step, self.model, self.optimizer, None, grad_clip=cfg.optim.grad_clip,
            amp_dtype=self.amp_dtype, micro_batch=cfg.train.micro_batch_size, ddp=self.ddp,
            skip_nonfinite=cfg.train.nan_policy == "skip",
        )  # fmt: skip
        if cfg.train.cuda_graph:  # refused off CUDA here, before any step
            self.run_step = graphed.CapturedStep(self.run_step, self.optimizer, self.device)
        self.fingerprint = ckpt.config_fingerprint(cfg)
        # What the run reads: shards (by their manifest) and tokenizer, train and val.
        self.data_digest = hashlib.sha256(
            f"{train_tokens.digest}:{val_tokens.digest}".encode()
        ).hexdigest()[:16]
        seq_len, batch = cfg.data.seq_len, cfg.train.batch_size
        self.val_batches = list(eval_batches(val_tokens, batch, seq_len, cfg.train.val_batches))
        if not self.val_batches:
            raise ValueError("validation split yields no batches: too few val tokens")
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_s = 0.0
        self.rows: list[dict[str, Any]] = []
        self.interval_loss = torch.zeros((), device=self.device)
        self.interval_steps = 0
        self.final_metrics: dict[str, Any] | None = None
        self.interval_start = time.perf_counter()
        self.rewinds = 0
        self.skipped = 0  # steps skipped in the run (train.nan_policy=skip)
        self.interval_skipped = 0
        self.watch = NonFiniteWatch(self.device, 0)
        self.params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]

    def restore_or_reset(self) -> None:
        found = ckpt.latest_intact(self.ckpt_dir, self.device)
        if found is None:
            return
        latest, payload = found
        changed = [
            f"{what} (checkpoint {payload.get(key)}, now {mine})"
            for what, key, mine in (
                ("config", "fingerprint", self.fingerprint),
                ("training data: shards or tokenizer", "data_digest", self.data_digest),
            )
            if payload.get(key) != mine
        ]
        if changed:
            # Never mixing runs, never deleting one: the old run's checkpoints and
            # reports move aside before this run writes anything of its own.
            aside = ckpt.aside_path(self.ckpt_dir, payload)
            log.warning(
                "%s changed since %s: starting fresh; the earlier run's checkpoints and "
                "reports are kept in %s (delete it when no longer needed)",
                " and ".join(changed), latest.name, aside,
            )  # fmt: skip
            if self.env.is_main:
                ckpt.set_aside(self.ckpt_dir, aside, reports=self.reports())
            return
        self.restore(payload)
        log.info("resuming from step %d (%s)", self.step, latest.name)

    def restore(self, payload: dict[str, Any]) -> None:
        state_dicts.load(self.model, self.optimizer, payload, self.by_name, self.plain_copy)
        self.scheduler.load_state_dict(payload["scheduler"])
        if isinstance(self.run_step, graphed.CapturedStep):  # new tensors: capture again
            self.run_step.reset()
        ckpt.restore_rng_state(payload["rng"])
        self.step, self.tokens_seen = int(payload["step"]), int(payload["tokens_seen"])
        self.elapsed_s = float(payload["elapsed_s"])
        self.rows[:] = payload["log_rows"]  # in place: the logger shares this list
        self.interval_loss = payload["interval_loss"].to(self.device)
        self.interval_steps = int(payload["interval_steps"])
        self.final_metrics = payload.get("metrics")
        self.rewinds = int(payload.get("nan_rewinds", 0))
        self.skipped = int(payload.get("nan_skipped", 0))
        self.interval_skipped = int(payload.get("interval_skipped", 0))
        self.watch.reset(self.step)

    def on_nonfinite(self, what: str = "non-finite loss", span: str | None = None) -> None:
        """``what`` went wrong in ``span`` (default: the steps since the last verified
        one): stop, or rewind to the newest intact checkpoint (all saved with finite
        losses; under ``rewind`` the run's initial state is one) with a lower rate."""
        cfg = self.cfg.train
        span = span or f"steps {self.watch.verified_step + 1}..{self.step}"
        found = ckpt.latest_intact(self.ckpt_dir, self.device)
        if cfg.nan_policy == "rewind" and found is not None and self.rewinds < cfg.nan_max_rewinds:
            self.rewind(span, what, *found)
            return
        kept = found[0].name if found else None
        raise divergence_error(what, span, cfg.nan_policy, self.rewinds, kept)

    def rewind(self, span: str, what: str, path: Path, payload: dict[str, Any]) -> None:
        """Back to the checkpoint ``payload`` (at ``path``) with the learning rate times
        ``train.nan_lr_factor``."""
        cfg = self.cfg.train
        rewinds = self.rewinds + 1
        self.restore(payload)
        self.rewinds = rewinds
        factor = cfg.nan_lr_factor
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        log.warning(
            "%s in %s: rewinding to %s with the learning rate x%g (rewind %d of %d)",
            what, span, path.name, factor, rewinds, cfg.nan_max_rewinds,
        )  # fmt: skip

    def on_skipped(self, count: int) -> None:
        """``count`` steps since the last verified one were skipped (no update)."""
        cfg = self.cfg.train
        self.skipped += count
        self.interval_skipped += count
        span = f"steps {self.watch.verified_step + 1}..{self.step}"
        if self.skipped > cfg.nan_max_skips:
            raise StageError(
                f"train: {self.skipped} steps skipped for non-finite gradients, more than "
                f"train.nan_max_skips={cfg.nan_max_skips} (last in {span}); lower optim.lr"
            )
        log.warning(
            "non-finite gradients: skipped %d step(s) in %s without updating (%d of at most "
            "%d in the run)", count, span, self.skipped, cfg.nan_max_skips,
        )  # fmt: skip
        self.watch.reset(self.step)

    def save(self) -> None:
        keep = self.cfg.train.keep_checkpoints
        if self.cfg.train.checkpoint_format == "sharded":  # every rank writes its shards
            state = self.train_state() if self.env.is_main else None
            ckpt.save_sharded(self.ckpt_dir, self.step, self.model, self.optimizer, state, keep)
            return
        # Every rank: under FSDP gathering the shards is a collective.
        model_sd, optim_sd = state_dicts.gather(self.model, self.optimizer, self.by_name)
        if self.env.is_main:  # rank 0 holds the whole state
            payload = {"model": model_sd, "optimizer": optim_sd, **self.train_state()}
            payload["optimizer_layout"] = state_dicts.layout(self.by_name)
            ckpt.save_checkpoint(self.ckpt_dir, self.step, payload, keep)

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the model and optimizer (rank 0's)."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt.capture_rng_state(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            # Includes the open log interval, so a resumed run's tokens/s stays honest.
            "elapsed_s": self.elapsed_s + (time.perf_counter() - self.interval_start),
            "log_rows": self.rows,
            "interval_loss": self.interval_loss.detach().cpu(),
            "interval_steps": self.interval_steps,
            "metrics": self.final_metrics,
            "config": self.cfg.to_dict(),
            "fingerprint": self.fingerprint,
            "data_digest": self.data_digest,
            "nan_rewinds": self.rewinds,
            "nan_skipped": self.skipped,
            "interval_skipped": self.interval_skipped,
        }

    def run(self) -> dict[str, Any]:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        with RunLock(self.ckpt_dir) if self.env.is_main else contextlib.nullcontext():
            return self.run_locked()

    def run_locked(self) -> dict[str, Any]:
        if self.env.is_main:
            save_config(self.cfg, self.ckpt_dir / "config.yaml")
        self.restore_or_reset()
        if self.step == 0 and self.cfg.train.nan_policy == "rewind":
            self.save()  # the initial state: what a divergence before any checkpoint rewinds to
        if self.final_metrics is not None and self.step >= self.cfg.train.steps:
            log.info("all %d steps already done; rewriting reports", self.step)
            return self.write_reports(self.final_metrics)
        logger = (
            TrainLogger(self.cfg, self.report_dir, self.rows, self.step)
            if self.env.is_main
            else SilentLogger()
        )
        try:
            self.loop(logger)
        finally:
            logger.close()
        if self.final_metrics is None:  # train.steps == 0: report the initial model
            row = self.log_row(False, True, 0.0, time.perf_counter(), 0)
            self.final_metrics = self.metrics(row)
            self.save()
        return self.write_reports(self.final_metrics)

    def loop(self, logger: TrainLogger | SilentLogger) -> None:
        cfg = self.cfg.train
        tokens_per_step = cfg.batch_size * self.cfg.data.seq_len
        self.model.train()
        self.interval_start, interval_tokens = time.perf_counter(), 0
        skip = cfg.nan_policy == "skip"
        while self.step < cfg.steps:
            x, y = random_batch(
                self.train_tokens, cfg.batch_size, self.cfg.data.seq_len, cfg.seed, self.step
            )
            lr = current_lr(self.scheduler)  # a Python float: no sync
            rows = self.env.rows(cfg.batch_size)  # this rank's rows of the global batch
            x, y = (upload(t[rows], self.device) for t in (x, y))
            loss = self.run_step(x, y)
            self.scheduler.step()  # outside the step: a captured step replays it
            # A skipped step's loss is NaN: counted by the watch, not in the mean.
            self.interval_loss += loss.float().nan_to_num(0.0, 0.0, 0.0) if skip else loss.float()
            self.watch.observe(loss)
            self.interval_steps += 1
            self.step += 1
            self.tokens_seen += tokens_per_step
            interval_tokens += tokens_per_step
            logger.advance()
            last = self.step == cfg.steps
            is_log = self.step % cfg.log_every == 0 or last
            is_val = self.step % cfg.val_every == 0 or last
            is_ckpt = self.step % cfg.checkpoint_every == 0 or last
            if is_log or is_val or is_ckpt:  # verify before anything is logged or saved
                # Under skip a step with finite gradients may still leave inf weights.
                count, bad_weights = self.watch.total(self.env, self.params if skip else None)
                if bad_weights:
                    self.on_nonfinite("non-finite weight norms")
                if count and skip:
                    self.on_skipped(count)
                elif count:
                    self.on_nonfinite()
                    self.interval_start, interval_tokens = time.perf_counter(), 0
                    continue
                self.watch.reset(self.step)
            if is_log or is_val:
                row = self.log_row(is_log, is_val, lr, self.interval_start, interval_tokens)
                if is_val and not math.isfinite(row["val_subset_loss"]):  # diverged between steps
                    self.on_nonfinite("non-finite validation loss", f"step {self.step}")
                    self.interval_start, interval_tokens = time.perf_counter(), 0
                    continue
                self.elapsed_s += time.perf_counter() - self.interval_start
                self.interval_start, interval_tokens = time.perf_counter(), 0
                logger.log(row)
                if last:
                    self.final_metrics = self.metrics(row)
            if is_ckpt:
                self.save()

    def log_row(
        self, is_log: bool, is_val: bool, lr: float, interval_start: float, interval_tokens: int
    ) -> dict[str, Any]:
        """The only host syncs of the run: interval mean loss and validation loss."""
        train_loss = None
        if is_log:
            taken = self.interval_steps - self.interval_skipped
            mean = self.interval_loss / max(1, taken)  # this rank's rows
            world = self.env.world_size
            train_loss = (dist_env.all_reduce_sum(mean.clone(), self.env) / world).item()
            train_loss = train_loss if taken else None  # every step skipped
            self.interval_loss.zero_()
            self.interval_steps = self.interval_skipped = 0
        val_loss = self.validation_loss().item() if is_val else None
        seconds = max(time.perf_counter() - interval_start, 1e-9)
        return {
            "step": self.step,
            "train_loss": train_loss,
            "val_subset_loss": val_loss,
            "lr": lr,
            "tokens": self.tokens_seen,
            "tokens_per_s": interval_tokens / seconds,
        }

    def plain_copy(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A model and optimizer as one process builds them, on the CPU."""
        model = build_model(self.cfg.model)
        return model, build_optimizer(model, self.cfg.optim)

    def validation_loss(self) -> torch.Tensor:
        """Mean CE per target token over the validation batches; with several ranks each
        scores its share of every batch's rows and the sums are reduced."""
        micro = self.cfg.train.micro_batch_size
        if not self.env.enabled:
            return evaluate_loss(self.model, self.val_batches, self.device, self.amp_dtype, micro)
        compute = cast(Any, self.ddp) if dist_env.is_sharded(self.ddp) else None
        total = rank_share_sums(
            self.model, self.val_batches, self.env.rank, self.env.world_size, self.device,
            self.amp_dtype, micro, compute,
        )  # fmt: skip
        total = dist_env.all_reduce_sum(total, self.env)
        return total[0] / total[1]

    def metrics(self, last_row: dict[str, Any]) -> dict[str, Any]:
        val_loss = float(last_row["val_subset_loss"])  # train.val_batches windows of val
        return {
            "train_loss": last_row["train_loss"],
            "val_subset_loss": val_loss,
            "val_subset_ppl": math.exp(min(val_loss, 50.0)),
            "val_subset_tokens": sum(y.numel() for _, y in self.val_batches),
            "steps": self.step,
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": self.tokens_seen / max(self.elapsed_s, 1e-9),
            "wall_time_s": self.elapsed_s,
            "params": self.model.num_parameters(),
            "nan_skipped_steps": self.skipped,
            "nan_rewinds": self.rewinds,
            "runtime": runtime_record(self.cfg.train, self.device)
            | {"world_size": self.env.world_size},
        }

    def reports(self) -> list[Path]:
        """The files ``write_reports`` and the logger write."""
        out = self.report_dir / "train.json"
        return [out, meta_path(out), headline_path(out), out.with_name("train_log.tsv")]

    def write_reports(self, metrics: dict[str, Any]) -> dict[str, Any]:
        if self.env.is_main:
            write_tsv(self.report_dir, self.rows)
            numbers, runtime = split_records(metrics, ("runtime",))
            write_metrics(self.report_dir / "train.json", numbers, runtime, headline.train(numbers))
        return metrics


def run_training(
    cfg: Config,
    train_tokens: ShardedTokens,
    val_tokens: ShardedTokens,
    ckpt_dir: Path,
    report_dir: Path,
) -> dict[str, Any]:
    """Train on in-memory token streams; returns the final metrics (``write_reports``).
    Under torchrun (``WORLD_SIZE`` > 1) every rank calls this and they train as one."""
    env = dist_env.from_environment()
    device = dist_env.device_for(env, resolve_device(cfg.train.device))
    with dist_env.process_group(env, device):
        return Trainer(cfg, train_tokens, val_tokens, ckpt_dir, report_dir).run()


def train(
    cfg: Config, shard_dir: Path, tokenizer_model: Path | None, ckpt_dir: Path, report_dir: Path
) -> dict[str, Any]:
    """Load the train/val shards (checked against the tokenizer) and train."""
    train_tokens = load_split(shard_dir, "train", tokenizer_model)
    val_tokens = load_split(shard_dir, "val", tokenizer_model)
    return run_training(cfg, train_tokens, val_tokens, ckpt_dir, report_dir)

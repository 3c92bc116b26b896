"""Long-context perplexity by position, the PG-19 protocol.

Long token sequences (``longctx.length`` tokens each, ``longctx.sequences`` of them)
are read through the model's state in windows of ``longctx.window`` tokens (default:
the training context), carried from window to window, so every position's loss sees
everything before it and lengths far beyond the training context work
(hope.infer.position_losses, the teach pass). The report is the mean next-token loss
per position bucket (``longctx.bucket`` tokens): does loss keep falling with more
context, or rise past the training length?

Texts: ``longctx.source: val`` (offline default) takes the run's longest validation
documents, concatenated with EOS between them as training sees documents;
``hf`` reads ``longctx.hf_name`` (a HuggingFace dataset name, PG-19's test split by
default, or a local folder of data files) through ``datasets``, longest first too.

Adaptive (``longctx.memorize``): each window, once read and scored, is written into
the state by test-time memorisation as the ``memorize`` section says (paths, layers,
``steps`` passes, τ) before the next window is read: extra test-time learning on the
past only, so still causal. One pass writing every memory is the plain stream
exactly (tested); the report puts ``adaptive_loss``/``adaptive_by_position`` beside
the plain numbers. A sample is one sequence (fresh state each; carry is refused:
the sequences are read side by side).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hope.config import LongctxConfig, MemorizeParams, TrainConfig
from hope.errors import ConfigError, StageError
from hope.eval.memorizing import memorize_config, side_by_side
from hope.memory.fast_state import fast_weight_norms
from hope.model.lm import LanguageModel, LMState
from hope.model.memorize import MemorizeConfig, memorize

log = logging.getLogger("hope.eval")


def load_texts(cfg: LongctxConfig, raw_val: Path) -> list[str]:
    """Candidate documents: the validation texts, or ``hf_name``'s split."""
    if cfg.source == "val":
        from hope.data.download import iter_jsonl_texts

        return list(iter_jsonl_texts(raw_val))
    import datasets

    try:
        rows = datasets.load_dataset(cfg.hf_name, split=cfg.hf_split, streaming=True)
        texts = []
        for row in rows:
            if cfg.text_field not in row:
                raise ConfigError(
                    f"longctx.text_field: {cfg.hf_name} rows have no {cfg.text_field!r} "
                    f"(fields: {', '.join(sorted(row))})"
                )
            texts.append(str(row[cfg.text_field]))
            if len(texts) >= cfg.max_documents:
                break
    except (ConnectionError, FileNotFoundError) as err:
        raise StageError(
            f"longctx.hf_name={cfg.hf_name!r} could not be read ({type(err).__name__}: {err}); "
            "set longctx.source=val to use the run's validation text"
        ) from None
    return texts


def _finite(value: float) -> float | None:
    """JSON has no NaN/Inf: a non-finite number is reported as null (not measured)."""
    return value if math.isfinite(value) else None


def long_sequences(
    texts: Sequence[str], encode: Callable[[str], list[int]], eos: int, length: int, count: int
) -> torch.Tensor:
    """[count, length] token ids: the longest documents first, each followed by EOS,
    cut into consecutive sequences (no token used twice)."""
    order = sorted(range(len(texts)), key=lambda i: (-len(texts[i]), i))
    stream: list[int] = []
    for index in order:
        stream += [*encode(texts[index]), eos]
        if len(stream) >= length * count:
            break
    if len(stream) < length * count:
        raise StageError(
            f"longctx: the texts hold {len(stream)} tokens, fewer than longctx.sequences="
            f"{count} x longctx.length={length}; lower them or use longer texts"
        )
    return torch.tensor(stream[: length * count], dtype=torch.long).view(count, length)


def by_position(losses: torch.Tensor, bucket: int) -> dict[str, float]:
    """Mean loss of each ``bucket``-token span of positions (keyed by its first
    position) over every sequence; ``losses`` [B, T] (a position's loss predicts the
    next token). One host read."""
    width = losses.shape[1]
    starts = list(range(0, width, bucket))
    means = torch.stack([losses[:, s : s + bucket].mean() for s in starts]).tolist()
    return {str(s): m for s, m in zip(starts, means, strict=True)}


@torch.no_grad()
def memorised_position_losses(
    model: LanguageModel, tokens: torch.Tensor, window: int, mem: MemorizeConfig
) -> torch.Tensor:
    """As ``position_losses(stream=True)`` [B, T - 1], but the state carried to the
    next window is the one ``memorize`` leaves after writing the window just read
    (``mem``, in online chunks of ``window``; its last target is the next window's
    first token, as in the plain read)."""
    from hope.infer import position_losses

    mem = dataclasses.replace(mem, online_chunk_size=window, reset="carry_across_samples")

    def carry(span: torch.Tensor, before: LMState | None, targets: torch.Tensor) -> LMState:
        return memorize(model, span, before, mem, following=targets[:, -1])

    return position_losses(model, tokens, window, stream=True, carry=carry)


class NormRecorder:
    """``position_losses``' ``on_window`` hook: every memory's per-sample fast-weight
    norms (``fast_weight_norms``) after each window, kept on the device; ``table()``
    reads them once, as {memory: {tokens read: max over the samples}}."""

    def __init__(self) -> None:
        self.taken: list[tuple[int, dict[str, torch.Tensor]]] = []

    def __call__(self, tokens_read: int, state: LMState) -> None:
        self.taken.append((tokens_read, fast_weight_norms(state.blocks, "blocks")))

    def table(self) -> dict[str, dict[str, float | None]]:
        if not self.taken or not self.taken[0][1]:
            return {}
        names = list(self.taken[0][1])
        stacked = torch.stack(
            [torch.stack([norms[n].max() for n in names]) for _, norms in self.taken]
        )
        values = stacked.tolist()  # the one host read
        table: dict[str, dict[str, float | None]] = {n: {} for n in names}
        for (position, _), row in zip(self.taken, values, strict=True):
            for name, value in zip(names, row, strict=True):
                key, value = str(position), _finite(value)
                seen = table[name].get(key, value)
                both = value is not None and seen is not None
                table[name][key] = max(seen, value) if both else None  # type: ignore[type-var]
        return table


def streamed_beside_fresh(streamed: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    """The streamed report with the fresh-window one beside it (``fresh_loss``,
    ``fresh_by_position``) and ``stream_gain`` = fresh − streamed loss (> 0: carrying
    the state helps)."""
    out = {**streamed, "fresh_loss": fresh["loss"], "fresh_by_position": fresh["by_position"]}
    both = streamed["loss"] is not None and fresh["loss"] is not None
    out["stream_gain"] = fresh["loss"] - streamed["loss"] if both else None
    return out


def adaptive_config(
    cfg: LongctxConfig, params: MemorizeParams, model: LanguageModel
) -> MemorizeConfig | None:
    if not cfg.memorize:
        return None
    if params.reset == "carry_across_samples":
        raise ConfigError(
            "memorize.reset=carry_across_samples: longctx reads its sequences side by side, "
            "each from a fresh state (set memorize.reset to null or reset_per_sample)"
        )
    return memorize_config(params, "longctx", "reset_per_sample", model)


def report(losses: torch.Tensor, bucket: int) -> dict[str, Any]:
    """loss, ppl, by_position of [B, T - 1] losses (non-finite: null)."""
    loss = _finite(float(losses.mean()))
    return {
        "loss": loss,
        "ppl": None if loss is None else math.exp(min(loss, 50.0)),
        "by_position": {k: _finite(v) for k, v in by_position(losses, bucket).items()},
    }


def diverged_at(losses: torch.Tensor) -> int | None:
    from hope.infer import first_nonfinite_position

    diverged = first_nonfinite_position(losses)
    if diverged is not None:
        log.warning(
            "longctx: the loss is not finite from position %d on (the state read through "
            "the teach pass diverged); those buckets are reported as null", diverged,
        )  # fmt: skip
    return diverged


def run_longctx(
    cfg: LongctxConfig,
    ckpt_dir: Path,
    tokenizer_model: Path,
    raw_val: Path,
    train: TrainConfig,
    params: MemorizeParams | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``longctx`` stage: (metrics, records) for reports/longctx.json, _meta.json."""
    from hope.data.tokenizer import load_tokenizer
    from hope.infer import position_losses
    from hope.train.checkpoint import load_model
    from hope.train.device import autocast_dtype, configure_numerics, resolve_device
    from hope.train.step import autocast

    device = resolve_device(train.device)
    configure_numerics(train, device)
    model, ckpt_cfg, step = load_model(ckpt_dir, device)
    window = cfg.window or ckpt_cfg.data.seq_len
    if model.cfg.variant == "titans_mac" and window % model.cfg.titans_chunk:
        raise ConfigError(
            f"longctx.window={window} must be a multiple of model.titans_chunk="
            f"{model.cfg.titans_chunk} (titans_mac carries its state at segment boundaries)"
        )
    mem = adaptive_config(cfg, params or MemorizeParams(), model)
    sp = load_tokenizer(tokenizer_model)
    tokens = long_sequences(
        load_texts(cfg, raw_val), lambda t: list(sp.encode(t)), sp.eos_id(), cfg.length,
        cfg.sequences,
    )  # fmt: skip
    plain, fresh, adaptive = [], [], []
    norms = NormRecorder()
    with torch.no_grad(), autocast(device, autocast_dtype(device, train.precision)):
        for start in range(0, tokens.shape[0], cfg.batch_size):
            rows = tokens[start : start + cfg.batch_size].to(device)
            plain.append(position_losses(model, rows, window, stream=True, on_window=norms))
            fresh.append(position_losses(model, rows, window, stream=False))
            if mem is not None:
                adaptive.append(memorised_position_losses(model, rows, window, mem))
    losses = torch.cat(plain)
    metrics = {"step": step, "tokens": losses.numel(), **report(losses, cfg.bucket)}
    metrics = streamed_beside_fresh(metrics, report(torch.cat(fresh), cfg.bucket))
    if mem is not None:
        metrics = side_by_side(metrics, report(torch.cat(adaptive), cfg.bucket))
    by_memory = norms.table()
    every_norm = [v for row in by_memory.values() for v in row.values()]
    finite = every_norm and all(v is not None for v in every_norm)
    metrics["fast_weight_norm_max"] = max(every_norm) if finite else None  # type: ignore[type-var]
    records = {
        "first_nonfinite_position": diverged_at(losses),
        # Max over the sequences of each memory's fast-weight norm (Frobenius, per
        # sample) after each window of the stream (null: not finite).
        "fast_weight_norm_by_position": by_memory,
        "memorize": None if mem is None else dataclasses.asdict(mem),
        # The fresh windows are read in one call each (teach_pass: every write's teach
        # signal from the call-start weights, as in training); the stream in calls of
        # model.stream_call (HOPE: the fastest CMS period), every signal fresh.
        "cms_mode": ckpt_cfg.model.cms_mode,
        "variant": ckpt_cfg.model.variant,
        "trained_context": ckpt_cfg.data.seq_len,
        "window": window,
        "source": cfg.source if cfg.source == "val" else cfg.hf_name,
    }
    return metrics, records

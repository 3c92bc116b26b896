"""The eval stage's one library call: held-out perplexity plus passkey retrieval.

The model, its config and its step come from the checkpoint (the run that
trained it); the ``eval`` section and the device come from the current config.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from hope.config import Config
from hope.eval.passkey import evaluate_passkey
from hope.eval.perplexity import bits_per_byte, evaluate_perplexity
from hope.train.device import autocast_dtype, configure_numerics, resolve_device, runtime_record

log = logging.getLogger(__name__)


def val_bytes_per_token(tokenizer_dir: Path) -> float | None:
    """UTF-8 bytes per shard token of the val text, from the tokenizer's coverage.json.

    The tokenizer stage counts bytes, tokens and documents of (a prefix of) the val
    text. Shards add one EOS per document, which the loss also predicts, so the
    token count here is ``tokens + documents``. Without those counts bits per byte
    is skipped rather than guessed.
    """
    try:
        coverage = json.loads((tokenizer_dir / "coverage.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if not isinstance(coverage, dict):
        return None
    n_bytes, n_tokens, n_docs = (coverage.get(k) for k in ("bytes", "tokens", "documents"))
    if not (isinstance(n_bytes, int) and isinstance(n_tokens, int) and isinstance(n_docs, int)):
        return None
    stream_tokens = n_tokens + n_docs
    return n_bytes / stream_tokens if n_bytes > 0 and stream_tokens > 0 else None


def evaluate(
    cfg: Config, ckpt_dir: str | Path, shard_dir: str | Path, tokenizer_model: str | Path
) -> dict[str, Any]:
    """Evaluate the latest checkpoint in ``ckpt_dir``; returns the tree written to eval.json."""
    from hope.data.batches import eval_batches
    from hope.data.shards import load_split
    from hope.data.tokenizer import load_tokenizer
    from hope.train.checkpoint import load_model

    shard_dir, tokenizer_model = Path(shard_dir), Path(tokenizer_model)
    model, ckpt_cfg, step = load_model(Path(ckpt_dir))
    if ckpt_cfg.model != cfg.model:
        log.warning(
            "the checkpoint's model config differs from params; evaluating the checkpoint's"
        )
    # Eval runs with the numerics of the train section (device, precision, threads,
    # determinism): the same params give the same numbers under any orchestrator.
    device = resolve_device(cfg.train.device)
    configure_numerics(cfg.train, device)
    amp = autocast_dtype(device, cfg.train.precision)
    model.to(device)
    seq_len = ckpt_cfg.data.seq_len  # the context the model was trained on
    ev = cfg.eval

    val_tokens = load_split(shard_dir, "val", tokenizer_model=tokenizer_model)
    batches = eval_batches(val_tokens, ev.batch_size, seq_len, ev.max_batches)
    ppl = evaluate_perplexity(model, batches, device, amp)
    val: dict[str, Any] = ppl.as_dict()
    ratio = val_bytes_per_token(tokenizer_model.parent)
    if ratio is not None:
        val["bytes_per_token"] = ratio
        val["bpb"] = bits_per_byte(ppl.loss, ratio)
    log.info("val loss %.4f ppl %.2f over %d tokens", ppl.loss, ppl.ppl, ppl.tokens)

    sp = load_tokenizer(tokenizer_model)
    passkey = evaluate_passkey(
        model,
        lambda text: list(sp.encode(text)),
        ev.passkey_lengths,
        ev.passkey_trials,
        ev.passkey_candidates,
        ev.seed,
        ev.batch_size,
        device,
        amp,
    )
    for name, result in passkey.items():
        log.info("passkey %s acc %.3f (chance %.3f)", name, result["acc"], result["chance"])
    if not all(
        math.isfinite(v) for v in (ppl.loss, *(r["true_logprob"] for r in passkey.values()))
    ):
        log.warning("non-finite evaluation numbers: the checkpoint may have diverged")
    return {
        "val": val,
        "passkey": passkey,
        "step": step,
        "variant": ckpt_cfg.model.variant,
        "runtime": runtime_record(cfg.train, device),
    }

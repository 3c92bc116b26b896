"""The tokenizer stage: a sentencepiece model trained on ``data/raw/train.jsonl``.

Choices (all fixed here, the knobs are in ``cfg.tokenizer``):

- ids: ``unk=0, bos=1, eos=2, pad=3`` (``SPECIAL_IDS``); shards end every
  document with ``eos``.
- lossless: ``identity`` normalization, no whitespace collapsing, byte fallback
  (by default), so ``decode(encode(text)) == text`` -- newlines and indentation
  are tokens, which docstrings and code need.
- digits are split into single-digit pieces (as in Llama), whitespace-only
  pieces are allowed (indentation).
- byte-identical across runs: the trainer reads an in-memory iterator and writes
  through ``model_writer``, so no file path is embedded in the model, and
  ``num_threads`` is pinned by the config.
- documents are fed as whole-line chunks of at most ``max_sentence_length``
  bytes (a sentence holding newlines teaches the ``\\n`` pieces), in file order,
  up to ``MAX_TRAINING_CHARS`` characters.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from hope.config import TokenizerConfig
from hope.data.download import iter_jsonl_texts
from hope.errors import StageError
from hope.io import atomic_write, atomic_write_json, atomic_write_text, sha256_file

log = logging.getLogger(__name__)
SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
# Enough text for a 32K vocabulary; beyond this sentencepiece only spends memory.
MAX_TRAINING_CHARS = 200_000_000
# Coverage statistics are measured on the first this-many characters of val.
COVERAGE_MAX_CHARS = 4_000_000


def training_sentences(documents: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Split documents into chunks of whole lines, each at most ``max_bytes`` utf-8 bytes."""
    budget = MAX_TRAINING_CHARS
    for doc in documents:
        chunk: list[str] = []
        size = 0
        for line in doc.splitlines(keepends=True):
            encoded = len(line.encode("utf-8"))
            if size + encoded > max_bytes and chunk:
                yield "".join(chunk)
                chunk, size = [], 0
            while encoded > max_bytes:
                # One over-long line: hard cuts (4 bytes per char at most in utf-8).
                step = max_bytes // 4
                yield line[:step]
                line = line[step:]
                encoded = len(line.encode("utf-8"))
            chunk.append(line)
            size += encoded
        if chunk:
            yield "".join(chunk)
        budget -= len(doc)
        if budget <= 0:
            log.info("tokenizer: training text capped at %d characters", MAX_TRAINING_CHARS)
            return


def _trainer_options(cfg: TokenizerConfig) -> dict[str, Any]:
    return {
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "byte_fallback": cfg.byte_fallback,
        "character_coverage": cfg.character_coverage,
        "num_threads": cfg.num_threads,
        "max_sentence_length": cfg.max_sentence_length,
        **SPECIAL_IDS,
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "add_dummy_prefix": True,
        "split_digits": True,
        "allow_whitespace_only_pieces": True,
        "minloglevel": 1,
    }


def _vocab_text(sp: spm.SentencePieceProcessor) -> str:
    """``piece<TAB>score`` per id, like sentencepiece's own .vocab (\\n, \\t escaped)."""
    rows = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
        rows.append(f"{piece}\t{sp.get_score(i):g}")
    return "\n".join(rows) + "\n"


def train_tokenizer(
    tok_cfg: TokenizerConfig, train_jsonl: Path, out_dir: Path, val_jsonl: Path | None = None
) -> dict[str, Any]:
    """Train ``out_dir/spm.model`` (+ ``spm.vocab``); with ``val_jsonl`` also ``coverage.json``.

    Returns a summary: model sha256, vocab size, special ids, seconds, coverage.
    """
    if not Path(train_jsonl).is_file():
        raise StageError(f"{train_jsonl} not found; run `python stages/download.py` first")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = io.BytesIO()
    sentences = training_sentences(iter_jsonl_texts(Path(train_jsonl)), tok_cfg.max_sentence_length)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences, model_writer=model, **_trainer_options(tok_cfg)
        )
    except RuntimeError as err:
        message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        hint = "vocab_size" if "ocab" in message else "settings"
        raise StageError(
            f"sentencepiece could not train on {train_jsonl} with tokenizer.vocab_size="
            f"{tok_cfg.vocab_size} (check tokenizer.{hint}): {message}"
        ) from None
    model_path = out_dir / "spm.model"
    blob = model.getvalue()

    def write_model(tmp: Path) -> None:
        tmp.write_bytes(blob)

    atomic_write(model_path, write_model)
    sp = load_tokenizer(model_path)
    atomic_write_text(out_dir / "spm.vocab", _vocab_text(sp))
    summary: dict[str, Any] = {
        "model_sha256": sha256_file(model_path),
        "vocab_size": sp.get_piece_size(),
        "model_type": tok_cfg.model_type,
        **SPECIAL_IDS,
        "train_seconds": round(time.perf_counter() - started, 3),
    }
    if val_jsonl is not None:
        coverage = measure_coverage(sp, iter_jsonl_texts(Path(val_jsonl)))
        coverage["model_sha256"] = summary["model_sha256"]
        atomic_write_json(out_dir / "coverage.json", coverage)
        summary["coverage"] = coverage
    log.info("tokenizer: %s", summary)
    return summary


def load_tokenizer(model_path: Path) -> spm.SentencePieceProcessor:
    """Load a trained model; a missing or unreadable file is a StageError naming it."""
    model_path = Path(model_path)
    if not model_path.is_file():
        raise StageError(f"tokenizer {model_path} not found; run `python stages/tokenizer.py`")
    sp = spm.SentencePieceProcessor()
    try:
        sp.load(str(model_path))
    except (RuntimeError, OSError) as err:
        raise StageError(f"tokenizer {model_path} is corrupt: {err}") from None
    if sp.eos_id() < 0:
        raise StageError(f"tokenizer {model_path} has no EOS id; retrain it")
    return sp


def _fallback_chars(sp: spm.SentencePieceProcessor, ids: np.ndarray, is_byte: np.ndarray) -> int:
    """Characters spelled by byte-fallback runs in ``ids`` (one decode per run, not per token)."""
    mask = is_byte[ids]
    if not mask.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    starts, ends = edges[0::2], edges[1::2]
    return sum(len(sp.decode(ids[s:e].tolist())) for s, e in zip(starts, ends, strict=True))


def _unk_chars(sp: spm.SentencePieceProcessor, text: str) -> int:
    return sum(
        len(p.surface) for p in sp.encode(text, out_type="proto").pieces if p.id == sp.unk_id()
    )


def measure_coverage(sp: spm.SentencePieceProcessor, documents: Iterable[str]) -> dict[str, Any]:
    """How well ``sp`` fits held-out text (first ``COVERAGE_MAX_CHARS`` characters).

    ``char_coverage``: fraction of characters encoded by ordinary pieces, i.e.
    neither through byte fallback nor as ``<unk>``.
    """
    is_byte = np.array([sp.is_byte(i) for i in range(sp.get_piece_size())], dtype=bool)
    docs = chars = utf8_bytes = tokens = unk = byte_tokens = uncovered = 0
    for text in documents:
        ids = np.asarray(sp.encode(text), dtype=np.int64)
        docs += 1
        chars += len(text)
        utf8_bytes += len(text.encode("utf-8"))
        tokens += ids.size
        n_unk = int((ids == sp.unk_id()).sum())
        unk += n_unk
        byte_tokens += int(is_byte[ids].sum())
        uncovered += _fallback_chars(sp, ids, is_byte)
        if n_unk:
            uncovered += _unk_chars(sp, text)
        if chars >= COVERAGE_MAX_CHARS:
            break
    if tokens == 0:
        return {"documents": 0, "chars": 0, "tokens": 0}
    return {
        "documents": docs,
        "chars": chars,
        "bytes": utf8_bytes,
        "tokens": tokens,
        "char_coverage": 1.0 - uncovered / chars,
        "tokens_per_char": tokens / chars,
        "bytes_per_token": utf8_bytes / tokens,
        "unk_rate": unk / tokens,
        "byte_fallback_rate": byte_tokens / tokens,
    }

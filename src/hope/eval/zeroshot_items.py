"""Offline zero-shot items, built deterministically from the run's validation texts.

The paper's Table 1 tasks (LAMBADA, HellaSwag, WikiText...) need the HuggingFace hub.
So that ``dvc repro`` runs the real lm-eval harness with no network, the ``zeroshot``
stage writes three item files in the same three shapes, from ``data/raw/val.jsonl``,
and the task YAMLs in ``configs/lm_eval/`` read them:

- ``hope_cloze`` (LAMBADA's shape): a passage of ``cloze_words`` words; predict its last
  word (alphabetic, >= 3 letters). Accuracy (greedy match) and perplexity.
- ``hope_choice`` (HellaSwag's shape): the first ``choice_words`` words of a passage;
  choose its true next ``choice_words`` words among 4, the others taken from other
  documents. Accuracy and length-normalised accuracy (chance 0.25).
- ``hope_rolling`` (WikiText's shape): whole documents; word/byte perplexity, bits
  per byte.

The same seed and texts give byte-identical files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hope.errors import StageError
from hope.io import atomic_write_text

TASKS = ("hope_cloze", "hope_choice", "hope_rolling")
CHOICES = 4


def _words(texts: Sequence[str]) -> list[list[str]]:
    return [text.split() for text in texts]


def cloze_items(texts: Sequence[str], count: int, words: int, seed: int) -> list[dict[str, Any]]:
    """Passages of ``words`` words whose last word is alphabetic, >= 3 letters."""
    rng = random.Random(seed)
    candidates = [
        (d, end)
        for d, doc in enumerate(_words(texts))
        for end in range(words - 1, len(doc), words)
        if doc[end].isalpha() and len(doc[end]) >= 3
    ]
    rng.shuffle(candidates)
    docs = _words(texts)
    items = []
    for d, end in sorted(candidates[:count]):
        passage = docs[d][end - words + 1 : end + 1]
        items.append({"context": " ".join(passage[:-1]), "target": passage[-1]})
    return items


def choice_items(texts: Sequence[str], count: int, words: int, seed: int) -> list[dict[str, Any]]:
    """A context of ``words`` words, its true continuation and 3 from other documents."""
    rng = random.Random(seed)
    docs = _words(texts)
    spans = [
        (d, s) for d, doc in enumerate(docs) for s in range(0, len(doc) - 2 * words, 2 * words)
    ]
    if len({d for d, _ in spans}) < CHOICES:
        return []
    rng.shuffle(spans)
    items = []
    for d, start in sorted(spans[:count]):
        context = docs[d][start : start + words]
        others = [(o, s) for o, s in spans if o != d]
        picks = rng.sample(others, CHOICES - 1)
        endings = [" ".join(docs[o][s + words : s + 2 * words]) for o, s in picks]
        label = rng.randrange(CHOICES)
        endings.insert(label, " ".join(docs[d][start + words : start + 2 * words]))
        items.append({"context": " ".join(context), "choices": endings, "label": label})
    return items


def rolling_items(texts: Sequence[str], count: int) -> list[dict[str, Any]]:
    """The first ``count`` non-empty documents, whole."""
    return [{"text": text} for text in texts if text.strip()][:count]


def write_items(
    texts: Sequence[str], out_dir: Path, count: int, seed: int, cloze_words: int, choice_words: int
) -> dict[str, int]:
    """Write ``<task>.jsonl`` for every offline task; returns the item count of each."""
    built = {
        "hope_cloze": cloze_items(texts, count, cloze_words, seed),
        "hope_choice": choice_items(texts, count, choice_words, seed + 1),
        "hope_rolling": rolling_items(texts, count),
    }
    for task, items in built.items():
        if not items:
            raise StageError(
                f"zeroshot: the validation texts yield no {task} items (too few or too short "
                "documents); lower zeroshot.cloze_words/choice_words or use more data"
            )
        lines = "".join(json.dumps(item, sort_keys=True) + "\n" for item in items)
        atomic_write_text(out_dir / f"{task}.jsonl", lines)
    return {task: len(items) for task, items in built.items()}

"""The lm-eval adapter's adaptive scoring: each document's context written into the fast
state by test-time memorisation before its continuations are scored.

A document (lm-eval's ``(task, doc_id)``; a multiple-choice document is one request per
choice, all sharing the context) is scored so: its context but the last token is
memorised (hope.model.memorize, the ``memorize`` section: paths, layers, ``steps``
passes, τ), then each continuation is read from that state after the context's last
token, in one teach pass as the plain scoring reads it. With one pass writing every
memory this is the plain score exactly (tested, float64); more passes or fewer
memories are what the adaptive numbers measure.

``reset``: ``reset_per_sample`` starts every document from a fresh state;
``carry_across_samples`` makes a task's documents one stream: after a document is
scored, its context (and, with ``use_correct_answer``, its correct continuation: the
stage knows each task's answers) is written into the carried state, so later documents
are read with earlier ones memorised (answers enter only after they are scored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from itertools import groupby

import torch

from hope.memory.fast_state import map_tensors
from hope.model.lm import LanguageModel, LMState
from hope.model.memorize import IGNORE_INDEX, MemorizeConfig, memorize
from hope.train.step import autocast

TokenPair = tuple[list[int], list[int]]  # (context ids, continuation ids)
DocKey = tuple[object, object]  # (task name, document id)
IsAnswer = Callable[[object], bool]  # lm-eval Instance -> is its continuation correct


@torch.no_grad()
def score_from(
    model: LanguageModel,
    context: list[int],
    continuations: Sequence[list[int]],
    state: LMState | None,
    amp: torch.dtype | None,
) -> list[tuple[float, bool]]:
    """(log-prob sum, greedy) of each continuation read after the context's last token
    from ``state`` (None: fresh), one batch, right padding (causal)."""
    width = max(len(c) for c in continuations)
    inputs = torch.zeros((len(continuations), width), dtype=torch.long)
    targets = torch.full((len(continuations), width), IGNORE_INDEX, dtype=torch.long)
    for row, cont in enumerate(continuations):
        inputs[row, : len(cont)] = torch.tensor([context[-1], *cont[:-1]])
        targets[row, : len(cont)] = torch.tensor(cont)
    inputs, targets = inputs.to(model.device), targets.to(model.device)
    if state is not None:  # B = 1: one row per continuation
        state = map_tensors(state, lambda t: t.repeat_interleave(len(continuations), 0))
    with autocast(model.device, amp):
        logits, _ = model.forward_teach(inputs, targets, state)
    logprobs = logits.double().log_softmax(-1)
    mask = targets != IGNORE_INDEX
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    sums = torch.where(mask, picked, 0.0).sum(-1)
    greedy = ((logprobs.argmax(-1) == targets) | ~mask).all(-1)
    return list(zip(sums.tolist(), greedy.tolist(), strict=True))  # one host read


def _write(
    model: LanguageModel,
    ids: list[int],
    state: LMState | None,
    mem: MemorizeConfig,
    amp: torch.dtype | None,
    following: int | None = None,
) -> LMState | None:
    if not ids:
        return state
    tokens = torch.tensor([ids], device=model.device)
    after = None if following is None else torch.tensor([following], device=model.device)
    with autocast(model.device, amp):
        return memorize(model, tokens, state, mem, following=after)


def score_documents(
    model: LanguageModel,
    pairs: Sequence[TokenPair],
    docs: Sequence[DocKey],
    answers: Sequence[bool],
    mem: MemorizeConfig,
    use_correct_answer: bool,
    amp: torch.dtype | None = None,
) -> list[tuple[float, bool]]:
    """Adaptive (log-prob, greedy) per pair, in the given order (lm-eval's: a task's
    documents in order, a document's requests together). ``answers[i]``: whether pair
    i's continuation is its document's correct one (used only to write it, carry)."""
    carry = mem.reset == "carry_across_samples"
    mem = dataclasses.replace(mem, reset="carry_across_samples")  # resets are done here
    results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    carried: LMState | None = None
    task = object()
    for doc, members in groupby(range(len(pairs)), key=lambda i: docs[i]):
        indices = list(members)
        if doc[0] != task:  # a task's documents are one stream
            task, carried = doc[0], None
        start = carried if carry else None
        for context, same in groupby(indices, key=lambda i: pairs[i][0]):
            rows = list(same)
            state = _write(model, context[:-1], start, mem, amp, following=context[-1])
            scores = score_from(model, context, [pairs[i][1] for i in rows], state, amp)
            for i, score in zip(rows, scores, strict=True):
                results[i] = score
        if carry:
            context = pairs[indices[0]][0]
            gold = [pairs[i][1] for i in indices if answers[i]][:1]
            written = context + (gold[0] if use_correct_answer and gold else [])
            carried = _write(model, written, carried, mem, amp)
    return results

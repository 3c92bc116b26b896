"""Synthetic passkey retrieval, scored by ranking candidate keys.

A prompt of exactly ``length`` tokens hides "The pass key is K. Remember it. K
is the pass key." at a random depth inside neutral filler and ends with "What
is the pass key? The pass key is". The model scores the continuation ``K``
against ``candidates - 1`` distractor keys with the same digit count by total
log-likelihood. A trial counts as a hit only when the true key scores strictly
above every distractor: ties are failures, so a model that cannot tell keys
apart (e.g. uniform logits) scores 0, never chance by luck of tie-breaking.

The key's token ids inside the prompt are the very ids that are scored as the
continuation (pieces are encoded separately and concatenated), so the task is
exact copying, whatever the tokenizer does with digits next to punctuation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hope.errors import ConfigError
from hope.model.lm import LanguageModel

Encode = Callable[[str], list[int]]

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. "
    "There and back again. The river runs past the old mill. A small boat "
    "drifts along the bank. Birds sing in the morning and rest at night. "
)
NEEDLE_HEAD = "The pass key is"
NEEDLE_MID = ". Remember it."
NEEDLE_TAIL = "is the pass key."
QUESTION = "What is the pass key? The pass key is"
KEY_DIGITS = 5


@dataclass(frozen=True)
class PasskeyTask:
    """Token ids for one length: N prompts of L tokens and C candidate keys each, true key first."""

    prompts: torch.Tensor  # [N, L] int64
    candidates: torch.Tensor  # [N, C, K] int64, candidate 0 is the true key
    candidate_mask: torch.Tensor  # [N, C, K] bool, False on right padding
    true_keys: list[int]


@dataclass(frozen=True)
class PasskeyResult:
    acc: float
    chance: float
    true_logprob: float  # mean over trials, nats, summed over the key's tokens

    def as_dict(self) -> dict[str, float]:
        return {"acc": self.acc, "chance": self.chance, "true_logprob": self.true_logprob}


def _tile(ids: list[int], length: int) -> list[int]:
    if length == 0:
        return []
    if not ids:
        raise ValueError("filler text encodes to no tokens")
    reps = -(-length // len(ids))
    return (ids * reps)[:length]


def _distinct_keys(rng: random.Random, count: int) -> list[int]:
    low, high = 10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS - 1
    return rng.sample(range(low, high + 1), count)


def build_prompt(encode: Encode, key_ids: list[int], length: int, depth: float) -> list[int]:
    """Exactly ``length`` ids: filler, the needle at fractional ``depth`` in [0, 1], question."""
    needle = encode(NEEDLE_HEAD) + key_ids + encode(NEEDLE_MID) + key_ids + encode(NEEDLE_TAIL)
    question = encode(QUESTION)
    n_filler = length - len(needle) - len(question)
    if n_filler < 0:
        raise ConfigError(
            f"eval.passkey_lengths: {length} tokens is too short for the passkey needle and "
            f"question ({len(needle) + len(question)} tokens)"
        )
    filler = _tile(encode(FILLER), n_filler)
    cut = round(depth * n_filler)
    return filler[:cut] + needle + filler[cut:] + question


def build_task(
    encode: Encode, length: int, trials: int, candidates: int, seed: int, pad_id: int = 0
) -> PasskeyTask:
    """``trials`` prompts of ``length`` tokens, each with ``candidates`` keys (true key first)."""
    if candidates < 2:
        raise ConfigError(f"eval.passkey_candidates must be >= 2, got {candidates}")
    if trials < 1:
        raise ConfigError(f"eval.passkey_trials must be >= 1, got {trials}")
    rng = random.Random(f"{seed}:{length}")  # one stream per length: adding a length moves no key
    prompts: list[list[int]] = []
    keys: list[list[list[int]]] = []
    true_keys: list[int] = []
    for _ in range(trials):
        trial_keys = _distinct_keys(rng, candidates)
        key_ids = [encode(str(k)) for k in trial_keys]
        prompts.append(build_prompt(encode, key_ids[0], length, rng.random()))
        keys.append(key_ids)
        true_keys.append(trial_keys[0])
    width = max(len(k) for trial in keys for k in trial)
    cand = torch.full((trials, candidates, width), pad_id, dtype=torch.long)
    mask = torch.zeros((trials, candidates, width), dtype=torch.bool)
    for i, trial in enumerate(keys):
        for c, ids in enumerate(trial):
            cand[i, c, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, c, : len(ids)] = True
    return PasskeyTask(torch.tensor(prompts, dtype=torch.long), cand, mask, true_keys)


def _continuation_logprob(
    model: LanguageModel,
    prompts: torch.Tensor,  # [R, L]
    cont: torch.Tensor,  # [R, K]
    mask: torch.Tensor,  # [R, K]
    autocast_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Sum of log p(cont_k | prompt, cont_<k) over unmasked k: [R]."""
    length = prompts.shape[1]
    # The last continuation token is only a target; right padding cannot leak
    # backwards because every model here is causal.
    inputs = torch.cat([prompts, cont[:, :-1]], dim=1)  # [R, L + K - 1]
    with torch.autocast(
        inputs.device.type,
        dtype=autocast_dtype or torch.float32,
        enabled=autocast_dtype is not None,
    ):
        # Memories that learn from in-context targets see the same causal
        # targets they would at training time; padding carries no target.
        targets = torch.cat([prompts[:, 1:], cont.masked_fill(~mask, -100)], dim=1)
        logits, _ = model.forward_teach(inputs, targets)  # [R, L + K - 1, V]
    logp = torch.log_softmax(logits[:, length - 1 :].float(), dim=-1)  # [R, K, V]
    token_logp = logp.gather(-1, cont.unsqueeze(-1)).squeeze(-1)  # [R, K]
    return (token_logp * mask).sum(dim=-1)


@torch.no_grad()  # not inference_mode: see hope.eval.perplexity
def score_task(
    model: LanguageModel,
    task: PasskeyTask,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> PasskeyResult:
    """Rank each trial's candidates; rows are (trial, candidate) pairs, ``batch_size`` at once."""
    trials, n_cand, _ = task.candidates.shape
    prompts = task.prompts.repeat_interleave(n_cand, dim=0)  # [N*C, L]
    cont = task.candidates.flatten(0, 1)  # [N*C, K]
    mask = task.candidate_mask.flatten(0, 1)
    scores = torch.empty(trials * n_cand, dtype=torch.float32, device=device)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, prompts.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            scores[rows] = _continuation_logprob(
                model,
                prompts[rows].to(device, non_blocking=True),
                cont[rows].to(device, non_blocking=True),
                mask[rows].to(device, non_blocking=True),
                autocast_dtype,
            )
    finally:
        model.train(was_training)
    scores = scores.view(trials, n_cand)
    hits = scores[:, 0] > scores[:, 1:].amax(dim=1)  # strict: ties are failures
    summary = torch.stack([hits.double().mean(), scores[:, 0].double().mean()]).cpu()
    acc, true_logprob = (float(v) for v in summary)  # the one host read
    return PasskeyResult(acc=acc, chance=1.0 / n_cand, true_logprob=true_logprob)


def evaluate_passkey(
    model: LanguageModel,
    encode: Encode,
    lengths: Sequence[int],
    trials: int,
    candidates: int,
    seed: int,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, dict[str, float]]:
    """``{"len_<L>": {"acc", "chance", "true_logprob"}}`` for each requested length."""
    results: dict[str, dict[str, float]] = {}
    for length in lengths:
        task = build_task(encode, length, trials, candidates, seed)
        result = score_task(model, task, batch_size, device, autocast_dtype)
        results[f"len_{length}"] = result.as_dict()
    return results

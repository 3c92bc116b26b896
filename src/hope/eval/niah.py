"""Needle in a haystack, RULER-style, scored by ranking candidate values.

Four tasks (RULER's single- and multi-key NIAH; Titans Table 2 reports S-NIAH-1/2/3):

- ``s_niah_1``: a number needle in repeated noise sentences (passkey-like);
- ``s_niah_2``: a number needle in essay text (the run's own validation documents);
- ``s_niah_3``: a UUID needle in essay text;
- ``mk_niah``: ``niah.needles`` number needles with distinct keys in essay text; the
  question asks for one of them, and the other needles' values are among the
  distractors (so reading *a* number from the context is not enough).

Each needle reads "One of the special magic {numbers|uuids} for {key} is: {value}."
and the prompt, of exactly ``length`` tokens, ends with "What is the special magic
{number|uuid} for {key} mentioned in the provided text? The special magic {number|uuid}
for {key} is:" (the answer prefix repeats the needle's "for {key} is:", so the key is
what tells one needle from another).
The model scores the true value against ``candidates - 1`` distractors of the same
form by total log-likelihood, in the same causal teach pass as every evaluator
(hope.eval.passkey.score_task); a hit needs the true value strictly above every
distractor, so a model that cannot see the context scores at most chance. The value's
token ids inside the prompt are the ids scored as the continuation (exact copying).
Accuracy per (task, length, depth) cell and per (task, length) with a Wilson 95%
interval.
"""

from __future__ import annotations

import dataclasses
import math
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hope.config import MemorizeParams, NiahConfig, TrainConfig
from hope.errors import ConfigError
from hope.eval.memorizing import memorize_config
from hope.eval.passkey import FILLER, Encode, PasskeyTask, score_task
from hope.memory.fast_state import map_tensors
from hope.model.lm import LanguageModel
from hope.model.memorize import MemorizeConfig, memorize
from hope.train.step import autocast

TASKS = ("s_niah_1", "s_niah_2", "s_niah_3", "mk_niah")
KEY_WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
    "juniper", "kestrel", "lantern", "meadow", "nickel", "orchid", "pepper", "quartz",
    "raven", "saffron", "thistle", "umber", "velvet", "willow", "yarrow", "zephyr",
)  # fmt: skip


@dataclass(frozen=True)
class TaskSpec:
    haystack: str  # "noise" or "essay"
    value: str  # "number" or "uuid"
    needles: int  # 1, or niah.needles for mk_niah


def task_spec(task: str, needles: int) -> TaskSpec:
    if task not in TASKS:
        raise ConfigError(f"niah.tasks: unknown task {task!r}; available: {', '.join(TASKS)}")
    return {
        "s_niah_1": TaskSpec("noise", "number", 1),
        "s_niah_2": TaskSpec("essay", "number", 1),
        "s_niah_3": TaskSpec("essay", "uuid", 1),
        "mk_niah": TaskSpec("essay", "number", needles),
    }[task]


def _value(rng: random.Random, kind: str) -> str:
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randrange(1_000_000, 10_000_000))


def _haystack(
    spec: TaskSpec, encode: Encode, essay: list[int], n: int, rng: random.Random
) -> list[int]:
    source = encode(FILLER) if spec.haystack == "noise" else essay
    if not source:
        raise ConfigError("niah: the haystack text encodes to no tokens")
    start = rng.randrange(len(source)) if spec.haystack == "essay" else 0
    reps = -(-(start + n) // len(source))
    return (source * reps)[start : start + n]


def build_prompt(
    spec: TaskSpec,
    encode: Encode,
    essay: list[int],
    length: int,
    depth: float,
    rng: random.Random,
    candidates: int,
) -> tuple[list[int], list[list[int]]]:
    """(prompt of exactly ``length`` ids, candidate value ids with the true one first)."""
    noun = "uuid" if spec.value == "uuid" else "number"
    keys = ["-".join(rng.sample(KEY_WORDS, 2)) for _ in range(spec.needles)]
    while len(set(keys)) < len(keys):
        keys = ["-".join(rng.sample(KEY_WORDS, 2)) for _ in range(spec.needles)]
    values: list[str] = []
    while len(values) < max(candidates, spec.needles):
        value = _value(rng, spec.value)
        values = values if value in values else [*values, value]
    value_ids = [encode(v) for v in values]
    needles = [
        encode(f" One of the special magic {noun}s for {key} is:") + value_ids[i] + encode(".")
        for i, key in enumerate(keys)
    ]
    question = encode(
        f" What is the special magic {noun} for {keys[0]} mentioned in the provided text? "
        f"The special magic {noun} for {keys[0]} is:"
    )
    n_hay = length - sum(map(len, needles)) - len(question)
    if n_hay < 0:
        raise ConfigError(
            f"niah.lengths: {length} tokens is too short for the needles and question "
            f"({length - n_hay} tokens)"
        )
    hay = _haystack(spec, encode, essay, n_hay, rng)
    cuts = [round(depth * n_hay)] + [rng.randrange(n_hay + 1) for _ in needles[1:]]
    pieces: list[list[int]] = []
    last = 0
    for cut, needle in sorted(zip(cuts, needles, strict=True), key=lambda p: p[0]):
        pieces += [hay[last:cut], needle]
        last = cut
    prompt = [t for piece in [*pieces, hay[last:], question] for t in piece]
    # Distractors: the other needles' values first (mk_niah), then random ones.
    return prompt, value_ids[:candidates]


def build_task(
    spec: TaskSpec,
    encode: Encode,
    essay: list[int],
    length: int,
    depth: float,
    trials: int,
    candidates: int,
    seed: str,
) -> PasskeyTask:
    rng = random.Random(seed)
    prompts, cands = [], []
    for _ in range(trials):
        prompt, values = build_prompt(spec, encode, essay, length, depth, rng, candidates)
        prompts.append(prompt)
        cands.append(values)
    width = max(len(v) for trial in cands for v in trial)
    cand = torch.zeros((trials, candidates, width), dtype=torch.long)
    mask = torch.zeros((trials, candidates, width), dtype=torch.bool)
    for i, trial in enumerate(cands):
        for c, ids in enumerate(trial):
            cand[i, c, : len(ids)] = torch.tensor(ids)
            mask[i, c, : len(ids)] = True
    return PasskeyTask(torch.tensor(prompts, dtype=torch.long), cand, mask, [0] * trials)


@torch.no_grad()
def memorized_scores(
    model: LanguageModel,
    task: PasskeyTask,
    mem: MemorizeConfig,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Candidate log-likelihoods [trials, C] when each prompt (all but its last token)
    is first written into the fast state by test-time memorisation (``mem``: paths,
    layers, steps, surprise gate), then the candidates are scored from that state: the
    last prompt token and the candidate in one teach pass, as ``score_task`` reads them
    after the prompt (one pass of online memorisation gives its scores exactly).
    ``mem.reset`` carry: the trials are one stream, each prompt memorised on top of the
    previous ones (batches of one trial)."""
    trials, n_cand, _ = task.candidates.shape
    scores = torch.empty(trials, n_cand, dtype=torch.float64, device=device)
    carry = mem.reset == "carry_across_samples"
    per_batch = 1 if carry else max(1, batch_size // n_cand)
    carried = None
    for start in range(0, trials, per_batch):
        rows = slice(start, start + per_batch)
        prompts = task.prompts[rows].to(device)
        with autocast(device, autocast_dtype):
            state = memorize(model, prompts[:, :-1], carried, mem, following=prompts[:, -1])
        carried = state if carry else None
        state = map_tensors(state, lambda t: t.repeat_interleave(n_cand, 0))
        cont = task.candidates[rows].flatten(0, 1).to(device)
        mask = task.candidate_mask[rows].flatten(0, 1).to(device)
        inputs = torch.cat([prompts[:, -1:].repeat_interleave(n_cand, 0), cont[:, :-1]], dim=1)
        with autocast(device, autocast_dtype):
            logits, _ = model.forward_teach(inputs, cont.masked_fill(~mask, -100), state)
        token = logits.double().log_softmax(-1).gather(-1, cont.unsqueeze(-1)).squeeze(-1)
        scores[rows] = (token * mask).sum(-1).view(-1, n_cand)
    return scores


def score_memorized(
    model: LanguageModel,
    task: PasskeyTask,
    mem: MemorizeConfig,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Accuracy of ``memorized_scores`` (strict: ties miss, as ``score_task``)."""
    scores = memorized_scores(model, task, mem, batch_size, device, autocast_dtype)
    hits = scores[:, 0] > scores[:, 1:].amax(dim=1)
    return float(hits.double().mean())  # the one host read


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion (exact-coverage-friendly at small n)."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate_niah(
    model: LanguageModel,
    encode: Encode,
    essay: list[int],
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    candidates: int,
    needles: int,
    seed: int,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    memorize_cfg: MemorizeConfig | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """``{task: {"len_<L>": {"acc", "acc_ci_low", "acc_ci_high", "chance",
    "depth_<d>": acc per depth}}}``; with ``memorize_cfg`` each length also gets
    ``adaptive_acc`` (the prompt memorised first, ``score_memorized``) and
    ``delta_acc`` = adaptive_acc - acc."""
    if candidates < 2 or trials < 1 or not depths or not lengths:
        raise ConfigError("niah: candidates must be >= 2, trials >= 1, lengths/depths non-empty")
    specs = {task: task_spec(task, needles) for task in tasks}
    for spec in specs.values():  # every prompt fits, before any scoring
        if spec.needles > candidates:
            raise ConfigError(f"niah.needles={needles} must be <= niah.candidates={candidates}")
        for length in lengths:
            build_prompt(spec, encode, essay, length, 0.0, random.Random(0), candidates)
    report: dict[str, dict[str, dict[str, float]]] = {}
    for task, spec in specs.items():
        for length in lengths:
            row: dict[str, float] = {}
            hits = adaptive_hits = 0
            for depth in depths:
                cell = build_task(
                    spec, encode, essay, length, depth, trials, candidates,
                    seed=f"{seed}:{task}:{length}:{depth}",
                )  # fmt: skip
                acc = score_task(model, cell, batch_size, device, autocast_dtype).acc
                row[f"depth_{depth:g}"] = acc
                hits += round(acc * trials)
                if memorize_cfg is not None:
                    adaptive = score_memorized(
                        model, cell, memorize_cfg, batch_size, device, autocast_dtype
                    )
                    adaptive_hits += round(adaptive * trials)
            n = trials * len(depths)
            low, high = wilson(hits, n)
            row.update(acc=hits / n, acc_ci_low=low, acc_ci_high=high, chance=1.0 / candidates)
            if memorize_cfg is not None:
                row.update(adaptive_acc=adaptive_hits / n, delta_acc=(adaptive_hits - hits) / n)
            report.setdefault(task, {})[f"len_{length}"] = row
    return report


def adaptive_config(
    cfg: NiahConfig, params: MemorizeParams, model: LanguageModel
) -> MemorizeConfig | None:
    """``niah.memorize``: the adaptive (memorise-then-ask) run as the ``memorize``
    section says (paths, layers, steps, τ; reset: per prompt unless carried)."""
    if not cfg.memorize:
        return None
    if model.cfg.variant == "titans_mac":
        raise ConfigError(
            "niah.memorize: titans_mac continues a state only at segment boundaries; "
            "memorise-then-ask is not defined for it here (set niah.memorize=false)"
        )
    return memorize_config(params, "niah", "reset_per_sample", model)


def run_niah(
    cfg: NiahConfig,
    ckpt_dir: Path,
    tokenizer_model: Path,
    raw_val: Path,
    train: TrainConfig,
    params: MemorizeParams | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``niah`` stage: the latest checkpoint, essay haystacks from the validation
    texts; (metrics, records) for reports/niah.json and niah_meta.json."""
    from hope.data.download import iter_jsonl_texts
    from hope.data.tokenizer import load_tokenizer
    from hope.train.checkpoint import load_model
    from hope.train.device import autocast_dtype, configure_numerics, resolve_device

    for task in cfg.tasks:
        task_spec(task, cfg.needles)  # names first, before any work
    device = resolve_device(train.device)
    configure_numerics(train, device)
    model, ckpt_cfg, step = load_model(ckpt_dir, device)
    sp = load_tokenizer(tokenizer_model)
    essay = list(sp.encode(" ".join(iter_jsonl_texts(raw_val))))
    mem = adaptive_config(cfg, params or MemorizeParams(), model)
    report = evaluate_niah(
        model, lambda text: list(sp.encode(text)), essay, cfg.tasks, cfg.lengths, cfg.depths,
        cfg.trials, cfg.candidates, cfg.needles, cfg.seed, cfg.batch_size, device,
        autocast_dtype(device, train.precision), mem,
    )  # fmt: skip
    records = {
        "variant": ckpt_cfg.model.variant,
        "trained_context": ckpt_cfg.data.seq_len,
        "memorize": None if mem is None else dataclasses.asdict(mem),
    }
    return {"step": step, **report}, records

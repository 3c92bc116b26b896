"""Our models inside the lm-evaluation-harness (``lm-eval`` on PyPI), under the name ``hope``.

    python -m hope.eval.harness --model_args pretrained=release --tasks lambada_openai
    python -m hope.eval.harness --model_args pretrained=models/checkpoints \\
        --tasks hope_cloze --include_path configs/lm_eval

Any other ``lm_eval`` flag passes through to lm-eval's own command line. From Python:
``import hope.eval.harness`` registers the model, then ``lm_eval.simple_evaluate(
model="hope", model_args="pretrained=release", tasks=[...])``; or hand it an instance,
``simple_evaluate(model=HopeHarnessLM("release"), ...)``.

How a request is scored: the context and continuation tokens are read in one causal
pass of ``forward_teach`` with in-context targets (every position's next token), as
the model trains and as the ``eval`` stage scores, so the memories' test-time writes
see the context as they do in training; the continuation's log-probabilities are read
from that pass. Every request starts from a fresh context (fast state reset). Inputs
longer than ``max_length`` (default: the training context, ``data.seq_len``) keep their
last ``max_length`` tokens; ``loglikelihood_rolling`` cuts a document into disjoint
windows of ``max_length`` (lm-eval's own window helper), each a fresh context.
``generate_until`` decodes greedily, carrying the state token by token (hope.infer).

Adaptive scoring (test-time memorisation, hope.eval.harness_memorize): give
``memorize_steps`` (>= 1; with ``memorize_paths`` as ``cms+smt``, ``memorize_layers``
as ``0+1``, ``memorize_reset``, ``memorize_surprise_threshold``) in ``model_args``, or
a ``MemorizeConfig`` from Python. It applies to ``loglikelihood`` requests (cloze and
multiple-choice tasks); rolling perplexity and generation are scored as without it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from hope.errors import StageError
from hope.eval.harness_memorize import IsAnswer, score_documents
from hope.infer import Decoder, load
from hope.model.memorize import IGNORE_INDEX, MemorizeConfig
from hope.train.device import autocast_dtype
from hope.train.step import autocast

TokenPair = tuple[list[int], list[int]]  # (context ids, continuation ids)


@register_model("hope")
class HopeHarnessLM(TemplateLM):
    """A release bundle or checkpoint directory (``pretrained``) as an lm-eval model."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        device: str = "cpu",
        batch_size: int | str = 8,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        max_batch_size: int | str | None = None,  # lm-eval passes it; batches are fixed
        precision: str = "fp32",  # as train.precision: fp32, bf16 or auto
        memorize: MemorizeConfig | None = None,
        use_correct_answer: bool = False,
        answer_of: IsAnswer | None = None,
        **memorize_args: str,
    ) -> None:
        super().__init__()
        self.memorize = memorize or memorize_from_args(memorize_args)
        if use_correct_answer and answer_of is None:
            raise StageError(
                "hope: use_correct_answer needs each request's answer (answer_of); "
                "python stages/zeroshot.py provides it from the tasks"
            )
        self.use_correct_answer, self.answer_of = use_correct_answer, answer_of
        self._instances: list[Any] | None = None
        if str(batch_size).startswith("auto"):
            raise StageError("hope: batch_size=auto is not supported; give a number")
        self.pretrained = pretrained
        device = device or "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise StageError(f"hope: device={device} but this torch sees no CUDA device")
        self.loaded = load(pretrained, tokenizer, device)
        self.model = self.loaded.model
        if precision not in ("fp32", "bf16", "auto"):
            raise StageError(f"hope: precision={precision!r} must be fp32, bf16 or auto")
        self.amp = autocast_dtype(self.model.device, precision)
        self.sp = self.loaded.tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.loaded.config.data.seq_len)
        self.max_gen_toks = int(max_gen_toks)
        if self.batch_size < 1 or self.max_length < 2:
            raise StageError(
                f"hope: batch_size={self.batch_size} must be >= 1 and "
                f"max_length={self.max_length} >= 2"
            )

    @property
    def eot_token_id(self) -> int:
        # Training documents are separated by EOS: it is what precedes a document start.
        return int(self.sp.eos_id())

    @property
    def tokenizer_name(self) -> str:
        return "hope-sentencepiece"

    @property
    def device(self) -> torch.device:
        return self.model.device

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **_: Any
    ) -> list[int]:
        return list(self.sp.encode(string))

    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        self._instances = requests  # adaptive scoring reads each request's document
        try:
            return super().loglikelihood(requests, disable_tqdm)
        finally:
            self._instances = None

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        if self.memorize is not None and self._instances is not None:
            docs = [(r.task_name, r.doc_id) for r in self._instances]
            answers = [bool(self.answer_of and self.answer_of(r)) for r in self._instances]
            results = score_documents(
                self.model, pairs, docs, answers, self.memorize, self.use_correct_answer, self.amp
            )
        else:
            results = self.score_pairs(pairs, disable_tqdm=kwargs.get("disable_tqdm", False))
        for (request, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", request, result)
        return results

    def score_pairs(
        self, pairs: Sequence[TokenPair], disable_tqdm: bool = True
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether greedy decoding gives it) per
        pair, in batches of similar length (longest first); one host read per batch."""
        for context, continuation in pairs:
            if not context or not continuation:
                raise ValueError("hope: a request needs a non-empty context and continuation")
        order = sorted(range(len(pairs)), key=lambda i: -sum(map(len, pairs[i])))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        starts = range(0, len(order), self.batch_size)
        for start in tqdm(starts, desc="hope: scoring", disable=disable_tqdm):
            batch = order[start : start + self.batch_size]
            for i, result in zip(batch, self._score_batch([pairs[i] for i in batch]), strict=True):
                results[i] = result
        return results

    @torch.no_grad()
    def _score_batch(self, pairs: Sequence[TokenPair]) -> list[tuple[float, bool]]:
        rows = [
            (context + continuation)[-(self.max_length + 1) :] for context, continuation in pairs
        ]
        width = max(len(row) for row in rows) - 1
        inputs = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for r, row in enumerate(rows):  # right padding: causal, so it never reaches a row
            inputs[r, : len(row) - 1] = torch.tensor(row[:-1])
            targets[r, : len(row) - 1] = torch.tensor(row[1:])
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with autocast(self.device, self.amp):
            logits, _ = self.model.forward_teach(inputs, targets)
        logprobs = logits.double().log_softmax(-1)
        picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        greedy = logprobs.argmax(-1) == targets
        mask = torch.zeros_like(targets, dtype=torch.bool)
        for r, (row, (_, continuation)) in enumerate(zip(rows, pairs, strict=True)):
            n = min(len(continuation), len(row) - 1)
            mask[r, len(row) - 1 - n : len(row) - 1] = True
        sums = torch.where(mask, picked, 0.0).sum(-1)
        all_greedy = (greedy | ~mask).all(-1)
        return list(zip(sums.tolist(), all_greedy.tolist(), strict=True))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[TokenPair] = []
        owner: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            ids = self.tok_encode(text)
            for window in get_rolling_token_windows(
                token_list=ids, prefix_token=self.eot_token_id,
                max_seq_len=self.max_length, context_len=1,
            ):  # fmt: skip
                windows.append(make_disjoint_window(window))
                owner.append(index)
        scores = self.score_pairs(windows, disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scores, strict=True):
            totals[index] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in tqdm(requests, desc="hope: generating", disable=disable_tqdm):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            text = self.greedy_until(context, until, limit)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs

    def greedy_until(self, context: str, until: Sequence[str], max_new_tokens: int) -> str:
        """Greedy continuation of ``context``, cut before the first ``until`` string."""
        ids = self.tok_encode(context)[-self.max_length :] or [self.eot_token_id]
        decoder = Decoder(self.model, None)
        with autocast(self.device, self.amp):
            decoder.feed(ids)
        new: list[int] = []
        text = ""
        for _ in range(max_new_tokens):
            assert decoder.logits is not None
            token = int(decoder.logits.argmax())  # the one host read per token
            if token == self.eot_token_id:
                break
            new.append(token)
            text = self.sp.decode(new)
            if any(stop in text for stop in until):
                break
            with autocast(self.device, self.amp):
                decoder.feed([token])
        cuts = [text.index(stop) for stop in until if stop in text]
        return text[: min(cuts)] if cuts else text


MEMORIZE_ARGS = ("steps", "paths", "layers", "reset", "surprise_threshold")


def memorize_from_args(args: dict[str, str]) -> MemorizeConfig | None:
    """``memorize_*`` model_args (strings, lists joined by ``+``) as a MemorizeConfig;
    None without ``memorize_steps`` (or with 0)."""
    known = {f"memorize_{name}" for name in MEMORIZE_ARGS}
    unknown = sorted(set(args) - known)
    if unknown:
        raise StageError(f"hope: unknown model_args key {unknown[0]!r}")
    steps = int(args.get("memorize_steps") or 0)
    if steps == 0:
        return None
    paths, layers = args.get("memorize_paths"), args.get("memorize_layers")
    tau = args.get("memorize_surprise_threshold")
    try:
        return MemorizeConfig(
            paths=None if paths is None else tuple(paths.split("+")),
            layers=None if layers is None else tuple(int(v) for v in layers.split("+")),
            surprise_threshold=None if tau is None else float(tau),
            steps=steps,
            reset=args.get("memorize_reset", "reset_per_sample"),  # type: ignore[arg-type]
        )
    except ValueError as err:
        raise StageError(f"hope: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line with ``--model hope`` filled in (the model is registered)."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if "--model" not in args and not any(a.startswith("--model=") for a in args):
        args = ["--model", "hope", *args]
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        # lm-eval's default is cuda; ours is the best device present (train.device auto).
        args += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    if args[0] not in ("run", "ls", "validate"):
        args = ["run", *args]
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except (StageError, ValueError, FileNotFoundError) as err:
        # Bad input (unknown task, missing model): one line, as every stage says it.
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

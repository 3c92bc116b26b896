"""Using a trained model: load it, generate, score text, memorise a document into the
fast state and keep that state in a file. The Python face of the ``hope`` command.

    import hope.infer as hi
    run = hi.load("release")                      # release bundle (or a checkpoint dir)
    print(hi.generate(run, "Once upon", max_new_tokens=32, seed=0).text)
    print(hi.score(run, open("notes.txt").read()))
    state = hi.memorize_text(run, open("doc.txt").read())
    hi.save_state(run, state, "doc.state.safetensors")

Decoding carries the recurrent state token by token (each memory keeps the partial
chunk it is in pending, attention its KV cache), so every new token costs O(1) memory
work and equals re-running the whole prefix (tests, float64, every variant).
``titans_mac`` continues a context only at segment boundaries: it keeps the state of
the last boundary and re-reads the tokens since (at most ``titans_chunk`` - 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F
import yaml
from safetensors import safe_open

from hope.config import Config, config_from_dict
from hope.data.tokenizer import load_tokenizer
from hope.errors import StageError
from hope.memory.fast_state import first_nonfinite, tensor_leaves
from hope.model.lm import LanguageModel, LMState
from hope.model.memorize import IGNORE_INDEX, MemorizeConfig, memorize_chunks, memorize_sequence
from hope.model.state_file import load_state_file, save_state_file
from hope.model.zoo import build_model
from hope.report.bundle import WEIGHTS, load_weights, verify_bundle

DEFAULT_TOKENIZER = Path("data/tokenizer/spm.model")


@dataclass
class Loaded:
    """A model ready for use, with its tokenizer and the config it was trained with."""

    model: LanguageModel
    tokenizer: spm.SentencePieceProcessor
    config: Config
    step: int | None = None  # the training step of the weights, when recorded


def load(
    path: str | Path,
    tokenizer: str | Path | None = None,
    device: str = "cpu",
    verify: bool = True,
) -> Loaded:
    """A release bundle (``model.safetensors`` + ``config.yaml`` + ``tokenizer.model``,
    checked against its MANIFEST) or a checkpoint directory (the latest checkpoint;
    tokenizer ``data/tokenizer/spm.model`` unless given). Nothing is unpickled."""
    root = Path(path)
    if (root / WEIGHTS).is_file():
        if verify and (problems := verify_bundle(root)):
            raise StageError(f"release bundle {root} fails verification: {'; '.join(problems)}")
        cfg = config_from_dict(yaml.safe_load((root / "config.yaml").read_text()))
        model = build_model(cfg.model)
        load_weights(model, root / WEIGHTS)
        with safe_open(str(root / WEIGHTS), framework="pt") as handle:
            recorded = (handle.metadata() or {}).get("hope.step")
        step = int(recorded) if recorded is not None else None
        tok_path = Path(tokenizer) if tokenizer else root / "tokenizer.model"
    elif root.is_dir():
        from hope.train.checkpoint import load_model

        model, cfg, step = load_model(root)
        tok_path = Path(tokenizer) if tokenizer else DEFAULT_TOKENIZER
    else:
        raise StageError(f"{root}: no release bundle or checkpoint directory there")
    sp = load_tokenizer(tok_path)
    if sp.get_piece_size() != model.cfg.vocab_size:
        raise StageError(
            f"tokenizer {tok_path} has {sp.get_piece_size()} pieces but the model "
            f"{model.cfg.vocab_size} (model.vocab_size): not the model's tokenizer"
        )
    model.to(device).eval()
    return Loaded(model, sp, cfg, step)


@dataclass
class Generation:
    text: str
    tokens: list[int]
    state: LMState


def _sample(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """One token id from logits [V]: greedy at temperature 0, else softmax(logits/T)
    restricted to the top_k largest (0 = all)."""
    if temperature <= 0:
        return int(logits.argmax())
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = F.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


class Decoder:
    """Feeds tokens one call at a time, carrying the state; ``logits`` [V] predicts the
    next token. Segment-bound models (titans_mac) re-read the open segment per token."""

    def __init__(self, model: LanguageModel, state: LMState | None = None) -> None:
        self.model = model
        self.segment = model.cfg.titans_chunk if model.cfg.variant == "titans_mac" else 1
        self.anchor = model.init_state(1) if state is None else state  # at a boundary
        if self.anchor.pos % self.segment:
            raise ValueError(
                f"titans_mac continues a state only at a multiple of model.titans_chunk="
                f"{self.segment}; this state is at position {self.anchor.pos}"
            )
        self.open: list[int] = []  # tokens since the anchor (< segment)
        self.logits: torch.Tensor | None = None
        self.state = self.anchor

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=self.model.device)

    @torch.no_grad()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids``; returns the logits [len(ids), V] they produce."""
        device = self.model.device
        tokens = self.open + ids
        whole = len(tokens) - len(tokens) % self.segment
        outputs = []
        if whole:
            logits, self.anchor = self.model(
                torch.tensor([tokens[:whole]], device=device), self.anchor
            )
            outputs.append(logits[0])
            self.state = self.anchor
        self.open = tokens[whole:]
        if self.open:
            logits, self.state = self.model(torch.tensor([self.open], device=device), self.anchor)
            outputs.append(logits[0])
        fed = torch.cat(outputs)[-len(ids) :] if ids else torch.empty(0)
        self.logits = fed[-1] if ids else self.logits
        return fed


def generate_ids(
    model: LanguageModel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
    state: LMState | None = None,
) -> tuple[list[int], LMState]:
    """Sample up to ``max_new_tokens`` ids after ``prompt`` (non-empty); stops after EOS."""
    if not prompt:
        raise ValueError("generate: the prompt encodes to no tokens")
    decoder = Decoder(model, state)
    decoder.feed(prompt)
    gen = torch.Generator().manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        assert decoder.logits is not None
        if not bool(torch.isfinite(decoder.logits).all()):
            raise StageError(f"non-finite next-token logits at position {decoder.state.pos}")
        token = _sample(decoder.logits, temperature, top_k, gen)
        new.append(token)
        if token == eos_id:
            break
        decoder.feed([token])
    return new, decoder.state


def generate(
    run: Loaded,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    state: LMState | None = None,
) -> Generation:
    """Continue ``prompt``; the same seed gives the same text."""
    ids, state = generate_ids(
        run.model, run.tokenizer.encode(prompt), max_new_tokens, temperature=temperature,
        top_k=top_k, seed=seed, eos_id=run.tokenizer.eos_id(), state=state,
    )  # fmt: skip
    return Generation(run.tokenizer.decode(ids), ids, state)


@dataclass(frozen=True)
class Score:
    loss: float  # mean next-token cross-entropy, nats
    ppl: float
    bits_per_byte: float
    tokens: int  # predicted tokens
    bytes: int  # UTF-8 bytes of the text

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


# (window tokens [B, W], state before the window, its targets [B, W]) -> next state
Carry = Callable[[torch.Tensor, LMState | None, torch.Tensor], LMState]


@torch.no_grad()
def position_losses(
    model: LanguageModel,
    tokens: torch.Tensor,
    window: int,
    stream: bool = False,
    carry: Carry | None = None,
    on_window: Callable[[int, LMState], None] | None = None,
) -> torch.Tensor:
    """Next-token CE (nats, float64) at every position of ``tokens`` [B, T] but the
    last: [B, T - 1], on the device (no host read). Read through ``forward_teach`` (as
    the model trains and is evaluated) in windows of ``window`` tokens: each a fresh
    context (default), or ``stream``: one context carried across the windows, so a
    position's loss sees everything before it (long context, test-time learning).
    ``carry(window_tokens, state_before, targets)``: with ``stream``, the state the next
    window starts from (default: the read's own), e.g. the window memorised again.
    ``on_window(tokens_read, state)``: called after each window with the state it left
    (e.g. to record fast-weight norms by position; outside a failure path it must not
    read the device).

    A stream reads each window in calls of at most ``model.stream_call`` tokens (HOPE:
    its fastest CMS period, so every write's teach signal is fresh; the fresh-window
    read stays one call per window, as in training)."""
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, :-1] = tokens[:, 1:]
    losses = []
    state: LMState | None = None
    call = (model.stream_call or window) if stream else window
    for start in range(0, tokens.shape[1], window):
        span = slice(start, start + window)
        before = state
        logits, state = read_window(model, tokens[:, span], targets[:, span], state, call)
        if stream and carry is not None:
            state = carry(tokens[:, span], before, targets[:, span])
        if on_window is not None:
            on_window(min(start + window, tokens.shape[1]), state)
        state = state if stream else None
        ce = F.cross_entropy(
            logits.double().transpose(1, 2), targets[:, span],
            ignore_index=IGNORE_INDEX, reduction="none",
        )  # fmt: skip
        losses.append(ce)
    return torch.cat(losses, dim=1)[:, :-1]


def first_nonfinite_position(losses: torch.Tensor) -> int | None:
    """The first position of ``position_losses``' [B, T - 1] whose loss is not finite in
    some row, or None (one host read: after a read, never inside one)."""
    bad = (~losses.isfinite()).any(0).nonzero()
    return int(bad[0]) if bad.numel() else None


def read_window(
    model: LanguageModel,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    state: LMState | None,
    call: int,
) -> tuple[torch.Tensor, LMState]:
    """``forward_teach`` over tokens, targets [B, W] in calls of ``call`` tokens, the
    state carried: (logits [B, W, V], the state after them)."""
    pieces = []
    for start in range(0, tokens.shape[1], call):
        span = slice(start, start + call)
        logits, state = model.forward_teach(tokens[:, span], targets[:, span], state)
        pieces.append(logits)
    assert state is not None
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), state


def score_ids(
    model: LanguageModel, ids: list[int], window: int, stream: bool = False
) -> tuple[float, int]:
    """Summed next-token CE (nats) and count over ``ids`` (``position_losses``): each
    window a fresh context, as the ``eval`` stage scores (default), or ``stream``. A
    score that is not finite is an error naming where it diverged, never a NaN."""
    if len(ids) < 2:
        raise ValueError("score: the text encodes to fewer than two tokens")
    tokens = torch.tensor([ids], device=model.device)
    total = float(position_losses(model, tokens, window, stream).sum())  # the one host read
    if not math.isfinite(total):
        raise StageError(_where_it_diverged(model, tokens, window, stream))
    return total, len(ids) - 1


@torch.no_grad()
def _where_it_diverged(
    model: LanguageModel, tokens: torch.Tensor, window: int, stream: bool
) -> str:
    """The score of ``tokens`` was not finite: read them again (``position_losses``,
    checking the state after each window: a failure path, so host reads are fine) and
    say which memory's fast state turned non-finite first and after how many tokens, or
    from which position the loss did."""
    first_bad: list[tuple[int, str]] = []

    def check(tokens_read: int, state: LMState) -> None:
        bad = None if first_bad else first_nonfinite(state.blocks, "blocks")
        if bad is not None:
            first_bad.append((tokens_read, bad))

    losses = position_losses(model, tokens, window, stream, on_window=check if stream else None)
    if first_bad:
        end, bad = first_bad[0]
        return (
            f"score --stream: the fast state diverged: {bad} is non-finite after token "
            f"{end} of {tokens.shape[1]} (the test-time writes blew up); score without "
            "--stream, or in shorter files"
        )
    at = first_nonfinite_position(losses)
    if at is not None:
        return f"score: the loss is not finite from prediction {at} of {tokens.shape[1] - 1} on"
    return f"score: the loss over {tokens.shape[1]} tokens is not finite"


def score(run: Loaded, text: str, stream: bool = False) -> Score:
    """Loss, perplexity and bits per byte of ``text`` in windows of the training
    context (``data.seq_len``); ``stream`` carries the fast state across them."""
    ids = run.tokenizer.encode(text)
    nats, count = score_ids(run.model, ids, run.config.data.seq_len, stream)
    n_bytes = len(text.encode("utf-8"))
    loss = nats / count
    return Score(loss, math.exp(min(loss, 700.0)), nats / (math.log(2.0) * n_bytes), count, n_bytes)


def memorize_text(run: Loaded, text: str, cfg: MemorizeConfig | None = None) -> LMState:
    """Write ``text`` into a fresh context's fast state (test-time memorisation,
    ``hope.memorize``; every token written once, in online chunks). Refuses a state
    the writes made non-finite rather than handing it on."""
    state = memorize_sequence(run.model, run.tokenizer.encode, text, cfg)
    if not all(bool(torch.isfinite(t).all()) for t in tensor_leaves(state.blocks)):
        ids = torch.tensor([run.tokenizer.encode(text)], device=run.model.device)
        for chunk_state in memorize_chunks(run.model, ids, None, cfg):  # the first bad chunk
            bad = first_nonfinite(chunk_state.blocks, "blocks")
            if bad is not None:
                break
        raise StageError(
            f"memorize: the fast state diverged: {bad} is non-finite after token "
            f"{chunk_state.pos} of {state.pos} (the test-time writes blew up); memorise a "
            "shorter text"
        )
    return state


def save_state(run: Loaded, state: LMState, path: str | Path) -> None:
    save_state_file(run.model, state, Path(path))


def load_state(run: Loaded, path: str | Path) -> LMState:
    return load_state_file(run.model, Path(path))

"""Test-time memorisation: write a text into a model's fast state (MECHANISMS §5).

``memorize(model, tokens, state, cfg, teach_mask)`` streams the text in online
chunks of c = ``online_chunk_size`` tokens. Chunk m = tokens [mc, (m+1)c) is fed once
through ``forward_teach`` with its next-token targets (its last target is the first
token of chunk m+1; the text's final token has none, -100), carrying the state. So
every token is written exactly once and the state after chunk m depends only on
tokens ≤ the first token of chunk m+1 (causal). Re-feeding the whole prefix per
chunk instead would cost O(N²), re-write prefix tokens into the SMT and count them
again in the CMS cadence.

What is written. A block state holds *memories* (CMS Δ, momentum and update counters;
SMT memories; Titans memory weights and momentum) and *context* (KV caches, conv
tails, CMS pending tokens and chunk phase, the position). After each chunk the
context always advances; a memory keeps its new value only if its path and layer are
selected, else its previous value is restored, so ``paths``/``layers`` filter updates
exactly. Keeping the pending CMS tokens of an unselected level keeps every level on
the same chunk grid as the teach pass (its piece grid follows level 0 of layer 0).

Meta parameters never change (every write is to the fast state) and the loop has no
host syncs: it iterates over chunks with static Python ints only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from hope.memory.cms import CMSLevel
from hope.memory.cms_state import LevelState
from hope.memory.fast_state import tensor_leaves
from hope.memory.smt_state import SMTState
from hope.memory.titans_memory import NeuralMemory, NeuralMemoryState
from hope.model.attention import KVCache
from hope.model.hope import HopeBlock, HopeBlockState, HopeLM, SMTMixer
from hope.model.lm import LanguageModel, LMState
from hope.model.titans import TitansMACBlock, TitansState

IGNORE_INDEX = -100
RESETS = ("reset_per_sample", "carry_across_samples")
_CMS_LEVEL = re.compile(r"cms:(\d+)")


@dataclass(frozen=True)
class MemorizeConfig:
    """What ``memorize`` writes, and how.

    paths: memories to write, ⊂ {"smt", "titans", "cms", "cms:<level>"}; None = all the
        model has. "cms" = every CMS level.
    layers: block indices to write; None = all.
    surprise_threshold: τ of the CMS surprise gate (MECHANISMS §4) during memorisation;
        None = the model's own. SMT and Titans writes use no teach signal and no gate.
    online_chunk_size: tokens per ``forward_teach`` call; None = the model's grid (the
        smallest CMS period; the Titans chunk; else 16). At that grid, memorising a
        HOPE model is the online oracle (``exact_online``: every C1 piece read with the
        Δ written so far, MECHANISMS §8.3); a multiple of it runs ``teach_pass`` per
        chunk (δ from the chunk-start weights); other sizes are still causal but shift
        the chunk grids.
    steps: passes over the text. steps > 1 is the non-causal "batch mode" for
        memorise-then-query tasks: every pass re-reads the text from the *starting
        context* (KV cache, conv tails, pending CMS tokens, position) and carries only
        the memories, so the result holds one reading of the context and memories that
        have seen the text ``steps`` times.
    reset: "reset_per_sample" starts from a fresh state whatever ``state`` is passed;
        "carry_across_samples" continues the passed state (one stream of samples).
    """

    paths: tuple[str, ...] | None = None
    layers: tuple[int, ...] | None = None
    surprise_threshold: float | None = None
    online_chunk_size: int | None = None
    steps: int = 1
    reset: Literal["reset_per_sample", "carry_across_samples"] = "carry_across_samples"

    def __post_init__(self) -> None:
        for path in self.paths or ():
            if path not in ("smt", "titans", "cms") and not _CMS_LEVEL.fullmatch(str(path)):
                raise ValueError(
                    f"MemorizeConfig.paths: unknown path {path!r}; "
                    "expected 'smt', 'titans', 'cms' or 'cms:<level index>'"
                )
        for layer in self.layers or ():
            if not isinstance(layer, int) or layer < 0:
                raise ValueError(f"MemorizeConfig.layers: {layer!r} is not a layer index >= 0")
        tau = self.surprise_threshold
        if tau is not None and not math.isfinite(tau):
            raise ValueError(f"MemorizeConfig.surprise_threshold={tau!r} must be finite or None")
        chunk = self.online_chunk_size
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"MemorizeConfig.online_chunk_size={chunk!r} must be an int >= 1")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"MemorizeConfig.steps={self.steps!r} must be an int >= 1")
        if self.reset not in RESETS:
            raise ValueError(f"MemorizeConfig.reset={self.reset!r} must be one of {RESETS}")


@dataclass(frozen=True)
class _Selection:
    """Memories that keep their writes: per layer, SMT / Titans / the CMS level indices."""

    layers: frozenset[int]
    smt: bool
    titans: bool
    cms_levels: frozenset[int]

    def cms(self, layer: int, level: int) -> bool:
        return layer in self.layers and level in self.cms_levels

    def mixer(self, layer: int) -> bool:
        return layer in self.layers and self.smt


NOTHING = _Selection(frozenset(), False, False, frozenset())


def available_paths(model: LanguageModel) -> tuple[str, ...]:
    """The memory paths this model has (the default of ``MemorizeConfig.paths``)."""
    block = model.blocks[0]
    if isinstance(block, HopeBlock):
        smt = ("smt",) if isinstance(block.mixer, SMTMixer) else ()
        return (*smt, "cms", *(f"cms:{i}" for i in range(len(block.cms.levels))))
    if isinstance(getattr(block, "memory", None), NeuralMemory):  # every Titans block
        return ("titans",)
    return ()


def default_chunk_size(model: LanguageModel) -> int:
    """The model's own grid: chained calls split on it equal one call."""
    block, cfg = model.blocks[0], model.cfg
    if isinstance(block, HopeBlock):  # C1: the SMT streams at any split
        return cfg.cms_periods[0]
    if isinstance(getattr(block, "memory", None), NeuralMemory):  # every Titans block
        return cfg.titans_chunk
    return 16


def _resolve(model: LanguageModel, cfg: MemorizeConfig) -> tuple[_Selection, int]:
    """Check cfg against the model; return the selection and the online chunk size."""
    have = available_paths(model)
    paths = have if cfg.paths is None else cfg.paths
    for path in paths:
        if path not in have:
            raise ValueError(
                f"MemorizeConfig.paths: {path!r} is not a memory of variant "
                f"{model.cfg.variant!r} (it has: {', '.join(have) or 'none'})"
            )
    n_layers = len(model.blocks)
    layers = range(n_layers) if cfg.layers is None else cfg.layers
    for layer in layers:
        if layer >= n_layers:
            raise ValueError(
                f"MemorizeConfig.layers: layer {layer} out of range for {n_layers} layers"
            )
    n_levels = sum(p.startswith("cms:") for p in have)
    levels = {int(p[4:]) for p in paths if p.startswith("cms:")}
    if "cms" in paths:
        levels = set(range(n_levels))
    chunk = cfg.online_chunk_size or default_chunk_size(model)
    if isinstance(model.blocks[0], TitansMACBlock) and chunk % model.cfg.titans_chunk:
        raise ValueError(
            f"MemorizeConfig.online_chunk_size={chunk} must be a multiple of "
            f"model.titans_chunk={model.cfg.titans_chunk} for titans_mac (segments)"
        )
    selection = _Selection(frozenset(layers), "smt" in paths, "titans" in paths, frozenset(levels))
    return selection, chunk


# Splicing states: context from `new`, each memory from `new` if selected else `old`.


def _pick(selected: bool, old: Any, new: Any) -> Any:
    return new if selected else old


def _splice_mixer(old: Any, new: Any, selected: bool) -> Any:
    if isinstance(new, KVCache):
        return new
    if isinstance(new, SMTState):
        return dataclasses.replace(new, memories=_pick(selected, old.memories, new.memories))
    raise TypeError(f"memorize: unknown mixer state {type(new).__name__}")


def _splice_level(old: LevelState, new: LevelState, selected: bool) -> LevelState:
    if selected:
        return new
    return dataclasses.replace(
        new,
        delta_in=old.delta_in,
        delta_out=old.delta_out,
        mom_in=old.mom_in,
        mom_out=old.mom_out,
        updates=old.updates,
    )


def _splice_block(old: Any, new: Any, layer: int, sel: _Selection) -> Any:
    if isinstance(new, KVCache):  # transformer: context only
        return new
    if isinstance(new, TitansState):
        keep = layer in sel.layers and sel.titans
        memory: NeuralMemoryState = dataclasses.replace(
            new.memory, memory=_pick(keep, old.memory.memory, new.memory.memory)
        )
        return dataclasses.replace(new, memory=memory)
    if isinstance(new, HopeBlockState):
        levels = [
            _splice_level(o, n, sel.cms(layer, i))
            for i, (o, n) in enumerate(zip(old.cms, new.cms, strict=True))
        ]
        mixer = _splice_mixer(old.mixer, new.mixer, sel.mixer(layer))
        return HopeBlockState(mixer, levels)
    raise TypeError(f"memorize: unknown block state {type(new).__name__}")


def splice_state(old: LMState, new: LMState, selection: _Selection) -> LMState:
    """Context (and position) of ``new``; each memory from ``new`` if selected, else ``old``."""
    blocks = [
        _splice_block(o, n, i, selection)
        for i, (o, n) in enumerate(zip(old.blocks, new.blocks, strict=True))
    ]
    return LMState(blocks, new.pos)


def fresh_context(model: LanguageModel, state: LMState) -> LMState:
    """The memories of ``state`` with a fresh context (empty caches, position 0): to
    measure what the memories alone hold, without attention reading the text back."""
    with torch.no_grad():
        fresh = model.init_state(_batch_size(state))
    return splice_state(state, fresh, NOTHING)


def _batch_size(state: LMState) -> int:
    leaves = tensor_leaves(state.blocks)  # every leaf has a leading B (MECHANISMS §5)
    if not leaves:
        raise ValueError("memorize: cannot read the batch size of a state without tensors")
    return leaves[0].shape[0]


@contextlib.contextmanager
def _surprise_threshold(model: LanguageModel, tau: float | None) -> Iterator[None]:
    """Temporarily use τ for the CMS gate: every level's threshold and the model config
    (the teach pass reads it to decide which surprise inputs to compute). The config
    object is replaced, not mutated, so configs shared with other code are untouched."""
    if tau is None or not isinstance(model, HopeLM):
        yield
        return
    levels = [cast(CMSLevel, lvl) for block in model.hope_blocks() for lvl in block.cms.levels]
    saved_cfg, saved = model.cfg, [level.surprise_threshold for level in levels]
    model.cfg = dataclasses.replace(saved_cfg, surprise_threshold=tau)
    for level in levels:
        level.surprise_threshold = tau
    try:
        yield
    finally:
        model.cfg = saved_cfg
        for level, value in zip(levels, saved, strict=True):
            level.surprise_threshold = value


@contextlib.contextmanager
def _test_time(model: LanguageModel) -> Iterator[None]:
    """Run in eval mode (test time), then restore the caller's train/eval mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def next_token_targets(
    tokens: Tensor, teach_mask: Tensor | None = None, following: Tensor | None = None
) -> Tensor:
    """targets [B, T]: token t+1 at position t; at the last position ``following`` [B]
    (the token after the text, when known) else -100; -100 wherever ``teach_mask``
    [B, T] is False (that position's loss gives no teach signal)."""
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, :-1] = tokens[:, 1:]
    if following is not None:
        targets[:, -1] = following
    if teach_mask is not None:
        if teach_mask.shape != tokens.shape:
            raise ValueError(
                f"teach_mask has shape {tuple(teach_mask.shape)}, tokens {tuple(tokens.shape)}"
            )
        targets = torch.where(teach_mask.to(torch.bool), targets, IGNORE_INDEX)
    return targets


def memorize_chunks(
    model: LanguageModel,
    tokens: Tensor,
    state: LMState | None = None,
    cfg: MemorizeConfig | None = None,
    teach_mask: Tensor | None = None,
    following: Tensor | None = None,
) -> Iterator[LMState]:
    """``memorize`` one chunk at a time: yields the state after every online chunk (of
    every pass), e.g. to score a query as memorisation proceeds. Arguments as ``memorize``."""
    cfg = MemorizeConfig() if cfg is None else cfg
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ValueError(f"memorize: tokens must be [B, T] with T >= 1, got {tuple(tokens.shape)}")
    selection, chunk = _resolve(model, cfg)
    if state is None or cfg.reset == "reset_per_sample":
        with torch.no_grad():  # SMT/Titans init states expand meta parameters: no graph
            state = model.init_state(tokens.shape[0])
    targets = next_token_targets(tokens, teach_mask, following)
    # Checked above, eagerly; the generator below runs on the first next().
    return _chunk_states(model, tokens, targets, state, cfg, selection, chunk)


def _chunk_states(
    model: LanguageModel,
    tokens: Tensor,
    targets: Tensor,
    state: LMState,
    cfg: MemorizeConfig,
    selection: _Selection,
    chunk: int,
) -> Iterator[LMState]:
    start = state
    for step in range(cfg.steps):
        if step:  # batch mode: re-read the text from the starting context
            state = splice_state(state, start, NOTHING)
        for begin in range(0, tokens.shape[1], chunk):
            span = slice(begin, begin + chunk)
            # Grad and train/eval modes are global: set them per chunk, never across a
            # yield. Memorisation is test time (a `static` CMS writes only then).
            with (
                torch.no_grad(),
                _surprise_threshold(model, cfg.surprise_threshold),
                _test_time(model),
            ):
                _, new = model.forward_teach(tokens[:, span], targets[:, span], state)
            state = splice_state(state, new, selection)
            yield state


def memorize(
    model: LanguageModel,
    tokens: Tensor,
    state: LMState | None = None,
    cfg: MemorizeConfig | None = None,
    teach_mask: Tensor | None = None,
    following: Tensor | None = None,
) -> LMState:
    """Write tokens [B, T] into the fast state; returns the state after the text.

    state: the state to continue (``cfg.reset`` decides whether it is used); None =
    a fresh context. teach_mask [B, T] (bool): False at position t drops the loss of
    predicting token t+1 from the teach signal (CMS), e.g. to memorise only answers;
    SMT and Titans writes use self-generated targets and ignore it. Continue with
    ``model(query, state)`` (read path) or ``model.forward_teach``. following [B]: the
    token that comes after the text, when known (the last position's target; without
    it the last position teaches nothing): so memorising text[:-1] with following =
    text[-1] then reading text[-1] is one online read of the text.
    """
    # T >= 1, so there is at least one chunk; keep only the last state.
    chunks = memorize_chunks(model, tokens, state, cfg, teach_mask, following)
    return deque(chunks, maxlen=1)[0]


def memorize_sequence(
    model: LanguageModel,
    encode: Callable[[str], list[int]],
    text: str,
    cfg: MemorizeConfig | None = None,
) -> LMState:
    """Tokenise ``text`` with ``encode`` and memorise it as one sample (B = 1)."""
    ids = encode(text)
    if not ids:
        raise ValueError("memorize_sequence: the text encodes to no tokens")
    tokens = torch.tensor([ids], dtype=torch.long, device=model.device)
    return memorize(model, tokens, None, cfg)

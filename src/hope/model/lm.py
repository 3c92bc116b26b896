"""The language-model shell shared by every variant (MECHANISMS §1 "Shell").

tokens [B, T] -> embedding -> L blocks -> [final RMSNorm] -> tied LM head -> logits [B, T, V].
Blocks follow one contract: ``init_state(batch_size, device) -> state`` and
``forward(x [B, T, d], state, pos: int) -> (x, state)``.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from hope.memory.deep_mlp import DeepMemoryInit
from hope.memory.fast_state import restore_state
from hope.memory.norm import RMSNorm
from hope.memory.recompute import checkpointed
from hope.memory.residual_mlp import MemoryInit
from hope.model.config import ModelConfig


@dataclass
class LMState:
    """Fast state of one context: one entry per block plus the absolute position.

    ``pos`` is a Python int (the number of tokens consumed) so it never needs a host sync.
    """

    blocks: list[Any]
    pos: int = 0


_Out = TypeVar("_Out")


@dataclass(frozen=True)
class ShardUnit:
    """A module a sharding wrapper (FSDP2) may gather and free on its own: the methods
    besides ``forward`` that the model calls on it from outside (each gathers its
    parameters too), and whether it frees them after each call or at the backward's end."""

    module: nn.Module
    methods: tuple[str, ...] = ()
    free_after_forward: bool = True


class LanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, blocks: nn.ModuleList) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is unresolved; build the model from a loaded Config")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = blocks
        # model.final_norm: RMSNorm before the tied head, or none (the head then reads
        # the residual stream as it is).
        self.norm: nn.Module = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.final_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std) everywhere; residual projections scaled by 1/sqrt(2L) (GPT-2);
        the tied embedding N(0, embed_init_std) when that is set.

        Modules that need a special init (gates, memory biases) define
        ``init_extra_parameters()``; it runs after the default init.
        """
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * max(1, len(self.blocks)))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                scaled = getattr(module, "residual_projection", False)
                nn.init.normal_(module.weight, std=residual_std if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                embed_std = self.cfg.embed_init_std
                nn.init.normal_(module.weight, std=std if embed_std is None else embed_std)
        for module in self.modules():
            extra = getattr(module, "init_extra_parameters", None)
            if callable(extra):
                extra()

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def shard_units(self) -> list[ShardUnit]:
        """The units ``train.parallel=fsdp`` shards one by one, innermost first; what is
        left (embedding, final norm) is the root's.

        Memories' initial weights are units of their own, gathered by ``init_state``
        and kept until the backward ends: a fresh state holds views of them through
        the whole step, read by every block call. Blocks are gathered for each call of
        ``forward`` or of the methods they name in ``sharded_methods``."""
        inits = [
            ShardUnit(m, ("init_state",), free_after_forward=False)
            for m in self.modules()
            if isinstance(m, (MemoryInit, DeepMemoryInit))
        ]
        blocks = [ShardUnit(b, tuple(getattr(b, "sharded_methods", ()))) for b in self.blocks]
        return inits + blocks

    @property
    def gathers_all_blocks(self) -> bool:
        """Whether a training step holds every block's parameters at once (under
        ``blocks_gathered``); the memory planner counts them."""
        return False

    @contextlib.contextmanager
    def blocks_gathered(self) -> Iterator[None]:
        """Every block's parameters whole for the duration when blocks are FSDP units (a
        no-op otherwise): for a pass that calls block methods outside their FSDP hooks
        and consumes its own gradient within the forward (``teach_pass``'s pass A)."""
        # A block can only be an FSDP unit once torch.distributed.fsdp is loaded; looked
        # up here, not imported, because that import costs every stage ~1 s.
        fsdp = sys.modules.get("torch.distributed.fsdp")
        units = [b for b in self.blocks if fsdp is not None and isinstance(b, fsdp.FSDPModule)]
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def init_state(self, batch_size: int) -> LMState:
        blocks = [cast(Any, block).init_state(batch_size, self.device) for block in self.blocks]
        return LMState(blocks, pos=0)

    def reset_state(self, state: LMState, reset_mask: torch.Tensor) -> LMState:
        """Start a new context for the samples with reset_mask [B] (bool) True, e.g. at a
        document boundary in a stream: their memories return to the meta-learned initial
        state, their KV caches are forgotten, their conv tails and pending CMS tokens
        cleared; the other samples are untouched. No host sync.

        Chunk grids (CMS periods, SMT and Titans chunks) are batch-wide: a sample reset
        where every grid is at a boundary continues exactly like a fresh context (rotary
        attention scores are relative, so the absolute position does not matter);
        reset elsewhere, its first chunks are shorter.
        """
        fresh = self.init_state(reset_mask.shape[0])
        return LMState(restore_state(state.blocks, fresh.blocks, reset_mask), state.pos)

    def forward(
        self, tokens: torch.Tensor, state: LMState | None = None
    ) -> tuple[torch.Tensor, LMState]:
        """tokens [B, T] -> (logits [B, T, V], state after these tokens); None = fresh context."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if state is None:
            state = self.init_state(tokens.shape[0])
        x = self.embed(tokens)  # [B, T, d]
        new_states = []
        for block, block_state in zip(self.blocks, state.blocks, strict=True):
            x, block_state = self.run_block(block, x, block_state, state.pos)
            new_states.append(block_state)
        return self.logits(x), LMState(new_states, state.pos + tokens.shape[1])

    def run_block(self, fn: Callable[..., _Out], *args: Any) -> _Out:
        """``fn(*args)``: one block's work. With ``model.checkpoint_blocks`` in training
        (grad enabled, train mode) only its inputs, the tensors of its state included,
        are kept for backward, which reruns it (``memory.recompute.checkpointed``:
        autocast replayed, no RNG state stashed, so ``train.cuda_graph`` can capture it)."""
        if self.cfg.checkpoint_blocks and self.training and torch.is_grad_enabled():
            return checkpointed(fn, *args)
        return fn(*args)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head [V, d]: tied to the embedding."""
        return self.embed.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + tied head: x [B, T, d] -> logits [B, T, V]."""
        return F.linear(self.norm(x), self.head_weight)

    def forward_teach(
        self, tokens: torch.Tensor, targets: torch.Tensor, state: LMState | None = None
    ) -> tuple[torch.Tensor, LMState]:
        """Forward that may learn from the call's own targets (the CMS teach signal).

        Used for training, validation and evaluation alike, so all three score the
        same computation. Variants without teach-driven memories ignore ``targets``.
        """
        del targets
        return self(tokens, state)

    @property
    def stream_call(self) -> int | None:
        """The longest call a stream should be read in (``infer.position_losses``),
        or None: any. A model whose teach signal is taken once per call at the
        call-start weights (HOPE's ``teach_pass``) gives its fastest CMS period: a
        longer call applies several writes from one stale signal, and beyond the
        training context they can overshoot (docs/STREAMING.md)."""
        return None

    def training_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token CE of ``forward_teach`` on a fresh context (fp32; fp64 for an
        fp64 model). One backward trains every meta parameter, including memories'
        initial states through their in-graph writes."""
        logits, _ = self.forward_teach(tokens, targets)
        work = torch.promote_types(logits.dtype, torch.float32)
        return F.cross_entropy(logits.to(work).flatten(0, 1), targets.flatten())

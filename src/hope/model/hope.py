"""HOPE variants by composition (MECHANISMS §1): ``hope_attention`` and ``hope``.

One block class, parameterised by its sequence mixer (pre-norm residual, Ti §4.4):

    hope_attention:  x += Attn(N(x));  x = CMS(x)
    hope:            x += SMT(N(x));   x = CMS(x)     (SMT output already has W_o)

where CMS(x) is the chain x ← x + MLP_ℓ(N_ℓ(x)) of NL eqs. 30–31 with fast deltas.
Block state = (mixer state: KV cache or SMT memories + conv tail, CMS level states).

The model has two forwards:
- ``forward(tokens, state)``: the read path. Mixers stream (SMT writes its own
  memories from self-generated targets, NL-arXiv eq. 84); CMS levels read θ0 + Δ
  with the state's current Δ and never write (no targets are known).
- ``forward_teach(tokens, targets, state)``: CMS levels learn from the LM teach
  signal per ``cms_mode`` (MECHANISMS §8.3; orchestration in :mod:`hope.model.teach`).
``training_loss`` is the mean CE of ``forward_teach`` on a fresh context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from hope.memory.cms_chain import CMS
from hope.memory.cms_state import LevelState
from hope.memory.fast_state import detach_state
from hope.memory.norm import RMSNorm
from hope.memory.pieces import PieceGrid
from hope.memory.smt import SelfModifyingTitans
from hope.model.attention import (
    CausalSelfAttention,
    KVCache,
    attend_within_pieces,
    extend_valid,
)
from hope.model.config import ModelConfig
from hope.model.lm import LanguageModel, LMState, ShardUnit
from hope.model.teach import exact_online_forward, teach_pass_forward


class Mixer(Protocol):
    """Sequence-mixer contract: streaming state in, streaming state out."""

    def init_state(self, batch_size: int, device: torch.device) -> Any: ...

    def __call__(self, x: torch.Tensor, state: Any, pos: int) -> tuple[torch.Tensor, Any]: ...

    def forward_pieces(
        self, x: torch.Tensor, state: Any, pos: int, pieces: PieceGrid
    ) -> tuple[torch.Tensor, Any]:
        """Pass A (MECHANISMS §8.3b): the values of ``__call__`` from a detached state,
        with no gradient path between tokens of different pieces."""
        ...


class AttentionMixer(nn.Module):
    """Causal self-attention; state = KV cache (keys/values of every past token)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(
            cfg.dim, cfg.n_heads, cfg.rope_base, cfg.qk_norm, cfg.norm_eps
        )

    def init_state(self, batch_size: int, device: torch.device) -> Any:
        return self.attn.init_state(batch_size, device, self.attn.qkv.weight.dtype)

    def forward(self, x: torch.Tensor, state: Any, pos: int) -> tuple[torch.Tensor, Any]:
        return cast(tuple[torch.Tensor, Any], self.attn(x, state, pos))

    def forward_pieces(
        self, x: torch.Tensor, state: Any, pos: int, pieces: PieceGrid
    ) -> tuple[torch.Tensor, Any]:
        """One call reading sg(K, V) outside each query's piece (values of one plain
        call); the cache passed in is detached."""
        q, k, v, past = self.attn.project(x, state, pos)
        valid = extend_valid(state, x.shape[0], x.shape[1])
        y = attend_within_pieces(q, k, v, past, pieces, valid)
        return self.attn.merge_heads(y), KVCache(k=k, v=v, valid=valid)


class SMTMixer(nn.Module):
    """Self-modifying Titans (MECHANISMS §3); state = six memories + conv tail.

    SMT positions are implicit (recurrent), so ``pos`` is unused.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.smt = SelfModifyingTitans(cfg.smt_config())
        # W_o feeds the residual stream like attention's output projection: GPT-2 scaled init.
        self.smt.w_o.residual_projection = True  # type: ignore[assignment]

    def init_state(self, batch_size: int, device: torch.device) -> Any:
        return self.smt.init_state(batch_size, device)

    def forward(self, x: torch.Tensor, state: Any, pos: int) -> tuple[torch.Tensor, Any]:
        return cast(tuple[torch.Tensor, Any], self.smt(x, state))

    def forward_pieces(
        self, x: torch.Tensor, state: Any, pos: int, pieces: PieceGrid
    ) -> tuple[torch.Tensor, Any]:
        """One call; the SMT cuts its own cross-piece paths (any chunk sizes)."""
        return cast(tuple[torch.Tensor, Any], self.smt(x, state, pieces=pieces))


@dataclass
class HopeBlockState:
    """Per-sample fast state of one HOPE block (MECHANISMS §5)."""

    mixer: Any  # KVCache (hope_attention) | SMTState (hope)
    cms: list[LevelState]  # one per CMS level


class HopeBlock(nn.Module):
    """x += Mixer(N(x)); x = CMS(x). The mixer is the only difference between variants."""

    # Called by the teach pass besides forward: an FSDP unit gathers for them too
    # (``LanguageModel.shard_units``); pass A's ``teach_read`` runs under
    # ``blocks_gathered`` instead, its gradient being taken inside the forward.
    sharded_methods = ("mix", "teach_write")

    def __init__(self, cfg: ModelConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mixer = mixer
        self.cms = CMS.from_config(cfg.cms_config())

    def init_state(self, batch_size: int, device: torch.device) -> HopeBlockState:
        # CMS deltas are fp32 (fp64 for an fp64 model), whatever autocast does to activations.
        dtype = torch.promote_types(self.mixer_norm.weight.dtype, torch.float32)
        mixer = cast(Mixer, self.mixer)
        return HopeBlockState(
            mixer.init_state(batch_size, device), self.cms.init_state(batch_size, device, dtype)
        )

    def mix(self, x: torch.Tensor, mixer_state: Any, pos: int) -> tuple[torch.Tensor, Any]:
        """x [B, T, d] at absolute positions pos.. -> (x + Mixer(N(x)), new mixer state)."""
        return self._mix(x, mixer_state, pos)

    def _mix(self, x: torch.Tensor, mixer_state: Any, pos: int) -> tuple[torch.Tensor, Any]:
        # What the block's own methods call: ``mix`` may be wrapped by FSDP's hooks
        # (``sharded_methods``), which would free the parameters on return mid-method.
        out, mixer_state = self.mixer(self.mixer_norm(x), mixer_state, pos)
        return x + out, mixer_state

    def mix_pieces(
        self, x: torch.Tensor, mixer_state: Any, pos: int, pieces: PieceGrid
    ) -> tuple[torch.Tensor, Any]:
        """Pass A mixing (MECHANISMS §8.3b): the values of ``mix`` from the detached
        state (KV cache → sg(K, V), SMT memories and conv tail cut) with no gradient
        path across a piece boundary. Returns the detached final state too."""
        mixer = cast(Mixer, self.mixer)
        out, mixer_state = mixer.forward_pieces(
            self.mixer_norm(x), detach_state(mixer_state), pos, pieces
        )
        return x + out, detach_state(mixer_state)

    def teach_read(
        self, x: torch.Tensor, state: HopeBlockState, pos: int, pieces: PieceGrid, mixes: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This layer in ``teach_pass``'s pass A (``model/teach.py``): the mixer in detached
        pieces (``mixes=False``: already applied, the first layer), then every CMS level
        reads θ0 + Δ_s without writing. Returns x and the level outputs (the taps δ is
        taken at)."""
        if mixes:
            x, _ = self.mix_pieces(x, state.mixer, pos, pieces)
        x, taps = self.cms.read(x, state.cms)
        return x, [tap.output for tap in taps]

    def teach_write(
        self,
        x: torch.Tensor,
        state: HopeBlockState,
        teaches: list[torch.Tensor],
        pos: int,
        mixed: tuple[torch.Tensor, Any] | None,
        surprise: dict[str, Any],
    ) -> tuple[torch.Tensor, HopeBlockState]:
        """This layer in pass B: mix (or take ``mixed``, the first layer's), then every
        CMS level writes with its δ and reads θ0 + sg(Δ_n) per chunk."""
        x, mixer_state = self._mix(x, state.mixer, pos) if mixed is None else mixed
        x, cms_state = self.cms.teach_forward(x, teaches, state.cms, **surprise)
        return x, HopeBlockState(mixer_state, cms_state)

    def forward(
        self, x: torch.Tensor, state: HopeBlockState, pos: int
    ) -> tuple[torch.Tensor, HopeBlockState]:
        """Read path: CMS levels read θ0 + sg(Δ) with the current Δ and do not write."""
        x, mixer_state = self._mix(x, state.mixer, pos)
        x, _ = self.cms.read(x, state.cms)
        return x, HopeBlockState(mixer_state, state.cms)


class HopeLM(LanguageModel):
    """The LM shell with HOPE blocks and the teach-driven CMS forward (MECHANISMS §8.3)."""

    blocks: nn.ModuleList

    def __init__(self, cfg: ModelConfig, blocks: nn.ModuleList) -> None:
        super().__init__(cfg, blocks)
        if not all(isinstance(b, HopeBlock) for b in blocks):
            raise TypeError("HopeLM needs HopeBlock blocks")
        self.cms_mode = cfg.cms_mode
        self.piece = cfg.cms_periods[0]  # C1: the finest CMS period, the teach granularity

    def shard_units(self) -> list[ShardUnit]:
        """None under ``exact_online``: it calls the CMS outside the blocks' methods and
        backpropagates through those calls in the step's backward, so the whole model
        stays one FSDP unit there."""
        return [] if self.cms_mode == "exact_online" else super().shard_units()

    @property
    def gathers_all_blocks(self) -> bool:
        return self.cms_mode == "teach_pass"  # pass A (model/teach.py)

    @property
    def stream_call(self) -> int | None:
        """C1 unless the levels write online (``exact_online`` refreshes δ per chunk)."""
        return None if self.cms_mode == "exact_online" else self.piece

    def hope_blocks(self) -> list[HopeBlock]:
        return [cast(HopeBlock, b) for b in self.blocks]

    def forward_teach(
        self, tokens: torch.Tensor, targets: torch.Tensor, state: LMState | None = None
    ) -> tuple[torch.Tensor, LMState]:
        """tokens, targets [B, T] -> (logits [B, T, V], state), CMS written per ``cms_mode``.

        Targets equal to -100 contribute no loss (and hence no teach signal). Causal at
        the chunk granularity of MECHANISMS §2: the logits at t use only tokens ≤ t and
        targets < t. Works under ``torch.no_grad`` (the teach signal enables grad locally).

        ``static`` (MECHANISMS §8.3c): in training mode (``model.train()``) the levels
        are plain MLPs; at test time (``model.eval()``: validation, eval, scoring,
        ``memorize``) they write like ``teach_pass``.
        """
        if tokens.dim() != 2 or targets.shape != tokens.shape:
            raise ValueError(
                f"tokens and targets must both be [B, T]; got {tuple(tokens.shape)} "
                f"and {tuple(targets.shape)}"
            )
        if state is None:
            state = self.init_state(tokens.shape[0])
        if self.cms_mode == "static" and self.training:
            return cast(tuple[torch.Tensor, LMState], self(tokens, state))
        if self.cms_mode == "exact_online":
            return exact_online_forward(self, tokens, targets, state)
        return teach_pass_forward(self, tokens, targets, state)


def _hope_model(cfg: ModelConfig, make_mixer: type[nn.Module]) -> HopeLM:
    blocks = nn.ModuleList(HopeBlock(cfg, make_mixer(cfg)) for _ in range(cfg.n_layers))
    return HopeLM(cfg, blocks)


def build_hope_attention(cfg: ModelConfig) -> LanguageModel:
    return _hope_model(cfg, AttentionMixer)


def build_hope(cfg: ModelConfig) -> LanguageModel:
    return _hope_model(cfg, SMTMixer)

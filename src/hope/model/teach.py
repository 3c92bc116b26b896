"""CMS driven by the LM teach signal (MECHANISMS §8.3; NL §2.1 "local surprise signal").

δ_{layer,ℓ} = ∂L/∂(output of CMS level ℓ of that layer), L = Σ_t CE_t (sum, not mean:
MECHANISMS §4, so inner learning rates do not depend on B, T or C), in fp32 (fp64 for an
fp64 model). The teach granularity is C1, the finest CMS period; every coarser period
is a multiple of it, so every level boundary lies on the C1 grid.

``teach_pass`` (MECHANISMS §8.3b), two passes:
  Pass A: the model at the start of the call, frozen: every CMS level reads
    θ_s = θ0 + Δ_s (Δ_s = the carried state's Δ; θ0 on a fresh context) and never
    writes, over the call cut into C1 pieces (aligned to the CMS grid, i.e. after the
    P pending tokens of the state). Each mixer runs ``forward_pieces`` from the
    carried (detached) mixer state: the same values as one call but no gradient path
    between pieces (attention reads sg(K, V) outside each query's piece; the SMT
    detaches its conv taps and memories where they would cross a piece, so its chunk
    sizes need not divide C1). The first layer's mixer is upstream of every tap: pass
    A takes pass B's values for it. The head's gradient is formed by hand
    (``head_signal``), then δ = autograd.grad of the final norm's output onto the taps
    only, so no meta-parameter ``.grad`` is touched. δ of piece m depends only on
    targets of piece m (≤ the first token of piece m+1) and Δ_n (built from pieces
    < n) only on tokens ≤ n·C1: exactly causal.
  Pass B: one full forward; each layer's CMS runs ``teach_forward`` with its δ
    (per-chunk θ0 + sg(Δ_n) in one batched read). Its logits and state are returned.
  Approximation (as in Titans mini-batch GD): within a call δ comes from the
    call-start weights θ_s, not from the online Δ_n; the base is refreshed at every
    call. So a call of exactly one C1 piece *is* ``exact_online``, chained calls track
    it, and under streaming or repeated memorisation δ sees what a level has already
    written (reading θ0 there would let the dot objective grow Δ without bound).

``exact_online`` (the oracle, MECHANISMS §8.3a; every piece is a call of its own, and
the SMT streams exactly at any split): per piece, forward with the carried
states (mixer state not detached, so meta gradients flow as in one call), read with
the current Δ, δ = autograd.grad(piece loss, this piece's taps), then write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hope.memory.fast_state import detach_state
from hope.memory.pieces import PieceGrid
from hope.model.lm import LMState

if TYPE_CHECKING:
    from hope.model.hope import HopeLM

IGNORE_INDEX = -100


def _teach_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def token_ce(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token CE [B, T] in fp32, fp64 for an fp64 model (0 where target = -100)."""
    flat = F.cross_entropy(
        logits.to(_teach_dtype(logits.dtype)).flatten(0, 1),
        targets.flatten(),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    )
    return flat.view(targets.shape)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy [B, T] of the predicted next-token distribution (a surprise metric)."""
    logp = F.log_softmax(logits.to(_teach_dtype(logits.dtype)), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


@dataclass
class TeachSignal:
    """Pass-A output: per layer, per CMS level δ [B, T, d]; optional surprise inputs."""

    deltas: list[list[Tensor]]
    token_loss: Tensor | None = None  # [B, T], only when the surprise metric needs it
    token_entropy: Tensor | None = None  # [B, T]

    def surprise_kwargs(self) -> dict[str, Any]:
        return {"token_loss": self.token_loss, "token_entropy": self.token_entropy}


def _surprise_inputs(
    model: HopeLM, logits: Tensor, losses: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """Per-token loss / entropy when the surprise gate needs them (MECHANISMS §4)."""
    if model.cfg.surprise_threshold is None:
        return None, None
    metric = model.cfg.surprise_metric
    loss = losses.detach() if metric == "loss" else None
    entropy = token_entropy(logits.detach()) if metric == "entropy" else None
    return loss, entropy


@dataclass
class HeadSignal:
    """Pass A's head, by hand: ∂(Σ_t CE_t)/∂(final-norm output) and surprise inputs."""

    grad: Tensor  # [B, T, d]
    token_loss: Tensor | None  # [B, T], when the surprise metric is "loss"
    token_entropy: Tensor | None  # [B, T], when it is "entropy"


def head_signal(model: HopeLM, normed: Tensor, targets: Tensor) -> HeadSignal:
    """The summed-CE gradient at the tied head's input, (softmax(z) − onehot(y)) W.

    The logits [B, T, V] and their softmax are pass A's largest tensors; they live
    only inside this function, with no graph, no log-softmax output and no backward
    temporaries (autograd through ``token_ce`` would keep all of them). The softmax
    is one fused kernel (on a 2-core CPU at the smoke shape a fifth of the time of a
    logsumexp then an in-place subtract and exp), and one scatter takes the one-hot
    off it; rows with target -100 are zero.
    """
    weight = model.head_weight
    with torch.no_grad():
        logits = F.linear(normed, weight)
        work = _teach_dtype(logits.dtype)
        logits = logits.to(work)  # fp32 (fp64 for an fp64 model)
        valid = targets != IGNORE_INDEX
        index = targets.clamp_min(0).unsqueeze(-1)
        loss = entropy = None
        if model.cfg.surprise_threshold is not None:
            metric = model.cfg.surprise_metric
            if metric == "loss":
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, T, 1]
                loss = (lse - logits.gather(-1, index)).squeeze(-1) * valid
            elif metric == "entropy":
                entropy = token_entropy(logits)
        probs = torch.softmax(logits, dim=-1)
        del logits  # freed before the product: at most two [B, T, V] buffers at once
        probs.scatter_add_(-1, index, torch.full_like(index, -1.0, dtype=work))
        probs.mul_(valid.unsqueeze(-1).to(work))
        grad = (probs.to(weight.dtype) @ weight).to(normed.dtype)
    return HeadSignal(grad, loss, entropy)


def teach_signal(
    model: HopeLM,
    tokens: Tensor,
    targets: Tensor,
    state: LMState,
    first_mixed: Tensor | None = None,
) -> TeachSignal:
    """Pass A of ``teach_pass``: chunk-local δ for every CMS level of every layer.

    Layer-major (each layer over the whole call, its mixer in detached pieces) equals
    piece-major, because nothing flows from a later layer back to an earlier one.
    The first layer's mixer lies upstream of every tap and sees the same embedding in
    both passes, so pass A needs only its values: pass B's (``first_mixed``) when
    given, else one call without a graph. Every level reads the call-start Δ of
    ``state`` and every mixer starts from the carried mixer state.
    """
    pieces = PieceGrid(model.piece, state.blocks[0].cms[0].pending)
    blocks = model.hope_blocks()
    if first_mixed is None:
        with torch.no_grad():
            first_mixed, _ = blocks[0].mix(model.embed(tokens), state.blocks[0].mixer, state.pos)
    with torch.enable_grad(), model.blocks_gathered():
        # A leaf that requires grad: taps stay differentiable even if θ is frozen.
        x = first_mixed.detach().requires_grad_(True)
        outputs: list[Tensor] = []
        for i, (block, block_state) in enumerate(zip(blocks, state.blocks, strict=True)):
            x, taps = model.run_block(block.teach_read, x, block_state, state.pos, pieces, i > 0)
            outputs.extend(taps)
        normed = model.norm(x)
        head = head_signal(model, normed, targets)
        grads = torch.autograd.grad(normed, outputs, grad_outputs=head.grad)
    n_levels = len(blocks[0].cms.levels)
    flat = [g.to(_teach_dtype(g.dtype)) for g in grads]
    deltas = [flat[i : i + n_levels] for i in range(0, len(flat), n_levels)]
    return TeachSignal(deltas, head.token_loss, head.token_entropy)


def teach_forward(
    model: HopeLM,
    tokens: Tensor,
    signal: TeachSignal,
    state: LMState,
    first: tuple[Tensor, Any] | None = None,
) -> tuple[Tensor, LMState]:
    """Pass B: one full forward; CMS level ℓ of each layer reads θ0 + sg(Δ_n) per chunk,
    with Δ_n built from this pass's inputs and the given δ (``CMS.teach_forward``).
    ``first``: the first layer's (mixed x, mixer state), already computed."""
    x = model.embed(tokens)  # [B, T, d]
    new_states = []
    surprise = signal.surprise_kwargs()
    for i, (block, block_state, teaches) in enumerate(
        zip(model.hope_blocks(), state.blocks, signal.deltas, strict=True)
    ):
        mixed = first if i == 0 else None
        x, block_state = model.run_block(
            block.teach_write, x, block_state, teaches, state.pos, mixed, surprise
        )
        new_states.append(block_state)
    return model.logits(x), LMState(new_states, state.pos + tokens.shape[1])


def teach_pass_forward(
    model: HopeLM, tokens: Tensor, targets: Tensor, state: LMState
) -> tuple[Tensor, LMState]:
    """``teach_pass`` mode: pass B's first mixing, pass A (δ), then the rest of pass B.

    Deviation (docs/FAITHFULNESS.md, the mini-batch form of MECHANISMS §8.3b): within
    a call δ comes from the call-start weights, not from the Δ_n written so far; a
    call of one C1 piece is exactly the online oracle (``exact_online``)."""
    block, block_state = model.hope_blocks()[0], state.blocks[0]
    first = model.run_block(block.mix, model.embed(tokens), block_state.mixer, state.pos)
    signal = teach_signal(model, tokens, targets, state, first_mixed=first[0])
    return teach_forward(model, tokens, signal, state, first=first)


def exact_online_forward(
    model: HopeLM, tokens: Tensor, targets: Tensor, state: LMState
) -> tuple[Tensor, LMState]:
    """``exact_online`` mode: piece by piece, read with the current Δ, then write.

    With grad enabled by the caller the mixer state is carried with its graph, so one
    backward of the concatenated logits trains the meta parameters as one call would;
    under ``no_grad`` it is detached per piece (nothing to train, bounded memory).
    """
    keep_graph = torch.is_grad_enabled()
    blocks = model.hope_blocks()
    mixers = [s.mixer for s in state.blocks]
    levels = [s.cms for s in state.blocks]
    pieces = PieceGrid(model.piece, levels[0][0].pending)
    piece_logits = []
    for start, stop in pieces.bounds(tokens.shape[1]):
        with torch.enable_grad():
            x = model.embed(tokens[:, start:stop])
            if not x.requires_grad:  # frozen θ: the taps still need a graph for δ
                x = x.detach().requires_grad_(True)
            layer_taps = []
            for i, block in enumerate(blocks):
                x, mixers[i] = block.mix(x, mixers[i], state.pos + start)
                x, taps = block.cms.read(x, levels[i])
                layer_taps.append(taps)
            logits = model.logits(x)
            losses = token_ce(logits, targets[:, start:stop])
            outputs = [tap.output for taps in layer_taps for tap in taps]
            grads = torch.autograd.grad(losses.sum(), outputs, retain_graph=keep_graph)
        loss, entropy = _surprise_inputs(model, logits, losses)
        for i, (block, taps) in enumerate(zip(blocks, layer_taps, strict=True)):
            teaches = [
                g.to(_teach_dtype(g.dtype)) for g in grads[i * len(taps) : (i + 1) * len(taps)]
            ]
            levels[i] = block.cms.write(
                taps, teaches, levels[i], token_loss=loss, token_entropy=entropy
            )
        if not keep_graph:
            mixers, logits = detach_state(mixers), logits.detach()
        piece_logits.append(logits)
    new_states = [
        dataclasses.replace(s, mixer=m, cms=c)
        for s, m, c in zip(state.blocks, mixers, levels, strict=True)
    ]
    return torch.cat(piece_logits, dim=1), LMState(new_states, state.pos + tokens.shape[1])

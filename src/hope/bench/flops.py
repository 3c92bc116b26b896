"""Estimated training FLOPs per token, per variant, and peak device FLOPs for MFU.

Counting convention (MECHANISMS §8.4): matmul work only, 2 FLOPs per
multiply-accumulate, per token, summed over layers, plus the tied LM head.
Norms, activations, gates and the O(C·d) terms of the chunked memory updates are
left out. These are estimates of the *useful* work of a step, computed from the
config, not counts of the kernels that actually ran; MFU divides by them.

Per-layer forward terms (d = dim, H = heads, T = seq_len, h = SwiGLU hidden,
Σh_ℓ = CMS hidden sizes, e = smt_expansion (titans_expansion for Titans), unit
u = e·d²/H = the cost of one d_h→e·d_h matmul for every head):

- causal attention: 8d² (W_qkv, W_o) + 2·T·d (q·k and p·v over T/2 keys on average)
- SwiGLU MLP: 6·d·h
- CMS chain (NL eqs. 30-31): 4·d·Σh_ℓ
- SMT (MECHANISMS §8.4): 2d² (W_o) + 2d²/H (per-head W_q) + 80u
  (generation 12, read 4, v̂ 16, M(k) 16, gradient factors 6, update 26); the
  frozen-base reads (``smt_read_chunk``) count the same: their C/R extra copies of
  M_mem's write are the mode's overhead, like recomputation, not model work
- Titans memory (Ti eqs. 12-18): 6d² (W_qkv) + 2d² (W_o) + 14u
  (read M(q) 4, M(k) 4, D = W1ᵀE 2, G1 = EAᵀ 2, G2 = Dkᵀ 2)

Variants:

- transformer:    attention + MLP
- hope_attention: attention + CMS
- hope:           SMT + CMS
- titans_lmm:     memory + MLP
- titans_mal / titans_mag: memory + sliding-window attention (window W, N_p
  persistent tokens: 8d² + 4·d·(N_p + min(W, T/2))) + MLP (+ 2d² gate for MAG)
- titans_mac:     memory + retrieval (W_q 2d², M(q) 4u) + segment attention over
  [P ‖ h ‖ seg] (W_qkv on h and seg 12d², W_o 2d², 4·d·(N_p + S)) + gate 2d² + MLP

Training = 3× forward (forward + backward for activations and weights), plus:
backprop through in-graph memory writes ≈ +30% of the memory's training cost
(MECHANISMS §8.4; SMT and Titans memories unless ``write_grad=stopgrad``), and for
the HOPE variants with ``cms_mode`` teach_pass or exact_online, pass A (forward +
backward to the level outputs only) ≈ 2× forward.

Executed work beyond that (``executed_training_flops_per_token``, the compute term of
``hope.bench.projection``): the CMS dual read's [T, F] score products
(``cms_dual_read_flops``), which grow with the context, and the forward work that
activation checkpointing runs again in backward (``recompute_flops_per_token``); the
useful count leaves both out. MFU stays on the useful count.

Of the executed work, the memories' chunk recurrences (``recurrent_training_flops_per_
token``: the SMT's 80u, the Titans memory's 14u and MAC's retrieval read 4u, in every
pass that runs them) are what ``memory_backend=fused`` runs as kernels of one program
per (sample, head), which ``hope.bench.projection`` spreads over that many
multiprocessors only.
"""

from __future__ import annotations

from hope.layers import swiglu_hidden
from hope.memory.cms import dual_read_blocks, level_read_block, prefers_dual_read
from hope.memory.cms_chain import split_hidden
from hope.model.config import ModelConfig
from hope.optim.inner import make_inner_rule

# Dense (non-sparse) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
# Matched by substring of the CUDA device name, first match wins (so "H100 PCIe"
# comes before "H100").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)

TRAIN_MULTIPLIER = 3.0  # forward + backward (activations and weights)
WRITE_BACKPROP = 0.3  # extra fraction of a memory's cost for gradients through its writes
PASS_A_MULTIPLIER = 2.0  # teach pass A: forward + activation-only backward


def attention_flops(d: int, keys_per_query: float) -> float:
    """W_qkv + W_o (8d²) plus scores and values over ``keys_per_query`` keys (4·d each)."""
    return 8 * d * d + 4 * d * keys_per_query


def mlp_flops(cfg: ModelConfig) -> float:
    return 6 * cfg.dim * swiglu_hidden(cfg.dim, cfg.mlp_ratio)


def cms_flops(cfg: ModelConfig) -> float:
    # Σh_ℓ = round(mlp_ratio·d) however it is split over levels (hope.memory.cms.split_hidden).
    return 4 * cfg.dim * int(round(cfg.mlp_ratio * cfg.dim))


def _unit(cfg: ModelConfig, expansion: int) -> float:
    return expansion * cfg.dim * cfg.dim / cfg.n_heads


def smt_flops(cfg: ModelConfig) -> float:
    d = cfg.dim
    return 2 * d * d + 2 * d * d / cfg.n_heads + 80 * _unit(cfg, cfg.smt_expansion)


def titans_memory_flops(cfg: ModelConfig) -> float:
    return 8 * cfg.dim * cfg.dim + 14 * _unit(cfg, cfg.titans_expansion)


def layer_forward_flops(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(total, memory part) forward FLOPs per token of one layer of ``cfg.variant``."""
    d, variant = cfg.dim, cfg.variant
    causal_keys = seq_len / 2
    swa_keys = cfg.titans_persistent + min(cfg.titans_window, causal_keys)
    if variant == "transformer":
        return attention_flops(d, causal_keys) + mlp_flops(cfg), 0.0
    if variant == "hope_attention":
        return attention_flops(d, causal_keys) + cms_flops(cfg), 0.0
    if variant == "hope":
        return smt_flops(cfg) + cms_flops(cfg), smt_flops(cfg)
    memory = titans_memory_flops(cfg)
    if variant == "titans_lmm":
        return memory + mlp_flops(cfg), memory
    if variant == "titans_mal":
        return memory + attention_flops(d, swa_keys) + mlp_flops(cfg), memory
    if variant == "titans_mag":
        return memory + attention_flops(d, swa_keys) + 2 * d * d + mlp_flops(cfg), memory
    if variant == "titans_mac":
        segment = min(cfg.titans_chunk, seq_len)
        retrieval = 2 * d * d + 4 * _unit(cfg, cfg.titans_expansion)
        attention = 14 * d * d + 4 * d * (cfg.titans_persistent + segment)
        return memory + retrieval + attention + 2 * d * d + mlp_flops(cfg), memory + retrieval
    raise ValueError(f"no FLOPs formula for model.variant={variant!r}")


def recurrent_forward_flops(cfg: ModelConfig) -> float:
    """Per token, one layer, forward: the part of ``layer_forward_flops``'s memory that
    runs inside the memory's chunk recurrence (the SMT's 80u; the Titans memory's 14u,
    and MAC's retrieval read M(q), 4u), not its projections."""
    if cfg.variant == "hope":
        return 80 * _unit(cfg, cfg.smt_expansion)
    if not cfg.variant.startswith("titans"):
        return 0.0
    reads = 18 if cfg.variant == "titans_mac" else 14
    return reads * _unit(cfg, cfg.titans_expansion)


def _teaches(cfg: ModelConfig) -> bool:
    """Whether a step runs HOPE's teach pass A (a second forward and backward)."""
    return cfg.variant in ("hope", "hope_attention") and cfg.cms_mode != "static"


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size is unresolved; use a loaded Config")
    layer, _ = layer_forward_flops(cfg, seq_len)
    return cfg.n_layers * layer + 2 * cfg.dim * cfg.vocab_size


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Estimated FLOPs of one training step divided by its tokens (see the module doc)."""
    forward = forward_flops_per_token(cfg, seq_len)
    _, memory = layer_forward_flops(cfg, seq_len)
    total = TRAIN_MULTIPLIER * forward
    if memory and cfg.write_grad != "stopgrad":
        total += WRITE_BACKPROP * TRAIN_MULTIPLIER * cfg.n_layers * memory
    if _teaches(cfg):
        total += PASS_A_MULTIPLIER * forward
    return total


def recurrent_training_flops_per_token(
    cfg: ModelConfig, seq_len: int, fused: bool = False
) -> float:
    """The share of ``executed_training_flops_per_token`` that the memories' chunk
    recurrences run (``recurrent_forward_flops``), with every multiplier the executed
    count gives a memory: forward and backward, backprop through the writes, teach
    pass A, and checkpointing's reruns (``fused``: under ``memory_backend=fused``)."""
    recurrent = recurrent_forward_flops(cfg)
    per_layer = TRAIN_MULTIPLIER * recurrent
    if cfg.write_grad != "stopgrad":
        per_layer += WRITE_BACKPROP * TRAIN_MULTIPLIER * recurrent
    if _teaches(cfg):
        per_layer += PASS_A_MULTIPLIER * recurrent
    return cfg.n_layers * per_layer + _reruns(cfg, recurrent, recurrent, fused)


def cms_dual_read_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Per token, one layer, one training step: the matmul work of the CMS dual read
    (``teach_pass`` pass B, ``hope.memory.ops.cms_dual``) beyond the useful read. A
    fresh row's T tokens are read in blocks of ``cms_read_block`` (per level, whole
    periods; ``dual_read_blocks``); a block of L tokens with F written (whole periods)
    that reads in the dual form (its automatic choice, ``prefers_dual_read``) spends:

    - its read's scores q·a_t and q·h_t against the F written tokens and their values
      (2F(d + h) per query each side): 4LF(d + h), and as much again in backward to
      the queries;
    - the chunk scan's key and teach score matrices over the block's rows: 4LFd;
    - the scan's block-causal products (chunk j against the chunks before it, and
      through it): 2hF²;
    - after the first block, the read through the Δ (and momentum) carried into it:
      z Δᵀ in the scan's two factors and the read's two layers, and the read's two in
      backward, 12·L·d·h per carried matrix.

    The work of the form, not of the model (the materialised form reads each token
    once through its chunk's weights), so MFU leaves it out. Exact against
    torch.utils.flop_counter (tests/test_flops.py)."""
    if cfg.variant not in ("hope", "hope_attention") or cfg.cms_mode != "teach_pass":
        return 0.0
    cms = cfg.cms_config()
    rule = make_inner_rule(cms.rule, cms.lr, cms.retention, cms.momentum, cms.erase,
                           cms.momentum_width)  # fmt: skip
    if not rule.linear or cms.adaptive_lr:
        return 0.0
    carried_matrices = 2 if rule.uses_momentum else 1
    d, total = cms.dim, 0.0
    for period, hidden in zip(cms.periods, split_hidden(cms.hidden, len(cms.periods)), strict=True):
        size = level_read_block(cms.read_block, period)
        for index, block in enumerate(dual_read_blocks(seq_len, 0, size)):
            length = block.stop - block.start
            n_fire = length // period
            if not n_fire or not prefers_dual_read(period, n_fire, hidden, d):
                continue
            fired = n_fire * period
            total += length * fired * (8 * (d + hidden) + 4 * d) + 2 * hidden * fired * fired
            if index:
                total += 12 * length * d * hidden * carried_matrices
    return total / seq_len


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, fused: bool = False) -> float:
    """Per token, one training step: the forward work activation checkpointing runs
    again in backward. ``model.checkpoint_blocks``: every block's forward, for HOPE's
    teach passes both passes' (pass A's forward is one forward's worth); the memory's
    chunk loop (``smt_checkpoint_chunks``, ``titans_checkpoint_chunks``): its forward,
    once (a rerun block's checkpointed segments rerun within its backward). That is
    pass B's for the SMT; ``fused`` (``memory_backend=fused``, where teach pass A's
    checkpointed segments are walks that rerun in its backward too): pass A's SMT
    recurrence (``recurrent_forward_flops``) as well."""
    return _reruns(cfg, *layer_forward_flops(cfg, seq_len), fused)


def _reruns(cfg: ModelConfig, layer: float, memory: float, fused: bool) -> float:
    """``recompute_flops_per_token`` for a layer's forward ``layer`` of which the chunk
    loop runs ``memory``."""
    total = cfg.n_layers * layer * (2 if _teaches(cfg) else 1) if cfg.checkpoint_blocks else 0.0
    chunk_loop = cfg.smt_checkpoint_chunks if cfg.variant == "hope" else 0
    if cfg.variant.startswith("titans"):
        chunk_loop = cfg.titans_checkpoint_chunks
    if chunk_loop and fused and cfg.variant == "hope" and _teaches(cfg):
        total += cfg.n_layers * recurrent_forward_flops(cfg)  # pass A's walks
    return total + (cfg.n_layers * memory if chunk_loop else 0.0)


def executed_training_flops_per_token(cfg: ModelConfig, seq_len: int, fused: bool = False) -> float:
    """``training_flops_per_token`` plus the work of the implementation's forms that
    the useful count leaves out: the CMS dual read and checkpointing's reruns
    (``fused``: under ``memory_backend=fused``, ``recompute_flops_per_token``)."""
    extra = cfg.n_layers * cms_dual_read_flops(cfg, seq_len)
    reruns = recompute_flops_per_token(cfg, seq_len, fused)
    return training_flops_per_token(cfg, seq_len) + extra + reruns


def peak_bf16_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak FLOP/s of a known CUDA device, else None (CPU, unknown GPU)."""
    if not device_name:
        return None
    for key, peak in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None

"""Will it fit: a per-GPU memory plan for a preset, from activations measured on CPU.

    python -m hope.train.plan --preset pilot --gpu-mem-gb 80 --gpus 8

Method (docs/SCALING.md). What a training step keeps for backward is counted exactly
by ``torch.autograd.graph.saved_tensors_hooks`` around ``training_loss``: the peak
of the storages held for backward (each once, while held: HOPE's teach pass A frees
its graph before pass B builds one; parameters excluded), at the preset's own width
and chunking, in its precision (CPU autocast for bf16), with one and two layers and
two short lengths, batch 1. Per-layer bytes = two layers - one layer; the shell
(embedding, logits, loss) = one layer - per layer; each fitted as a + b·T and
extrapolated to the preset's context and depth. With ``model.checkpoint_blocks`` the
same count gives what each block keeps (its inputs); backward then reruns one block
at a time, so one block's whole activations (fitted the same way with checkpointing
off) are added once. A third, longer length is predicted before it is measured: that
error is the plan's error bar. Model state per GPU: fp32 weights, gradients and
AdamW's two moments, 16 bytes per parameter (divided over the GPUs under FSDP, plus
what FSDP holds whole at once: ``gathered_bytes``). Peak = state + micro-batch x
activations per row, times a 1.2 margin for the backward's transient gradients and
allocator fragmentation (an assumption, stated, until a GPU measures it:
scripts/gpu_check.sh).

The memories run under the config's ``train.memory_backend`` (``planned_backend``):
``fused`` operators save what their hand-written backwards read (a walk of SMT chunks
keeps every chunk's state, or only its inputs when checkpointed), not what autograd
through the PyTorch ops would, so the two plan differently. On a CPU the ``fused``
operators run their PyTorch forms and save the same tensors as their Triton kernels.
``fla`` and ``compile`` are planned as ``torch`` (their kernels need a GPU or save
what inductor chooses), and the plan says so.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hope.config import Config, load_config
from hope.errors import ConfigError
from hope.memory.ops.dispatch import default_backend
from hope.model.config import ModelConfig
from hope.model.lm import LanguageModel
from hope.model.zoo import build_model

MARGIN = 1.2  # backward transients and fragmentation (assumed; see the module doc)
STATE_BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
WEIGHT_BYTES = 4  # a gathered fp32 weight
WEIGHT_AND_GRAD_BYTES = 8  # and its unsharded fp32 gradient
GIB = 1024**3


class _Ledger:
    """Bytes of the storages autograd holds for backward, live and at their peak."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}  # storage address -> saved tensors holding it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def hold(self, key: int, nbytes: int) -> None:
        if not self.holders.get(key):
            self.sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1

    def release(self, key: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            self.live -= self.sizes[key]


class _Saved:
    """What the pack hook hands autograd: the tensor, and a note to the ledger when
    autograd lets it go (a graph freed by an earlier ``autograd.grad``, e.g. HOPE's
    teach pass A)."""

    __slots__ = ("key", "ledger", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, ledger: _Ledger | None) -> None:
        self.tensor, self.key, self.ledger = tensor, key, ledger

    def __del__(self) -> None:
        if self.ledger is not None:
            self.ledger.release(self.key)


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor, amp: torch.dtype | None) -> int:
    """Peak bytes autograd holds for backward during one ``training_loss`` of ``tokens``
    [B, T]: each storage once while any saved tensor holds it; parameters are model
    state, not activations."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ledger = _Ledger()

    def pack(t: torch.Tensor) -> _Saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in params:
            return _Saved(t, key, None)
        ledger.hold(key, storage.nbytes())
        return _Saved(t, key, ledger)

    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, unpack),
        torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None),
    ):
        loss = model.training_loss(tokens[:, :-1], tokens[:, 1:])  # type: ignore[operator]
    del loss  # the graph and what it saved go with it
    return ledger.peak


@dataclass(frozen=True)
class Fit:
    """bytes(T) = fixed + per_token·T, per row."""

    fixed: float
    per_token: float

    def __call__(self, length: int) -> float:
        return self.fixed + self.per_token * length


def _fit(lengths: Sequence[int], values: Sequence[float]) -> Fit:
    (t1, t2), (v1, v2) = lengths, values
    slope = (v2 - v1) / (t2 - t1)
    return Fit(v1 - slope * t1, slope)


@dataclass(frozen=True)
class Activations:
    layer: Fit  # kept per layer until backward
    shell: Fit
    holdout_length: int
    holdout_error: float  # (predicted - measured) / measured, one layer at holdout_length
    recompute: Fit | None = None  # checkpoint_blocks: one block's activations, rerun once

    def per_row(self, length: int, n_layers: int) -> float:
        rerun = 0.0 if self.recompute is None else self.recompute(length)
        return self.shell(length) + n_layers * self.layer(length) + rerun


def _fit_layers(
    cfg: Config, model_cfg: ModelConfig, lengths: tuple[int, int, int], amp: torch.dtype | None
) -> Activations:
    """Per-layer and shell fits at ``lengths[:2]`` for ``model_cfg``; ``lengths[2]`` checks."""

    def bytes_at(n_layers: int, length: int) -> float:
        torch.manual_seed(0)
        model = build_model(replace(model_cfg, n_layers=n_layers)).train()
        vocab = model_cfg.vocab_size or cfg.tokenizer.vocab_size
        tokens = torch.randint(0, vocab, (1, length + 1))
        return float(saved_bytes(model, tokens, amp))

    short = lengths[:2]
    one = [bytes_at(1, t) for t in short]
    two = [bytes_at(2, t) for t in short]
    layer = _fit(short, [b - a for a, b in zip(one, two, strict=True)])
    shell = _fit(short, [a - (b - a) for a, b in zip(one, two, strict=True)])
    predicted = shell(lengths[2]) + layer(lengths[2])
    measured = bytes_at(1, lengths[2])
    return Activations(layer, shell, lengths[2], (predicted - measured) / measured)


def measure(cfg: Config, lengths: tuple[int, int, int], amp: torch.dtype | None) -> Activations:
    """Fit per-layer and shell activation bytes at ``lengths[:2]``; predict ``lengths[2]``
    (and, with checkpointed blocks, one block's rerun)."""
    kept = _fit_layers(cfg, cfg.model, lengths, amp)
    if not cfg.model.checkpoint_blocks:
        return kept
    whole = _fit_layers(cfg, replace(cfg.model, checkpoint_blocks=False), lengths, amp)
    return replace(kept, recompute=whole.layer)


@dataclass(frozen=True)
class Plan:
    params: int
    state_gib: float  # per GPU
    gathered_gib: float  # per GPU, under FSDP: parameters held whole at once
    activations_gib_per_row: float
    micro_batch: int | None  # largest that fits (None: not even one row)
    grad_accum: int | None
    peak_gib: float | None
    holdout_error: float


def gathered_bytes(model: LanguageModel) -> int:
    """Bytes of parameters held whole on each GPU at once under FSDP (``shard_units``),
    fp32: the root and the memory inits for the whole step, weights and gradients; and
    two blocks' weights and gradients (the one running and the next, prefetched) —
    or, when the model gathers every block together (HOPE's teach pass A, before any
    gradient exists), every block's weights, whichever is more. Without units the whole
    model is one: every weight and gradient."""
    total = sum(p.numel() for p in model.parameters())
    units = model.shard_units()
    kept = {id(p) for u in units if not u.free_after_forward for p in u.module.parameters()}
    blocks = [u.module for u in units if u.free_after_forward]
    if not blocks:
        return WEIGHT_AND_GRAD_BYTES * total
    sizes = [sum(p.numel() for p in b.parameters() if id(p) not in kept) for b in blocks]
    per_call = WEIGHT_AND_GRAD_BYTES * sum(sorted(sizes)[-2:])
    together = WEIGHT_BYTES * sum(sizes) if model.gathers_all_blocks else 0
    return WEIGHT_AND_GRAD_BYTES * (total - sum(sizes)) + max(per_call, together)


def make_plan(cfg: Config, acts: Activations, gpu_mem_gb: float, gpus: int, fsdp: bool) -> Plan:
    with torch.device("meta"):  # sizes only: nothing allocated at the preset's width
        model = build_model(cfg.model)
    model_params = sum(p.numel() for p in model.parameters())
    state = STATE_BYTES_PER_PARAM * model_params / (gpus if fsdp else 1)
    gathered = gathered_bytes(model) if fsdp else 0
    row = acts.per_row(cfg.data.seq_len, cfg.model.n_layers)
    rows_per_gpu = cfg.train.batch_size // gpus
    budget = gpu_mem_gb * GIB  # GPU memory as nvidia-smi counts it (GiB)
    fits = [m for m in range(1, rows_per_gpu + 1) if rows_per_gpu % m == 0]
    fits = [m for m in fits if MARGIN * (state + gathered + m * row) <= budget]
    micro = max(fits) if fits else None
    return Plan(
        params=model_params,
        state_gib=state / GIB,
        gathered_gib=gathered / GIB,
        activations_gib_per_row=row / GIB,
        micro_batch=micro,
        grad_accum=None if micro is None else rows_per_gpu // micro,
        peak_gib=None if micro is None else MARGIN * (state + gathered + micro * row) / GIB,
        holdout_error=acts.holdout_error,
    )


def planned_backend(name: str) -> str:
    """The memory backend the plan measures for ``train.memory_backend`` = ``name``:
    itself, except ``fla`` and ``compile``, measured as ``torch`` (module docstring)."""
    return "torch" if name in ("fla", "compile") else name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hope.train.plan", description=__doc__)
    parser.add_argument("--preset", default="pilot")
    parser.add_argument("--gpu-mem-gb", type=float, default=80.0)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in all (data parallel)")
    fsdp_help = "shard the model state (FSDP2; implied by train.parallel=fsdp)"
    parser.add_argument("--fsdp", action="store_true", help=fsdp_help)
    parser.add_argument("--lengths", default="128,256,512", help="measured T: fit, fit, check")
    parser.add_argument("--set", action="append", default=[], help="a config override")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(None, [f"preset={args.preset}", *args.set])
        lengths = tuple(int(v) for v in args.lengths.split(","))
        if len(lengths) != 3 or not 0 < lengths[0] < lengths[1] < lengths[2]:
            raise ConfigError(f"--lengths={args.lengths}: three increasing lengths")
        if args.gpus < 1 or cfg.train.batch_size % args.gpus:
            raise ConfigError(
                f"--gpus={args.gpus} must divide train.batch_size={cfg.train.batch_size}"
            )
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    amp = torch.bfloat16 if cfg.train.precision in ("bf16", "auto") else None
    backend = planned_backend(cfg.train.memory_backend)
    with default_backend(backend, "train.memory_backend"):
        acts = measure(cfg, lengths, amp)  # type: ignore[arg-type]
    fsdp = args.fsdp or cfg.train.parallel == "fsdp"  # the mid/target presets set it
    plan = make_plan(cfg, acts, args.gpu_mem_gb, args.gpus, fsdp)
    print(
        f"{args.preset} ({cfg.model.variant}, {plan.params / 1e6:.1f}M parameters, "
        f"T={cfg.data.seq_len}, batch {cfg.train.batch_size} on {args.gpus} GPU(s) of "
        f"{args.gpu_mem_gb:g} GB{', FSDP' if fsdp else ''}, memory backend {backend}"
        f"{'' if backend == cfg.train.memory_backend else f' for {cfg.train.memory_backend}'}"
        "):\n"
        f"  model state {plan.state_gib:.2f} GiB per GPU"
        f"{f' + {plan.gathered_gib:.2f} GiB gathered' if fsdp else ''}; activations "
        f"{plan.activations_gib_per_row:.2f} GiB per row "
        f"(check at T={lengths[2]}: {plan.holdout_error:+.1%})"
    )
    if plan.micro_batch is None:
        budget = args.gpu_mem_gb / MARGIN
        why = (
            "one row's activations alone exceed it: set model.checkpoint_blocks=true, "
            "raise model.smt_checkpoint_chunks or shorten data.seq_len"
            if plan.activations_gib_per_row >= budget
            else "the model state leaves too little: use --fsdp or more GPUs"
        )
        print(f"  does not fit: not even one row per GPU; {why}")
        return 1
    print(
        f"  micro_batch_size {plan.micro_batch}, gradient accumulation {plan.grad_accum}, "
        f"peak ≈ {plan.peak_gib:.1f} GiB per GPU (x{MARGIN} margin)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

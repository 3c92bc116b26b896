"""Projected GPU step time and MFU of the paper presets, from counts a CPU can make.

A training step on a GPU costs at least its arithmetic or its memory traffic,
whichever is larger, plus the host time of launching its kernels:

    step ≈ max(FLOPs ÷ (peak · ACHIEVABLE), bytes ÷ bandwidth) + launches · launch cost

- FLOPs: :func:`hope.bench.flops.executed_training_flops_per_token` (matmul work,
  with what the CMS dual read spends on its [T, F] scores) at the preset's dims,
  times the tokens of one micro-batch: the preset's own ``train.micro_batch_size``
  rows (``preset_micro_batch``), what ``hope train --preset P`` runs per
  forward/backward. The launches do not shrink with the rows, so a preset whose
  memory allows few rows per forward (pilot: two, ``hope`` keeping ~22 GiB per 4K
  row) pays them for those rows alone. The floor the step is compared with
  (``floor_ms``, ``*_over_floor``) and MFU take the useful work alone
  (:func:`hope.bench.flops.training_flops_per_token`): the floor is what the model
  needs, the step what the code spends.
- bytes, a lower bound: the optimizer's traffic per parameter (bf16 weights read
  in forward and backward, fp32 gradients written and read, AdamW's fp32 weight and
  two moments read and written: 36 bytes) plus every layer's activations written
  once and read once in backward, at the 34·d bytes per token per layer that
  Korthikanti et al. (2022, "Reducing activation recomputation") count for a
  transformer block without the s² score term (flash attention), used here for
  every variant.
- launches: the kernel-launching aten ops of one steady training step (forward,
  backward, AdamW with its state already made: ``make_optimizer_state``), counted
  with :class:`hope.bench.measure.LaunchCounter` on a model with the preset's
  chunking, heads and layer structure but small widths, at two context
  lengths and one and two layers. The count is exactly affine in the context length
  (every loop runs per chunk, and the lengths are multiples of every chunk and
  period) and in the layer count, so four counts give it at the preset's size
  (``LaunchFit``; a test checks an extrapolated count against a direct one). Widths
  change no launch except the CMS read form, which is set on every level to the one
  the preset's widths choose at the preset's context (``prefers_dual_read``).

- occupancy, under ``memory_backend=fused``: the memories' chunk recurrences run as
  kernels of one program per (sample, head) that walk the chunks in order
  (``hope::smt_walk``, ``hope::smt_step``, the Titans memory's kernels), and a program
  runs on one multiprocessor. Their share of the work
  (``flops.recurrent_training_flops_per_token``) is paid at ACHIEVABLE of the peak of
  min(1, rows·heads ÷ multiprocessors) of the device: at the pilot's two rows of 16
  heads, 32 of an H200's 132. That is a bound from above on their speed (one program
  on an SM sustaining 40% of its peak with tiles of a chunk's size is itself an
  assumption); the batched PyTorch ops of the other backends are launch-bound long
  before occupancy counts, so they are projected without it. The fused recurrences
  multiply in fp32 (the fast state's dtype) at the precision ``dot_precision`` gives
  them: on TF32 tensor cores where the run allows TF32 (``train.precision`` bf16 or
  auto), else on the CUDA cores' FMA units (``FP32_PRODUCT_PEAKS``), not at the bf16
  peak of the rest.

Constants (``DEVICES``, ``FP32_PRODUCT_PEAKS``, ``MULTIPROCESSORS``, ``ACHIEVABLE``,
launch costs) are public figures or stated assumptions; ``scripts/gpu_check.sh``
measures the bench's ``pilot`` shape on a GPU so the projection can be checked against
it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from hope.bench import flops
from hope.bench.measure import LaunchCounter
from hope.bench.shapes import apply_read_forms, preset_read_forms, read_blocks_within
from hope.config import Config, OptimConfig, load_config
from hope.memory.ops.dispatch import resolve_backend
from hope.model.config import ModelConfig
from hope.model.zoo import build_model
from hope.optim.outer import build_optimizer
from hope.train.device import allows_tf32
from hope.train.schedule import build_scheduler
from hope.train.step import train_step

# name: (dense bf16 tensor-core peak FLOP/s, HBM bandwidth B/s), SXM parts, from
# NVIDIA's data sheets (H200 SXM: 989 TFLOP/s, 4.8 TB/s; H100 SXM: 989, 3.35;
# A100 SXM 80 GB: 312, 2.039).
DEVICES: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.039e12),
}
# Peak FLOP/s of the fused kernels' fp32 products (``triton_kernels.dot_precision``), by
# their tl.dot input precision, from the same data sheets: "tf32" on the tensor cores
# (dense: half the sheets' sparse 989 / 312), "ieee" on the CUDA cores' FMA units (the
# sheets' FP32 row: 67 / 67 / 19.5).
FP32_PRODUCT_PEAKS: dict[str, dict[str, float]] = {
    "tf32": {"H200": 494.5e12, "H100": 494.5e12, "A100": 156e12},
    "ieee": {"H200": 67e12, "H100": 67e12, "A100": 19.5e12},
}
# Fraction of the peak that the matmuls of a large training step sustain (an
# assumption, the 40% of the bench issue; well-tuned dense LMs report 40-55% MFU).
ACHIEVABLE = 0.4
# Streaming multiprocessors of the same parts (NVIDIA's architecture white papers:
# 132 for H100 SXM5, which H200 shares; 108 for A100). A Triton program runs on one,
# so a kernel of P programs uses at most P of them (``occupancy``).
MULTIPROCESSORS: dict[str, int] = {"H200": 132, "H100": 132, "A100": 108}
# Host time per dispatched op in an eager step: Python (the model's own code around
# each op), dispatcher and driver. Measured, not assumed (5 us was assumed before):
# on a lent H200 machine (torch 2.11, CUDA 13, 2026-12-04) hope's eager step at the
# bench's pilot shape took 12.6 s for 669,244 dispatched ops with the GPU idle within
# 1 ms of the host, 18.8 us each (reports/gpu_check_2026-12-04.md). A replayed CUDA
# graph removes the host side, leaving about 1.5 us of GPU-side gap between tiny
# kernels (assumed; not yet measured).
EAGER_LAUNCH_S = 18.8e-6
GRAPH_LAUNCH_S = 1.5e-6
OPTIMIZER_BYTES_PER_PARAM = 36
ACTIVATION_BYTES_PER_TOKEN = 2 * 34  # × dim × layers: written once, read once
COUNT_WIDTH_PER_HEAD = 4  # counting models: dim = 4 × heads


@dataclass(frozen=True)
class LaunchFit:
    """launches(L, T) = a + b·T + L·(c + e·T), exact from four counts."""

    base: float  # a
    base_per_token: float  # b
    layer: float  # c
    layer_per_token: float  # e
    lengths: tuple[int, int]  # the two counting contexts

    def predict(self, n_layers: int, seq_len: int) -> int:
        per_layer = self.layer + self.layer_per_token * seq_len
        return round(self.base + self.base_per_token * seq_len + n_layers * per_layer)


def counting_lengths(cfg: ModelConfig, seq_len: int = 0) -> tuple[int, int]:
    """(T1, 2·T1): T1 the smallest multiple of every chunk and period of ``cfg`` that
    holds at least four memory chunks. The first chunks of a memory launch fewer
    kernels (a Titans memory starts from its expanded meta parameters with zero
    momentum: its first three chunks differ), so the counts start past them. When the
    context ``seq_len`` holds several CMS read blocks (``cms_read_block``), T1 is a
    multiple of those blocks too: a block's launches repeat per block (the first,
    with nothing carried, launches fewer), so whole blocks keep the count affine."""
    sizes = [*cfg.cms_periods, cfg.smt_chunk, cfg.smt_mem_chunk, cfg.titans_chunk]
    sizes += read_blocks_within(cfg, seq_len)
    unit = math.lcm(*sizes)
    chunk = max(cfg.smt_chunk, cfg.smt_mem_chunk, cfg.titans_chunk)
    first = unit * -(-4 * chunk // unit)
    return first, 2 * first


# Counts already made in this process, by everything a count depends on (the narrow
# model's whole config, the context, the read forms, the memory backend in force):
# presets that share a chunking and head count (mid and target) share their narrow
# models, so each is counted once.
_COUNTS: dict[tuple[str, int, tuple[str, ...], str], int] = {}


def narrow_model(cfg: ModelConfig, n_layers: int) -> ModelConfig:
    """The counting copy of ``cfg``: its chunking and heads, ``n_layers`` layers, small
    widths."""
    return dataclasses.replace(
        cfg, dim=COUNT_WIDTH_PER_HEAD * cfg.n_heads, n_layers=n_layers, vocab_size=64
    )


def counting_group(preset: str, variant: str) -> tuple[str, tuple[int, int], tuple[str, ...]]:
    """What every count of ``project_variant(preset, variant)`` depends on besides the
    backend: projections with equal groups make the same counts (mid and target)."""
    cfg = preset_model(preset, variant)
    seq_len = preset_seq_len(preset)
    forms = tuple(preset_read_forms(cfg, seq_len))
    return repr(narrow_model(cfg, 1)), counting_lengths(cfg, seq_len), forms


def count_step_launches(
    cfg: ModelConfig, seq_len: int, n_layers: int, read_forms: list[str]
) -> int:
    """Kernel launches of one CPU training step (AdamW) of a narrow copy of ``cfg``."""
    narrow = narrow_model(cfg, n_layers)
    key = (repr(narrow), seq_len, tuple(read_forms), resolve_backend(None))
    if key not in _COUNTS:
        _COUNTS[key] = _count(narrow, seq_len, read_forms)
    return _COUNTS[key]


def _count(narrow: ModelConfig, seq_len: int, read_forms: list[str]) -> int:
    torch.manual_seed(0)
    model = build_model(narrow)
    apply_read_forms(model, read_forms)
    model.train()
    optim_cfg = OptimConfig()
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, 2)
    make_optimizer_state(model, optimizer)
    tokens = torch.randint(0, 64, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    counter = LaunchCounter()
    with counter:
        train_step(model, optimizer, scheduler, tokens[:, :-1], tokens[:, 1:], 1.0, None)
    return counter.count


def make_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its state as after a first step, so a counted step launches
    what every later step does: AdamW makes its moments on its first step (a
    ``zeros_like`` per moment and parameter, ~75 launches per HOPE layer that no later
    step pays). One step on zero gradients; a step's launches do not depend on
    values (no data-dependent branch: tests/test_cuda_syncs.py)."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fit_launches(cfg: ModelConfig, seq_len: int) -> LaunchFit:
    """The affine launch model of ``cfg`` from four counts at its counting lengths, with
    the CMS read forms the preset's widths choose at ``seq_len``."""
    forms = preset_read_forms(cfg, seq_len)
    short, long = counting_lengths(cfg, seq_len)
    counts = {
        (layers, length): count_step_launches(cfg, length, layers, forms)
        for layers in (1, 2)
        for length in (short, long)
    }
    layer_short = counts[2, short] - counts[1, short]
    layer_long = counts[2, long] - counts[1, long]
    layer_per_token = (layer_long - layer_short) / (long - short)
    layer = layer_short - layer_per_token * short
    base_short, base_long = counts[1, short] - layer_short, counts[1, long] - layer_long
    base_per_token = (base_long - base_short) / (long - short)
    return LaunchFit(
        base_short - base_per_token * short, base_per_token, layer, layer_per_token, (short, long)
    )


def recurrence_programs(cfg: ModelConfig, batch: int, backend: str | None = None) -> int:
    """Programs of a kernel that runs the memories' chunk recurrence under
    ``backend`` (the default in force when None): one per (sample, head) for the fused
    SMT step and walk and the Titans memory's kernels; 0 where the recurrence runs as
    batched PyTorch ops (``torch``, ``compile``, ``fla``), which spread over the device
    as any batched product does, or where there is none."""
    if resolve_backend(backend) != "fused" or not flops.recurrent_forward_flops(cfg):
        return 0
    return batch * cfg.n_heads


def occupancy(programs: int, multiprocessors: int) -> float:
    """The fraction of a device's multiprocessors a kernel of ``programs`` programs can
    keep busy (1 for 0: no such kernel)."""
    return 1.0 if programs <= 0 else min(1.0, programs / multiprocessors)


def recurrent_dot(precision: str) -> str:
    """The fused kernels' fp32 product precision in a run of ``train.precision``
    ``precision`` on CUDA (``hope.train.device.allows_tf32``)."""
    return "tf32" if allows_tf32(precision) else "ieee"


def project_step(
    cfg: ModelConfig,
    seq_len: int,
    batch: int,
    launches: int,
    params: int,
    backend: str | None = None,
    precision: str = "bf16",
) -> dict[str, Any]:
    """Projected step of ``batch`` sequences on each device in ``DEVICES``. Under the
    ``fused`` backend the memories' recurrent work (``flops.recurrent_training_flops_per_
    token``) runs in kernels of ``recurrence_programs`` programs: at ACHIEVABLE of the
    fp32 product peak of ``train.precision`` ``precision`` (``recurrent_dot``) on the
    multiprocessors they occupy, not of the device's bf16 peak."""
    tokens = batch * seq_len
    step_flops = flops.training_flops_per_token(cfg, seq_len) * tokens
    fused = resolve_backend(backend) == "fused"
    executed = flops.executed_training_flops_per_token(cfg, seq_len, fused) * tokens
    programs = recurrence_programs(cfg, batch, backend)
    recurrent = flops.recurrent_training_flops_per_token(cfg, seq_len, fused) * tokens
    recurrent = recurrent if programs else 0.0
    dot = recurrent_dot(precision)
    activation_bytes = ACTIVATION_BYTES_PER_TOKEN * cfg.dim * cfg.n_layers * tokens
    step_bytes = OPTIMIZER_BYTES_PER_PARAM * params + activation_bytes
    devices = {}
    for name, (peak, bandwidth) in DEVICES.items():
        # floor: the useful work alone; work: what the step's forms execute
        floor = max(step_flops / (peak * ACHIEVABLE), step_bytes / bandwidth)
        busy = occupancy(programs, MULTIPROCESSORS[name])
        recurrent_s = recurrent / busy / (FP32_PRODUCT_PEAKS[dot][name] * ACHIEVABLE)
        compute = (executed - recurrent) / (peak * ACHIEVABLE) + recurrent_s
        work = max(compute, step_bytes / bandwidth)
        eager, graph = work + launches * EAGER_LAUNCH_S, work + launches * GRAPH_LAUNCH_S
        devices[name] = {
            "floor_ms": floor * 1e3,
            "occupancy": busy,
            "work_ms": work * 1e3,
            "eager_ms": eager * 1e3,
            "graph_ms": graph * 1e3,
            "eager_over_floor": eager / floor,
            "graph_over_floor": graph / floor,
            "mfu_eager": step_flops / (eager * peak),
            "mfu_graph": step_flops / (graph * peak),
        }
    return {
        "rows": batch,
        "tokens": tokens,
        "flops": step_flops,
        "executed_flops": executed,
        "recurrent_flops": recurrent,
        "programs": programs,
        "recurrent_dot": dot if programs else None,
        "bytes": step_bytes,
        "launches": launches,
        "devices": devices,
    }


def preset_model(preset: str, variant: str) -> ModelConfig:
    cfg: Config = load_config(None, [f"preset={preset}", f"model.variant={variant}"])
    return cfg.model


def preset_seq_len(preset: str) -> int:
    """The context length ``data.seq_len`` of ``preset``."""
    return load_config(None, [f"preset={preset}"]).data.seq_len


def preset_precision(preset: str) -> str:
    """``train.precision`` of ``preset``: the precision ``hope train --preset P`` runs in."""
    return load_config(None, [f"preset={preset}"]).train.precision


def preset_micro_batch(preset: str) -> int:
    """Rows per forward/backward of ``preset``: its ``train.micro_batch_size``, else
    the whole batch of one data-parallel rank."""
    train = load_config(None, [f"preset={preset}"]).train
    if train.micro_batch_size is not None:
        return train.micro_batch_size
    return max(1, train.batch_size // (train.nproc_per_node * train.nnodes))


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of ``cfg`` without allocating them (meta device)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def project_variant(preset: str, variant: str) -> dict[str, Any]:
    """One preset's projection for ``variant``: its launch model, the preset's
    micro-batch (``preset_micro_batch`` rows) and, for the pilot preset, the bench's ``pilot`` shape
    and HOPE with the frozen-base reads of the bench's ``pilot_frozen`` shape."""
    cfg = preset_model(preset, variant)
    seq_len = preset_seq_len(preset)
    fit = fit_launches(cfg, seq_len)
    launches = fit.predict(cfg.n_layers, seq_len)
    rows, precision = preset_micro_batch(preset), preset_precision(preset)
    row: dict[str, Any] = {
        "launch_fit": dataclasses.asdict(fit),
        "launches_per_layer": round(fit.layer + fit.layer_per_token * seq_len),
        "micro_batch": project_step(
            cfg, seq_len, rows, launches, count_parameters(cfg), precision=precision
        ),
    }
    if variant == "hope" and preset == "pilot":  # the throughput mode of pilot_frozen
        from hope.bench.shapes import FROZEN_SMT

        frozen = dataclasses.replace(cfg, **FROZEN_SMT)
        frozen_fit = fit_launches(frozen, seq_len)
        row["frozen_reads"] = {
            "smt": FROZEN_SMT,
            "launches_per_layer": round(
                frozen_fit.layer + frozen_fit.layer_per_token * seq_len
            ),
            "micro_batch": project_step(
                frozen, seq_len, rows, frozen_fit.predict(cfg.n_layers, seq_len),
                count_parameters(frozen), precision=precision,
            ),
        }  # fmt: skip
    if preset == "pilot":  # the bench's GPU shape: two layers, batch 4, T 4096
        # (in the bench's precision on a GPU, auto: bf16, TF32 allowed; the default)
        from hope.bench.shapes import PILOT_BATCH, PILOT_MODEL, PILOT_SEQ_LEN

        shape = dataclasses.replace(cfg, **PILOT_MODEL)
        row["bench_pilot_shape"] = project_step(
            shape,
            PILOT_SEQ_LEN,
            PILOT_BATCH,
            fit.predict(shape.n_layers, PILOT_SEQ_LEN),
            count_parameters(shape),
        )
    return row


def constants() -> dict[str, Any]:
    return {
        "devices_peak_bf16_flops_and_bandwidth": {k: list(v) for k, v in DEVICES.items()},
        "fused_fp32_product_peaks": FP32_PRODUCT_PEAKS,
        "achievable_fraction_of_peak": ACHIEVABLE,
        "eager_launch_s": EAGER_LAUNCH_S,
        "graph_launch_s": GRAPH_LAUNCH_S,
        "multiprocessors": MULTIPROCESSORS,
        "optimizer_bytes_per_param": OPTIMIZER_BYTES_PER_PARAM,
        "activation_bytes_per_token_per_dim_per_layer": ACTIVATION_BYTES_PER_TOKEN,
    }

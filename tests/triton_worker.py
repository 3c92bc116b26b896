"""Runs the Triton kernels of the fused backend on the device given as argv[1] and
prints, as JSON, their largest differences from the PyTorch forms (tests/test_fused_ops.py
runs it on a CPU under TRITON_INTERPRET=1, which must be set before Triton is imported;
scripts/gpu_check.sh's tests run it on CUDA). With HOPE_TF32=1 the fp32 products are the
TF32 ones of a bf16 run (``allow_tf32``): ``TRITON_INTERPRET=1 HOPE_TF32=1
PYTHONPATH=tests python tests/triton_worker.py cpu float32`` gives what TF32 costs."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from hope.layers import rotary_tables
from hope.memory.ops.chunk import chunk_dgd_update, chunk_momentum_update, momentum_chunk_weights
from hope.memory.ops.chunk_rates import chunk_rates_backward_reference, chunk_rates_reference
from hope.memory.ops.cms_factor_scan import cms_factor_scan_reference
from hope.memory.ops.end_weights import chunk_end_weights_backward_reference
from hope.memory.ops.fused import dgd_chunk_backward_reference, momentum_chunk_backward_reference
from hope.memory.ops.generation import (
    smt_generation_backward_reference,
    smt_generation_reference,
)
from hope.memory.ops.memory_apply import memory_apply_backward_reference, memory_apply_reference
from hope.memory.ops.memory_pass import memory_pass_backward_reference, memory_pass_reference
from hope.memory.ops.pointwise import l2_normalize_backward_reference
from hope.memory.ops.rms_norm import rms_norm_backward_reference, rms_norm_reference
from hope.memory.ops.rotary import rotary_reference
from hope.memory.ops.segment_attention import (
    segment_attention_backward_reference,
    segment_attention_reference,
)
from hope.memory.ops.smt_step import smt_step_backward_reference, smt_step_reference
from hope.memory.ops.smt_walk import smt_walk_backward_reference, smt_walk_reference
from hope.memory.ops.smt_write import smt_write_backward_reference, smt_write_reference
from hope.memory.ops.titans_heads import (
    titans_heads_backward_reference,
    titans_heads_reference,
)
from hope.memory.ops.triton_apply import memory_apply_backward_triton, memory_apply_triton
from hope.memory.ops.triton_chunk_rates import (
    titans_chunk_rates_backward_triton,
    titans_chunk_rates_triton,
)
from hope.memory.ops.triton_cms import cms_factor_scan_triton
from hope.memory.ops.triton_end_weights import (
    chunk_end_weights_backward_triton,
    chunk_end_weights_triton,
)
from hope.memory.ops.triton_generation import (
    smt_generation_backward_triton,
    smt_generation_triton,
)
from hope.memory.ops.triton_heads import titans_heads_backward_triton, titans_heads_triton
from hope.memory.ops.triton_kernels import (
    bounded_step_triton,
    dgd_chunk_backward_triton,
    dgd_chunk_triton,
    l2_normalize_backward_triton,
    l2_normalize_triton,
)
from hope.memory.ops.triton_momentum import momentum_chunk_backward_triton, momentum_chunk_triton
from hope.memory.ops.triton_norm import rms_norm_backward_triton, rms_norm_triton
from hope.memory.ops.triton_pass import memory_pass_backward_triton, memory_pass_triton
from hope.memory.ops.triton_rotary import rotary_triton
from hope.memory.ops.triton_segment_attention import (
    segment_attention_backward_triton,
    segment_attention_triton,
)
from hope.memory.ops.triton_step import smt_step_backward_triton, smt_step_triton
from hope.memory.ops.triton_walk import smt_walk_backward_triton, smt_walk_triton
from hope.memory.ops.triton_write import smt_write_backward_triton, smt_write_triton
from hope.memory.residual_mlp import overshoot_ratio

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_language_once_per_launch() -> None:
    """Triton's interpreter maps triton.language onto its own semantics at each launch
    and again at every call of a nested @triton.jit function: a walk over the modules'
    members each time (about a third of this worker's time) that, after a function's
    first call in a launch, finds everything already mapped (the mappings last until
    the launch restores them). Here each function maps once per launch."""
    from triton.runtime import interpreter

    mapped: set[int] = set()
    plain_patch, plain_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__

    def patch_lang(fn: Any) -> Any:
        if id(fn) in mapped:
            return interpreter._LangPatchScope()  # nothing to record or restore
        mapped.add(id(fn))
        return plain_patch(fn)

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        mapped.clear()
        try:
            return plain_launch(self, *args, **kwargs)
        finally:
            mapped.clear()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch


if INTERPRETED:
    patch_language_once_per_launch()


def allow_tf32() -> None:
    """The kernels' fp32 products as a bf16 run makes them (``dot_precision``: "tf32").
    Under the interpreter, which multiplies every tl.dot in full fp32, their operands
    are rounded to TF32's 10 mantissa bits first, as tensor cores read them, so the
    errors are the ones a GPU would show (HOPE_TF32=1)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    if not INTERPRETED:
        return
    import numpy as np
    from triton.runtime import interpreter

    plain = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, precision: Any, imprecise: Any) -> Any:
        if str(precision).upper().endswith("TF32") and a.data.dtype == np.float32:
            a, b = (interpreter.TensorHandle(interpreter._round_f32_to_tf32(t.data), t.dtype)
                    for t in (a, b))  # fmt: skip
        return plain(self, a, b, d, precision, imprecise)

    interpreter.InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]


# (C, I, h_m, O): padded and unpadded sizes, one token, several h_m blocks, C > 16.
SHAPES = [(8, 12, 40, 5), (16, 16, 64, 16), (1, 4, 8, 1), (20, 8, 136, 8)]


def inputs(c: int, i: int, m: int, o: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(c * 1000 + m)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)

    b, h = 2, 3
    k = torch.nn.functional.normalize(rand(b, h, c, i), dim=-1)
    eta = (0.05 + 0.5 * torch.rand(b, h, c, generator=gen, dtype=torch.float64)).to(device, dtype)
    alpha = (0.6 + 0.4 * torch.rand(b, h, c, generator=gen, dtype=torch.float64)).to(device, dtype)
    return [rand(b, h, o, m, scale=0.3), rand(b, h, m, i, scale=0.5), k, rand(b, h, c, o),
            rand(b, h, c, m), rand(b, h, c, m), eta, alpha, rand(b, h, c, m)]  # fmt: skip


def worst(got: tuple[Any, ...], want: tuple[Any, ...]) -> float:
    """Largest |got - want| relative to the largest |want| of each non-empty tensor."""
    return max(
        ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        for g, w in zip(got, want, strict=True)
        # an absent gradient or an empty tensor (a conv without history) has no error
        if w is not None and w.numel()
    )


def distinct_storages(name: str, outputs: Any) -> None:
    """A custom operator's outputs (a tensor or a sequence) may share no storage:
    torch.library refuses them, as the H200 run of the fused step did when two empty
    outputs were one tensor."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seq = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    refs = [StorageWeakRef(t.untyped_storage()) for t in seq if t is not None]
    if len(set(refs)) != len(refs):
        raise AssertionError(f"{name}: outputs share storage")


def momentum_errors(
    c: int, i: int, m: int, o: int, dtype: torch.dtype, device: str
) -> dict[str, float]:
    """The Titans write's kernels against ``chunk_momentum_update`` and the reference
    backward."""
    w1, w2, k, e, a, d, eta, alpha, _ = inputs(c, i, m, o, dtype, device)
    theta, keep = 0.2 * eta, alpha  # steps in (0.01, 0.11), retention in (0.6, 1)
    decay = 0.5 + 0.9 * (eta - 0.05)  # momentum decay in (0.5, 0.95)
    s1, s2 = 0.3 * w1.flip(-1), 0.3 * w2.flip(-1)
    x = (w1, w2, s1, s2, k, e, a, d, theta, decay, keep, momentum_chunk_weights(decay, keep))
    name = f"{str(dtype).removeprefix('torch.')}_C{c}_I{i}_M{m}_O{o}"
    want = chunk_momentum_update(*x)
    gen = torch.Generator().manual_seed(11)
    grads = tuple(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device, dtype)
                  for t in want)  # fmt: skip
    return {
        f"momentum_forward_{name}": worst(momentum_chunk_triton(*x), want),
        f"momentum_backward_{name}": worst(
            momentum_chunk_backward_triton(x, grads), momentum_chunk_backward_reference(x, grads)
        ),
    }


def shared_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """The DGD write with k and alpha shared by two stacked members, and the bounded
    step with a shared eta, against the PyTorch forms on per-member copies."""
    w1, w2, k, e, a, d, eta, alpha, w2k = inputs(12, 16, 40, 16, dtype, device)
    twice = [torch.cat([t, 0.7 * t.flip(-1)], dim=1) for t in (w1, w2, e, a, d, w2k)]
    eta2 = torch.cat([eta, eta.flip(-1)], dim=1)
    shared = (*twice[:2], k, *twice[2:5], eta2, alpha, twice[5])
    copies = (*twice[:2], k.repeat(1, 2, 1, 1), *twice[2:5], eta2, alpha.repeat(1, 2, 1),
              twice[5])  # fmt: skip
    want = chunk_dgd_update(*copies[:2], *copies[:2], *copies[2:8], True, 0.0, copies[8])
    name = f"shared_{str(dtype).removeprefix('torch.')}"
    errors = {f"{name}_forward": worst(dgd_chunk_triton(*shared), want)}
    gen = torch.Generator().manual_seed(9)
    g_w1, g_w2 = (rand_like(t, gen) for t in want[:2])
    errors[f"{name}_backward"] = worst(
        dgd_chunk_backward_triton(shared, g_w1, g_w2, None, None),
        dgd_chunk_backward_reference(shared, g_w1, g_w2, None, None),
    )
    act = torch.randn(2, 6, 12, 24, generator=gen, dtype=torch.float64)
    kernel = (act @ act.transpose(-1, -2)).abs().to(device, dtype)
    step = (0.1 * torch.rand(2, 3, 12, generator=gen, dtype=torch.float64)).to(device, dtype)
    rho = overshoot_ratio(kernel, step.repeat(1, 2, 1))
    bounded = (step.repeat(1, 2, 1) / (1.0 + rho.unsqueeze(-1)), 1.0 / (1.0 + rho))
    errors[f"{name}_bounded"] = worst(bounded_step_triton(kernel, step), bounded)
    return errors


def normalize_errors(width: int, dtype: torch.dtype, device: str) -> dict[str, float]:
    """Rows of 37 (several blocks, a partial one), one zero and one tiny row."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(37, width, generator=gen, dtype=torch.float64)
    x[3], x[5] = 0.0, 1e-14 * x[5]
    grad = torch.randn(37, width, generator=gen, dtype=torch.float64)
    x, grad = x.to(device, dtype), grad.to(device, dtype)
    name = f"{str(dtype).removeprefix('torch.')}_D{width}"
    ref = torch.nn.functional.normalize(x, dim=-1)
    live = slice(6, None)  # the clamped rows' gradients are ~1e12: compare them apart
    back, back_ref = l2_normalize_backward_triton(x, grad), l2_normalize_backward_reference(x, grad)
    return {
        f"normalize_forward_{name}": worst((l2_normalize_triton(x),), (ref,)),
        f"normalize_backward_{name}": max(
            worst((back[live],), (back_ref[live],)), worst((back[:6],), (back_ref[:6],))
        ),
    }


def rms_norm_errors(width: int, dtype: torch.dtype, device: str) -> dict[str, float]:
    """37 rows (several blocks, a partial one) of mean square 0.25..4 (eps reaches the
    kernel as an fp32 scalar: its rounding stays below the float64 bound here)."""
    gen = torch.Generator().manual_seed(100 + width)
    scale = torch.linspace(0.5, 2.0, 37, dtype=torch.float64)[:, None]
    x = torch.randn(37, width, generator=gen, dtype=torch.float64) * scale
    weight = 1.0 + 0.1 * torch.randn(width, generator=gen, dtype=torch.float64)
    grad = torch.randn(37, width, generator=gen, dtype=torch.float64)
    x, weight, grad = (t.to(device, dtype) for t in (x, weight, grad))
    name = f"rms_norm_{str(dtype).removeprefix('torch.')}_D{width}"
    forward = worst((rms_norm_triton(x, weight, 1e-6),), (rms_norm_reference(x, weight, 1e-6),))
    got = rms_norm_backward_triton(x, weight, grad, 1e-6)
    distinct_storages("rms_norm_backward_triton", got)
    want = rms_norm_backward_reference(x, weight, grad, 1e-6)
    return {f"{name}_forward": forward, f"{name}_backward": worst(got, want)}


def rotary_errors(dim: int, dtype: torch.dtype, device: str) -> dict[str, float]:
    """k as a permuted view of a [B, T, 3, H, D] projection, 37 positions from 5 (several
    blocks, a partial one), both directions."""
    gen = torch.Generator().manual_seed(200 + dim)
    qkv = torch.randn(2, 37, 3, 3, dim, generator=gen, dtype=torch.float64).to(device, dtype)
    k = qkv.permute(2, 0, 3, 1, 4)[1]
    cos, sin = rotary_tables(dim, 5, 37, 10000.0, torch.device(device), dtype)
    name = f"rotary_{str(dtype).removeprefix('torch.')}_D{dim}"
    return {
        f"{name}_{way}": worst(
            (rotary_triton(k, cos, sin, inverse),), (rotary_reference(k, cos, sin, inverse),)
        )
        for way, inverse in (("forward", False), ("inverse", True))
    }


# The memory pass (G stacked members, H heads, C keys, C_q queries, I, h_m): the SMT's
# mixed-residual stack with partial reads, its single memory without reads and with
# the dot loss, the Titans memory (given targets, C > 16, several h_m blocks).
PASS_CASES = [
    {"g": 3, "h": 2, "c": 8, "cq": 3, "i": 12, "m": 40, "mode": "smt"},
    {"g": 1, "h": 2, "c": 5, "cq": 0, "i": 8, "m": 16, "mode": "dot"},
    {"g": 1, "h": 3, "c": 20, "cq": 20, "i": 16, "m": 136, "mode": "titans"},
]


def pass_errors(case: dict[str, Any], dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::memory_pass``'s kernels against the reference forms, every output and
    every gradient (D's, E's and the read's absent in one call)."""
    g, h, c, cq, i, m, mode = case.values()
    gen = torch.Generator().manual_seed(c * 100 + m)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)

    b, titans = 2, mode == "titans"
    scale = None if g == 1 else torch.tensor([1.0, 0.0, 1.0], dtype=dtype, device=device)
    scale = None if scale is None else scale.repeat_interleave(h)
    x = (rand(b, g * h, i, m, scale=0.3), rand(b, g * h, m, i, scale=0.5), rand(b, h, c, i),
         None if titans else rand(b, h, c, i), rand(b, h, cq, i) if cq else None,
         rand(b, g * h, c, i) if titans else None, scale)  # fmt: skip
    options = (g == 1 and mode != "dot", mode == "dot")
    want = memory_pass_reference(*x, *options)
    name = f"pass_{mode}_{str(dtype).removeprefix('torch.')}"
    present = [j for j, t in enumerate(want) if t.numel()]  # v_hat, read may be empty
    got = memory_pass_triton(*x, *options)
    distinct_storages("memory_pass_triton", got)
    errors = {
        f"{name}_forward": worst(tuple(got[j] for j in present), tuple(want[j] for j in present))
    }
    for missing in ((), (1, 2, 4)):
        grads = [None if j in missing or not t.numel() else rand(*t.shape)
                 for j, t in enumerate(want[:7])]  # fmt: skip
        if grads[1] is not None:  # the reads' gradient as a slice of a joined one's
            rows = want[1].shape[2]
            grads[1] = rand(b, g * h, rows + 3, want[1].shape[3])[:, :, 2 : 2 + rows]
        saved = (*x, want[2])
        got = memory_pass_backward_triton(saved, *options, tuple(grads))
        distinct_storages("memory_pass_backward_triton", got)
        ref = memory_pass_backward_reference(saved, *options, tuple(grads))
        pairs = [(a, r) for a, r in zip(got, ref, strict=True) if r is not None]
        errors[f"{name}_backward{len(missing)}"] = worst(*zip(*pairs, strict=True))
    return errors


def apply_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::memory_apply``'s kernels: a mixed-residual stack's first two members
    (T = 20 > 16 rows, several h_m blocks), and the last one alone (a read)."""
    gen = torch.Generator().manual_seed(3)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)

    b, g, h, t, i, m = 2, 3, 2, 20, 12, 72
    w1, w2, z = rand(b, g * h, i, m, scale=0.3), rand(b, g * h, m, i, scale=0.5), rand(b, h, t, i)
    scale = torch.tensor([1.0, 0.0, 1.0], dtype=dtype, device=device).repeat_interleave(h)
    errors = {}
    for first, count, flags in ((0, 2, scale), (2, 1, None)):
        x = (w1, w2, z, flags, flags is None, first, count)
        name = f"apply_{first}_{count}_{str(dtype).removeprefix('torch.')}"
        want = memory_apply_reference(*x)
        errors[f"{name}_forward"] = worst((memory_apply_triton(*x),), (want,))
        grad = rand(*want.shape)
        errors[f"{name}_backward"] = worst(
            memory_apply_backward_triton(*x, grad), memory_apply_backward_reference(*x, grad)
        )
    # MAC's retrieval: z a chunk of token-major queries, the output token-major and its
    # gradient a transposed view, all read or written through their strides
    x = (w1, w2, rand(b, t + 4, h, i).transpose(1, 2)[:, :, 2 : 2 + t], None, True, 2, 1)
    name = f"apply_strided_{str(dtype).removeprefix('torch.')}"
    got = memory_apply_triton(*x, True)
    distinct_storages("memory_apply_triton", got)
    if not got.transpose(1, 2).is_contiguous():
        raise AssertionError(f"{name}: not token-major, strides {got.stride()}")
    errors[f"{name}_forward"] = worst((got,), (memory_apply_reference(*x),))
    grad = rand(b, t, h, i).transpose(1, 2)
    errors[f"{name}_backward"] = worst(
        memory_apply_backward_triton(*x, grad), memory_apply_backward_reference(*x, grad)
    )
    return errors


def rand_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Normal entries drawn in float64 on the CPU, then moved to t's device and dtype."""
    return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device, t.dtype)


def generation_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::smt_generation``'s kernels, with a fixed and an adaptive query, softplus
    past its threshold; every gradient, then only v's and alpha's. (No zero row: its
    gradient, g / eps, would hide every other row's error in the relative measure;
    ``normalize_errors`` covers the clamp.)"""
    errors = {}
    for adaptive in (False, True):
        gen = torch.Generator().manual_seed(2)
        b, h, t, o = 2, 3, 7, 12
        members = 5 if adaptive else 4
        raw = torch.randn(b, members * h, t, o, generator=gen, dtype=torch.float64)
        raw[:, -2 * h :, :, 1:] = 0.0  # the scalar memories' padded columns
        raw[:, -2 * h : -h, :2, 0] = torch.tensor([25.0, -30.0], dtype=torch.float64)
        query = None if adaptive else torch.randn(b, h, t, o, generator=gen, dtype=torch.float64)
        bias = torch.randn(h, generator=gen, dtype=torch.float64)
        raw, bias = raw.to(device, dtype), bias.to(device, dtype)
        query = None if query is None else query.to(device, dtype)
        want = smt_generation_reference(raw, query, bias, 0.7)
        name = f"generation_{'adaptive_' if adaptive else ''}{str(dtype).removeprefix('torch.')}"
        errors[f"{name}_forward"] = worst(smt_generation_triton(raw, query, bias, 0.7), want)
        for missing in ((), (0, 2, 3)):
            grads = [None if j in missing else rand_like(w, gen) for j, w in enumerate(want)]
            args = (raw, query, want[4], 0.7, grads)
            got = smt_generation_backward_triton(*args)
            distinct_storages("smt_generation_backward_triton", got)
            ref = smt_generation_backward_reference(*args)
            pairs = [(a, r) for a, r in zip(got, ref, strict=True) if r is not None]
            errors[f"{name}_backward{len(missing)}"] = worst(*zip(*pairs, strict=True))
    return errors


# The whole SMT write (G, H, C, C_q, I, h_m, mode): a mixed-residual stack with partial
# reads, one memory with the dot loss and no reads, a wide chunk of four members.
WRITE_CASES = [
    (3, 2, 8, 3, 12, 40, "l2"),
    (1, 2, 5, 0, 8, 16, "dot"),
    (4, 1, 20, 20, 16, 136, "l2"),
]


def write_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::smt_write``'s kernels against its reference, every output and gradient
    (the increments' and the reads' absent in a second backward)."""
    errors = {}
    for g, h, c, cq, i, m, mode in WRITE_CASES:
        gen = torch.Generator().manual_seed(c * 10 + m)

        def rand(*shape: int, scale: float = 1.0, gen: torch.Generator = gen) -> torch.Tensor:
            x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
            return x.to(device, dtype)

        def unit(*shape: int) -> torch.Tensor:
            return torch.nn.functional.normalize(rand(*shape), dim=-1)

        gates = [(lo + span * torch.rand(2, h, c, generator=gen, dtype=torch.float64))
                 .to(device, dtype) for lo, span in ((0.05, 0.5), (0.6, 0.4))]  # fmt: skip
        scale = None if g == 1 else torch.tensor([1.0, 0.0, 1.0, 1.0][:g], dtype=dtype)
        x = (rand(2, g * h, i, m, scale=0.3), rand(2, g * h, m, i, scale=0.5), unit(2, h, c, i),
             unit(2, h, c, i), unit(2, h, cq, i) if cq else None, *gates,
             None if scale is None else scale.to(device).repeat_interleave(h))  # fmt: skip
        options = (scale is None and mode == "l2", mode == "dot")
        want = smt_write_reference(x, *options)
        name = f"write_{g}x{c}_{mode}_{str(dtype).removeprefix('torch.')}"
        present = [j for j, t in enumerate(want) if t.numel()]
        got = smt_write_triton(x, *options)
        distinct_storages("smt_write_triton", got)
        errors[f"{name}_forward"] = worst(tuple(got[j] for j in present),
                                          tuple(want[j] for j in present))  # fmt: skip
        for missing in ((), (2, 3, 4)):
            grads = tuple(None if j in missing or not w.numel() else rand_like(w, gen)
                          for j, w in enumerate(want))  # fmt: skip
            got_g = smt_write_backward_triton(x, *options, grads)
            distinct_storages("smt_write_backward_triton", got_g)
            ref_g = smt_write_backward_reference(x, *options, grads)
            pairs = [(a, r) for a, r in zip(got_g, ref_g, strict=True) if r is not None]
            errors[f"{name}_backward{len(missing)}"] = worst(*zip(*pairs, strict=True))
    return errors


# The whole SMT chunk step (M_mem in the stack, adaptive q, dot loss, C, d_h, h_m, pending
# tokens, M_mem written, the gradients left out): both reads, both queries, pending tokens
# with and without M_mem's write, padded and unpadded sizes, several h_m blocks, absent
# gradients of every kind.
STEP_CASES = [
    (True, False, False, 5, 8, 12, 0, False, ()),
    (True, True, False, 5, 8, 12, 0, False, (4, 6)),
    (False, False, False, 8, 16, 136, 8, True, (2, 3, 6)),
    (False, True, False, 3, 8, 12, 6, False, (0, 1, 5, 7, 11)),
    (False, False, True, 4, 8, 12, 0, True, (9,)),
    (True, False, True, 16, 16, 40, 0, False, ()),
]


def _keep_layout(t: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """``t`` on ``device`` in ``dtype`` with its strides (``.to`` makes strided views dense)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=device).copy_(t)


def step_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::smt_step``'s kernels against its reference, every output and gradient."""
    errors = {}
    for own, adaptive, dot, c, d, m, held, flush, missing in STEP_CASES:
        gen = torch.Generator().manual_seed(c * 7 + m + held)

        def rand(*shape: int, scale: float = 1.0, gen: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

        b, h, g = 2, 2, 5 if adaptive else 4  # two heads: the head offsets, fewer programs
        w1, w2 = rand(b, (g + own) * h, d, m, scale=0.3), rand(b, (g + own) * h, m, d, scale=0.5)
        w1[:, (g - 2) * h : g * h, 1:] = 0.0  # the scalar memories' padded rows
        mem = (None, None) if own else (rand(b, h, d, m, scale=0.3), rand(b, h, m, d, scale=0.5))
        flags = torch.tensor([1.0] * (g - 2) + [0.0, 0.0] + [1.0] * own, dtype=torch.float64)
        pending = (None, None)
        if held:
            rows = torch.nn.functional.normalize(rand(b, h, held, 3, d), dim=-1)
            gates = torch.stack(
                (
                    0.05 + 0.5 * torch.rand(b, h, held, generator=gen),
                    0.6 + 0.4 * torch.rand(b, h, held, generator=gen),
                ),
                dim=-1,
            )
            pending = (rows, gates.double())
        # x and the query strided as the SMT passes them (read in place by the kernels):
        # x a chunk of the conv's [B, D, T] output seen as heads, the query a chunk of
        # [B, H, T, D]
        x_in = rand(b, d, c + 3, h).permute(0, 3, 2, 1)[:, :, 1 : 1 + c]
        query = None if adaptive else rand(b, h, c + 2, d)[:, :, 2:]
        raw = (w1, w2, x_in, query, *mem, rand(h).expand(b, h), flags.repeat_interleave(h),
               *pending)  # fmt: skip
        x = tuple(None if t is None else _keep_layout(t, device, dtype) if j in (2, 3)
                  else t.to(device, dtype) for j, t in enumerate(raw))  # fmt: skip
        options = (False, dot, 0.7, g, flush)
        want = smt_step_reference(x, options)
        read, loss = "own" if own else "apart", "dot" if dot else "l2"
        tail = f"{'adaptive_' if adaptive else ''}C{c}_P{held}{'_flush' if flush else ''}"
        name = f"step_{read}_{tail}_{loss}_{str(dtype)[6:]}"
        present = [j for j, t in enumerate(want) if t.numel()]
        got = smt_step_triton(x, options)
        distinct_storages(f"{name} forward", got)  # a custom op's outputs may not alias
        errors[f"{name}_forward"] = worst(tuple(got[j] for j in present),
                                          tuple(want[j] for j in present))  # fmt: skip
        grads = tuple(None if j in missing or not w.numel() else rand_like(w, gen)
                      for j, w in enumerate(want))  # fmt: skip
        if grads[6] is not None:  # the read's gradient strided, as a [B, T, H, D] slice
            g_read = grads[6].transpose(1, 2).contiguous().transpose(1, 2)
            grads = (*grads[:6], g_read, *grads[7:])
        # the rows' and gates' gradients as slices of longer ones (the next step's pending)
        longer = [g if g is None else torch.cat((g, g), dim=2)[:, :, : g.shape[2]]
                  for g in grads[4:6]]  # fmt: skip
        grads = (*grads[:4], *longer, *grads[6:])
        saved = (*x, want[4], want[5])
        got_g = smt_step_backward_triton(saved, options, grads)
        distinct_storages(f"{name} backward", got_g)
        ref = smt_step_backward_reference(x, options, grads)
        if [t is None for t in got_g] != [t is None for t in ref]:
            raise AssertionError(f"{name}: gradients present {got_g} vs {ref}")
        pairs = [(a, r) for a, r in zip(got_g, ref, strict=True) if r is not None]
        errors[f"{name}_backward"] = worst(*zip(*pairs, strict=True))
    return errors


# A walk of chunk steps (M_mem in the stack, adaptive q, dot loss, chunks, period, the
# forward kept, a cut every N chunks): M_mem apart written every second chunk, its
# forward rerun in backward; in the stack, written every chunk, kept, a cut.
WALK_CASES = [(False, False, False, 4, 2, False, 0), (True, True, True, 3, 1, True, 2)]


def walk_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::smt_walk``'s kernels: the forward against the chained step kernels it
    runs (the same arithmetic) and, but for the increments, against its reference; the
    backward against its reference, with every gradient and with the reads' alone."""
    errors = {}
    for own, adaptive, dot, chunks, period, keep, cut in WALK_CASES:
        gen = torch.Generator().manual_seed(chunks + 10 * own)

        def rand(*shape: int, scale: float = 1.0, gen: torch.Generator = gen) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(
                device, dtype
            )

        b, h, g, c, d, m = 2, 2, 5 if adaptive else 4, 4, 8, 12
        w1, w2 = rand(b, (g + own) * h, d, m, scale=0.3), rand(b, (g + own) * h, m, d, scale=0.5)
        mem = (None, None) if own else (rand(b, h, d, m, scale=0.3), rand(b, h, m, d, scale=0.5))
        flags = torch.tensor([1.0] * (g - 2) + [0.0, 0.0] + [1.0] * own, dtype=dtype)
        x = rand(b, d, chunks * c, h).permute(0, 3, 2, 1)  # strided, as the SMT's heads
        query = None if adaptive else rand(b, h, chunks * c, d)
        inputs = (
            w1,
            w2,
            x,
            query,
            *mem,
            rand(h).expand(b, h),
            flags.to(device).repeat_interleave(h),
        )
        options = (False, dot, 0.7, g, c, period)
        name = f"walk_{'own' if own else 'apart'}_N{chunks}_{str(dtype)[6:]}"
        got = smt_walk_triton(inputs, options, keep)
        distinct_storages(f"{name} forward", got)
        steps, pending, state = [], (None, None), list(inputs[:2]) + list(mem)
        for k in range(chunks):
            flush = not own and k % period == period - 1
            span = slice(k * c, (k + 1) * c)
            step = (*state[:2], x[:, :, span], None if query is None else query[:, :, span],
                    *state[2:], inputs[6], inputs[7], *pending)  # fmt: skip
            out = smt_step_triton(step, (False, dot, 0.7, g, flush))
            steps.append(out)
            state = [out[0], out[1], *([None, None] if own else [out[7], out[8]])]
            pending = (None, None) if own or flush else (out[4], out[5])
        last = steps[-1]
        chained = (*last[:4], torch.cat([o[6] for o in steps], dim=2), *last[7:11], last[11])
        present = [j for j, t in enumerate(chained) if t.numel()]
        errors[f"{name}_forward_steps"] = worst(tuple(got[j] for j in present),
                                                tuple(chained[j] for j in present))  # fmt: skip
        want = smt_walk_reference(inputs, options)
        kept = [j for j in (0, 1, 4, 5, 6, 9) if want[j].numel()]  # not the increments
        errors[f"{name}_forward"] = worst(tuple(got[j] for j in kept), tuple(want[j] for j in kept))
        grads = tuple(rand_like(w, gen) if w.numel() else None for w in want[:10])
        for label, given in (("", grads), ("_reads", (None,) * 4 + grads[4:5] + (None,) * 5)):
            got_g = smt_walk_backward_triton((*inputs, *got[10:]), options, given, cut)
            ref = smt_walk_backward_reference(inputs, options, given, cut)
            pairs = [(a, r) for a, r in zip(got_g, ref, strict=True) if r is not None]
            errors[f"{name}_backward{label}"] = worst(*zip(*pairs, strict=True))
    return errors


# The CMS chunk scan (rows L >= F fired tokens, F, hidden width, chunk): one-token
# chunks, a chunk wider than a row block, hidden blocks with a ragged last one, rows
# past the fired ones.
CMS_SCAN_CASES = [(12, 12, 20, 1), (96, 96, 16, 48), (40, 32, 136, 8)]


def cms_scan_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::cms_factor_scan``'s kernel against its reference, on block-causal scores
    (a token's row is nonzero only at earlier chunks' tokens, as ``cms_dual`` makes
    them)."""
    errors = {}
    for rows, fired, hid, chunk in CMS_SCAN_CASES:
        gen = torch.Generator().manual_seed(rows + hid)
        chunk_of = torch.arange(rows) // chunk
        earlier = chunk_of[:, None] > chunk_of[None, :fired]
        key, teach = ((torch.randn(2, rows, fired, generator=gen, dtype=torch.float64)
                       / fired**0.5 * earlier).to(device, dtype) for _ in range(2))  # fmt: skip
        pre_0, back_0 = (torch.randn(2, rows, hid, generator=gen, dtype=torch.float64)
                         .to(device, dtype) for _ in range(2))  # fmt: skip
        x = (pre_0, back_0, key, teach, chunk)
        name = f"cms_scan_F{fired}_C{chunk}_h{hid}_{str(dtype).removeprefix('torch.')}"
        errors[name] = worst(cms_factor_scan_triton(*x), cms_factor_scan_reference(*x))
    return errors


def end_weights_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::chunk_end_weights`` both ways on strided [B, H, C] views (the Titans gates),
    against ``momentum_chunk_weights`` and the reference backward: one token, a padded
    chunk, the pilot chunk."""
    errors = {}
    for c in (1, 20, 64):
        gen = torch.Generator().manual_seed(c)
        # momentum decays in (0.5, 0.95) and retentions in (0.6, 1), as momentum_errors
        low, span = torch.tensor([0.5] * 3 + [0.6] * 3), torch.tensor([0.45] * 3 + [0.4] * 3)
        gates = low + span * torch.rand(2, c, 6, generator=gen, dtype=torch.float64)
        eta, keep = gates.to(device, dtype).transpose(1, 2).split(3, dim=1)
        grad = torch.randn(2, 3, c, generator=gen, dtype=torch.float64).to(device, dtype)
        name = f"end_weights_{str(dtype).removeprefix('torch.')}_C{c}"
        want = momentum_chunk_weights(eta, keep)
        errors[f"{name}_forward"] = worst((chunk_end_weights_triton(eta, keep),), (want,))
        errors[f"{name}_backward"] = worst(
            chunk_end_weights_backward_triton(eta, keep, grad),
            chunk_end_weights_backward_reference(eta, keep, grad),
        )
    return errors


def chunk_rates_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::titans_chunk_rates`` both ways, every argument a strided view (the gates
    [B, T, 3H] transposed, the kernel bound transposed), against the PyTorch forms: one
    token, a padded chunk, the pilot chunk; the backward with every gradient and with
    only the rates' (the others absent). The kernel bound is large enough that the cap
    binds, and some curvatures are below 1 (clamped: no gradient)."""
    errors = {}
    for c in (1, 20, 64):
        gen = torch.Generator().manual_seed(c + 5)
        # theta in (0.05, 0.95); eta and keep = 1 - alpha as in ``end_weights_errors``
        low = torch.tensor([0.05] * 3 + [0.5] * 3 + [0.0] * 3)
        span = torch.tensor([0.9] * 3 + [0.45] * 3 + [0.4] * 3)
        gates = low + span * torch.rand(2, c, 9, generator=gen, dtype=torch.float64)
        theta, eta, alpha = gates.to(device, dtype).transpose(1, 2).split(3, dim=1)
        act = torch.randn(2, 3, c, 24, generator=gen, dtype=torch.float64)
        coupling = (act @ act.transpose(-1, -2)).abs().to(device, dtype).transpose(-1, -2)
        curvature = (torch.rand(2, 3, c, generator=gen, dtype=torch.float64) * 40).to(device, dtype)
        inputs = (theta, eta, alpha, curvature, coupling)
        grads = [torch.randn(2, 3, c, generator=gen, dtype=torch.float64).to(device, dtype)
                 for _ in range(3)]  # fmt: skip
        name = f"chunk_rates_{str(dtype).removeprefix('torch.')}_C{c}"
        want = chunk_rates_reference(*inputs)
        errors[f"{name}_forward"] = worst(titans_chunk_rates_triton(*inputs), want)
        errors[f"{name}_backward"] = worst(
            titans_chunk_rates_backward_triton(inputs, *grads),
            chunk_rates_backward_reference(inputs, *grads),
        )
        errors[f"{name}_backward_rates_only"] = worst(
            titans_chunk_rates_backward_triton(inputs, None, None, grads[2]),
            chunk_rates_backward_reference(inputs, None, None, grads[2]),
        )
    return errors


# The Titans heads (B, T, H, d_h, W): a call shorter than the window (its new tail holds
# old tail rows), several token blocks with a ragged last one and a conv weight per
# sample, no conv history (W = 1).
HEADS_SHAPES = [(2, 3, 2, 4, 4), (2, 37, 3, 8, 4), (1, 16, 2, 16, 1)]


def heads_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::titans_heads`` both ways against the PyTorch forms; the backward with
    every gradient (the heads' as transposed views) and with some absent."""
    errors = {}
    for b, t, h, d_h, w in HEADS_SHAPES:
        gen = torch.Generator().manual_seed(t)

        def rand(*shape: int, gen: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)

        # the projection [qkv | gates], the tail, the conv weight (per sample at T = 37)
        per_sample = (b,) if t == 37 else ()
        x = (rand(b, t, 3 * h * d_h + 3 * h), rand(b, w - 1, 3 * h * d_h),
             rand(*per_sample, 3 * h * d_h, w))  # fmt: skip
        want = titans_heads_reference(*x, h)
        name = f"heads_{str(dtype).removeprefix('torch.')}_T{t}_W{w}"
        errors[f"{name}_forward"] = worst(titans_heads_triton(*x, h), want)
        grads: list[torch.Tensor | None] = [rand(*o.shape) for o in want]
        grads[0] = rand(b, t, h, d_h).transpose(1, 2)
        for label, given in (("", grads), ("_some", [None, grads[1], None, grads[3], None,
                                                      None, grads[6]])):  # fmt: skip
            errors[f"{name}_backward{label}"] = worst(
                titans_heads_backward_triton(x, h, given),
                titans_heads_backward_reference(x, h, tuple(given)),
            )
    return errors


def segment_attention_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::segment_attention`` both ways against the PyTorch forms (B, H, S, D, N_p):
    a tile of exact size with P's values per sample, a short segment without P, a ragged
    one; q strided, h's projection with strided rows, the angles a slice of a table."""
    errors = {}
    for b, h, s, d, n_p in ((2, 3, 16, 8, 4), (2, 2, 5, 16, 0), (1, 2, 37, 12, 3)):
        gen = torch.Generator().manual_seed(s)

        def rand(*shape: int, gen: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)

        angles = 3 * rand(s + 1, d // 2)[1:]
        x = (rand(b, s, h, d).transpose(1, 2), rand(b, s, 2 * h * d + 3)[..., : 2 * h * d],
             angles.cos(), angles.sin(), *(rand(b, h, s, d) for _ in range(2)),
             rand(b, h, s, n_p) if n_p else None,
             rand(b if s == 16 else 1, h, n_p, d) if n_p else None)  # fmt: skip
        name = f"segment_attention_{str(dtype).removeprefix('torch.')}_S{s}_P{n_p}"
        errors[f"{name}_forward"] = worst(
            (segment_attention_triton(*x),), (segment_attention_reference(*x),)
        )
        grad = rand(b, s, h, d)
        errors[f"{name}_backward"] = worst(
            segment_attention_backward_triton(x, grad),
            segment_attention_backward_reference(x, grad),
        )
    return errors


def bf16_errors(device: str) -> dict[str, float]:
    """The Titans kernels, the L2 normalisation and the CMS scan on bf16 inputs (what
    autocast hands them: the gates, heads, attention inputs, MAC's retrieval queries, the
    CMS activations; fp32 curvature, kernel bound and conv weight), against the PyTorch
    forms in float32 on the same values: the kernels compute in float32, store bf16."""
    gen = torch.Generator().manual_seed(11)

    def rand(*shape: int, low: float = 0.0, span: float = 0.0) -> torch.Tensor:
        x = (
            torch.randn(*shape, generator=gen)
            if not span
            else low + span * torch.rand(*shape, generator=gen)
        )
        return x.to(device)

    def up(xs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(x.float() if isinstance(x, torch.Tensor) else x for x in xs)

    bf = torch.bfloat16
    theta, eta, alpha = (rand(2, 3, 20, low=lo, span=0.4).to(bf) for lo in (0.1, 0.5, 0.0))
    act = rand(2, 3, 20, 16)
    rates_in = (theta, eta, alpha, 40 * rand(2, 3, 20, span=1.0), (act @ act.mT).abs())
    rates_grads = tuple(rand(2, 3, 20).to(bf) for _ in range(3))
    heads_in = (rand(2, 19, 42).to(bf), rand(2, 3, 36), rand(36, 4))
    heads_out = titans_heads_reference(*up(heads_in), 2)
    heads_grads = [rand(*o.shape).to(bf) for o in heads_out]
    angles = 3 * rand(21, 8)  # the tables in fp32 beside bf16 activations, as under autocast
    attn_in = (rand(2, 2, 21, 16).to(bf), rand(2, 21, 64).to(bf), angles.cos(), angles.sin(),
               *(rand(2, 2, 21, 16).to(bf) for _ in range(2)), rand(2, 2, 21, 4).to(bf),
               rand(1, 2, 4, 16).to(bf))  # fmt: skip
    attn_grad = rand(2, 21, 2, 16).to(bf)
    rows, rows_grad = rand(2, 3, 7, 24).to(bf), rand(2, 3, 7, 24).to(bf)
    earlier = (torch.arange(20)[:, None] // 4 > torch.arange(16)[None, :] // 4).to(device)
    scan_in = (
        rand(2, 20, 24).to(bf),
        rand(2, 20, 24).to(bf),  # block-causal scores
        (0.25 * rand(2, 20, 16) * earlier).to(bf),
        (0.25 * rand(2, 20, 16) * earlier).to(bf),
    )
    pairs = {
        "cms_scan": (
            cms_factor_scan_triton(*scan_in, 4),
            cms_factor_scan_reference(*up(scan_in), 4),
        ),
        "normalize_forward": (
            (l2_normalize_triton(rows),),
            (torch.nn.functional.normalize(rows.float(), dim=-1),),
        ),
        "normalize_backward": (
            (l2_normalize_backward_triton(rows, rows_grad),),
            (l2_normalize_backward_reference(rows.float(), rows_grad.float()),),
        ),
        "rates_forward": (
            titans_chunk_rates_triton(*rates_in),
            chunk_rates_reference(*up(rates_in)),
        ),
        "rates_backward": (
            titans_chunk_rates_backward_triton(rates_in, *rates_grads),
            chunk_rates_backward_reference(up(rates_in), *up(rates_grads)),
        ),
        "end_weights_backward": (
            chunk_end_weights_backward_triton(eta, 1 - alpha, rates_grads[0]),
            chunk_end_weights_backward_reference(*up((eta, 1 - alpha, rates_grads[0]))),
        ),
        "heads_forward": (titans_heads_triton(*heads_in, 2), heads_out),
        "heads_backward": (
            titans_heads_backward_triton(heads_in, 2, list(heads_grads)),
            titans_heads_backward_reference(up(heads_in), 2, up(tuple(heads_grads))),
        ),
        "attention_forward": (
            (segment_attention_triton(*attn_in),),
            (segment_attention_reference(*up(attn_in)),),
        ),
        "attention_backward": (
            segment_attention_backward_triton(attn_in, attn_grad),
            segment_attention_backward_reference(up(attn_in), attn_grad.float()),
        ),
    }
    return {f"bfloat16_{name}": worst(up(got), want) for name, (got, want) in pairs.items()}


def dgd_errors(dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hope::dgd_chunk``'s kernels over ``SHAPES``, the backward with and without the
    increments' gradients."""
    errors = {}
    for c, i, m, o in SHAPES:
        x = inputs(c, i, m, o, dtype, device)
        w1, w2, k, e, a, d, eta, alpha, w2k = x
        want = chunk_dgd_update(w1, w2, w1, w2, k, e, a, d, eta, alpha, True, 0.0, w2k)
        name = f"{str(dtype).removeprefix('torch.')}_C{c}_I{i}_M{m}_O{o}"
        errors[f"forward_{name}"] = worst(dgd_chunk_triton(*x), want)
        gen = torch.Generator().manual_seed(7)
        grads = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device, dtype)
                 for t in want]  # fmt: skip
        for with_inc in (True, False):
            g_inc = (grads[2], grads[3]) if with_inc else (None, None)
            got = dgd_chunk_backward_triton(tuple(x), grads[0], grads[1], *g_inc)
            distinct_storages("dgd_chunk_backward_triton", got)
            ref = dgd_chunk_backward_reference(tuple(x), grads[0], grads[1], *g_inc)
            errors[f"backward_{'inc_' if with_inc else ''}{name}"] = worst(got, ref)
    return errors


def core_errors(device: str) -> dict[str, float]:
    """The SMT's recurrence alone in float32: the DGD chunk write and the chunk step
    (``--core``: what TF32 products are checked on in CI)."""
    return dgd_errors(torch.float32, device) | step_errors(torch.float32, device)


def main(
    device: str, dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32)
) -> dict[str, float]:
    errors: dict[str, float] = {}
    for dtype in dtypes:
        errors |= dgd_errors(dtype, device)
        errors |= shared_errors(dtype, device)
        for c, i, m, o in SHAPES:
            errors |= momentum_errors(c, i, m, o, dtype, device)
        for width in (12, 64, 1):
            errors |= normalize_errors(width, dtype, device)
        for width in (24, 130, 1):
            errors |= rms_norm_errors(width, dtype, device)
        for dim in (8, 64, 2):
            errors |= rotary_errors(dim, dtype, device)
        for case in PASS_CASES:
            errors |= pass_errors(case, dtype, device)
        errors |= apply_errors(dtype, device)
        errors |= generation_errors(dtype, device)
        errors |= write_errors(dtype, device)
        # The interpreter's float64 is enough for the SMT's step and walk (interpreted,
        # they take most of the run): float64 at 1e-13 catches a float32 accumulator, the
        # sm_90 compile checks the float32 kernels' types, and the TF32 check runs the
        # step in float32 (``core_errors``); on a GPU both run in float32 too.
        if dtype == torch.float64 or not INTERPRETED:
            errors |= step_errors(dtype, device)
            errors |= walk_errors(dtype, device)
        errors |= cms_scan_errors(dtype, device)
        errors |= end_weights_errors(dtype, device)
        errors |= chunk_rates_errors(dtype, device)
        errors |= heads_errors(dtype, device)
        errors |= segment_attention_errors(dtype, device)
        for c, *_ in SHAPES:
            gen = torch.Generator().manual_seed(c)
            act = torch.randn(2, 3, c, 24, generator=gen, dtype=torch.float64)
            kernel = (act @ act.transpose(-1, -2)).abs().to(device, dtype)  # >= 0, symmetric
            step = torch.rand(2, 3, c, generator=gen, dtype=torch.float64) * 0.1
            step[..., ::3] = 0.0  # tokens that do not write
            step = step.to(device, dtype)
            rho = overshoot_ratio(kernel, step)
            bounded = (step / (1.0 + rho.unsqueeze(-1)), 1.0 / (1.0 + rho))
            errors[f"bounded_{str(dtype).removeprefix('torch.')}_C{c}"] = worst(
                bounded_step_triton(kernel, step), bounded
            )
    return errors | bf16_errors(device)


if __name__ == "__main__":
    # argv: the device, then optionally the dtypes by name (default float64 and float32)
    # (``--core``: ``core_errors`` alone)
    if os.environ.get("HOPE_TF32") == "1":
        allow_tf32()
    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if "--core" in sys.argv[2:]:
        print(json.dumps(core_errors(where)))
        sys.exit()
    names = sys.argv[2:] or ["float64", "float32"]
    chosen = tuple(getattr(torch, name) for name in names)
    print(json.dumps(main(where, chosen)))

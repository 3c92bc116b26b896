"""Compiles the Triton kernels of the fused backend for a GPU without one: the float32
launches ``triton_worker.py`` makes (every kernel and flag combination the parity tests
use; float32 is what training runs) are intercepted and recorded instead of run, then
the chosen specialisations are compiled by Triton's CUDA backend for sm_90 down to PTX
and a cubin (Triton ships ptxas), side by side in one process per core. The fp32
products are compiled as a bf16 run makes them, on TF32 tensor cores
(``triton_kernels.dot_precision``): their lowering to mma instructions constrains tiles
and layouts more than the FMA units' (an fp32-strict run's, which scripts/gpu_check.sh's
CUDA parity runs). Catches what the interpreter accepts but the compiler refuses (types
of loop-carried values, constexpr branches, tile shapes).

Which specialisations: by default one per kernel, the one that switches on the most
constexpr flags (the most branches compiled), then the largest tiles (the most
constrained layouts): 26 compiles, ~2 min cold on 2 cores. With ``--every``, all of
them (126, ~17 min cold on 2 cores): scripts/gpu_check.sh and the opt-in
``triton_full`` test marker (``pytest -m triton_full``) run that.

Prints, as JSON, per kernel: the specialisations the worker launches, how many were
compiled, the PTX bytes of the largest and the fewest mma instructions of one (-1 for a
kernel without tl.dot products). Run as ``PYTHONPATH=tests python
tests/triton_compile.py [--every]`` (tests/test_fused_ops.py); the outputs of the
intercepted launches are left unwritten, so the worker's error values are meaningless
here and ignored."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.bfloat16: "*bf16"}
# kernel name -> specialisation key -> (kernel, signature, constexpr values)
Spec = tuple[JITFunction, dict[str, str], dict[str, Any]]
launched: dict[str, dict[str, Spec]] = {}


def _signature(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    signature, constants = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if abs(value) < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constants


def _record_instead(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    signature, constants = _signature(self, args, kwargs)
    key = json.dumps([signature, {k: str(v) for k, v in constants.items()}], sort_keys=True)
    launched.setdefault(self.__name__, {}).setdefault(key, (self, signature, constants))


def _weight(spec: Spec) -> tuple[int, float]:
    """Flags switched on, then the sum of the numeric constexprs (tile sizes)."""
    constants = spec[2].values()
    flags = sum(1 for v in constants if v is True)
    sizes = sum(v for v in constants if isinstance(v, int | float) and not isinstance(v, bool))
    return flags, float(sizes)


def chosen(every: bool) -> list[tuple[str, str]]:
    """(kernel, key) of the specialisations to compile: of each kernel the heaviest
    (``_weight``) first, or alone; kernels with more constexpr parameters (the longest
    compiles: the SMT walk's backward takes ~40 % of the total) first, so that the
    pool's processes finish together."""
    picks = []
    for name, specs in sorted(launched.items()):
        ranked = sorted(specs, key=lambda key: _weight(specs[key]), reverse=True)
        picks += [(name, key) for key in (ranked if every else ranked[:1])]
    return sorted(picks, key=lambda pick: -len(launched[pick[0]][pick[1]][2]))


def _compile(pick: tuple[str, str]) -> tuple[str, int, int]:
    """(kernel, PTX bytes, mma instructions or -1 without tl.dot) of one specialisation."""
    name, key = pick
    fn, signature, constants = launched[name][key]
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants), target=TARGET)
    assert kernel.asm["cubin"], name
    ptx = kernel.asm["ptx"]
    mma = ptx.count("mma.sync") + ptx.count("wgmma.mma_async") if "DOT" in constants else -1
    return name, len(ptx), mma


def main(every: bool = False) -> dict[str, dict[str, int]]:
    """Per kernel: its launched and compiled specialisations, the PTX bytes of the
    largest and the fewest mma instructions of one (-1: no tl.dot)."""
    JITFunction.run = _record_instead  # type: ignore[method-assign]
    import triton_worker

    triton_worker.allow_tf32()
    triton_worker.main("cpu", dtypes=(torch.float32,))
    picks = chosen(every)
    # Forked workers inherit the recorded kernels; the heaviest compiles start first.
    cores = len(os.sched_getaffinity(0))
    with multiprocessing.get_context("fork").Pool(min(cores, len(picks))) as pool:
        results = pool.map(_compile, picks, chunksize=1)
    out: dict[str, dict[str, int]] = {}
    for name, size, mma in results:
        info = out.setdefault(name, {"launched": len(launched[name]), "compiled": 0,
                                     "ptx_bytes": 0, "mma": mma})  # fmt: skip
        info["compiled"] += 1
        info["ptx_bytes"] = max(info["ptx_bytes"], size)
        info["mma"] = min(info["mma"], mma)
    return out


if __name__ == "__main__":
    print(json.dumps(main(every="--every" in sys.argv[1:])))

"""Compiles every Triton kernel of the fused backend for a GPU without one: the
float32 launches ``triton_worker.py`` makes (every kernel and flag combination the
parity tests use; float32 is what training runs) are intercepted and each distinct
specialisation is compiled by Triton's CUDA backend for sm_90 down to PTX and a cubin
(Triton ships ptxas), instead of run. The fp32 products are compiled as a bf16 run
makes them, on TF32 tensor cores (``triton_kernels.dot_precision``): their lowering to
mma instructions constrains tiles and layouts more than the FMA units' (an fp32-strict
run's, which scripts/gpu_check.sh's CUDA parity runs). Catches what the interpreter accepts but the
compiler refuses (types of loop-carried values, constexpr branches, tile shapes).
Prints, as JSON, each kernel's number of compiled specialisations and the PTX bytes of
the largest.

Run as ``PYTHONPATH=tests python tests/triton_compile.py`` (tests/test_fused_ops.py);
the outputs of the intercepted launches are left unwritten, so the worker's error
values are meaningless here and ignored."""

from __future__ import annotations

import json
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.bfloat16: "*bf16"}
# kernel name -> specialisation -> (PTX bytes, tensor-core mma instructions or -1 for a
# kernel without tl.dot products)
compiled: dict[str, dict[str, tuple[int, int]]] = {}


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


def _compile_instead(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    signature, constants = _signature(self, args, kwargs)
    key = json.dumps([signature, {k: str(v) for k, v in constants.items()}], sort_keys=True)
    seen = compiled.setdefault(self.__name__, {})
    if key not in seen:
        kernel = triton.compile(ASTSource(self, signature, constexprs=constants), target=TARGET)
        assert kernel.asm["cubin"], self.__name__
        ptx = kernel.asm["ptx"]
        mma = ptx.count("mma.sync") + ptx.count("wgmma.mma_async") if "DOT" in constants else -1
        seen[key] = (len(ptx), mma)


def main() -> dict[str, dict[str, int]]:
    """Per kernel: its specialisations, the PTX bytes of the largest, and the fewest mma
    instructions of one (-1: no tl.dot)."""
    JITFunction.run = _compile_instead  # type: ignore[method-assign]
    import triton_worker

    triton_worker.allow_tf32()
    triton_worker.main("cpu", dtypes=(torch.float32,))
    return {
        name: {
            "variants": len(v),
            "ptx_bytes": max(size for size, _ in v.values()),
            "mma": min(mma for _, mma in v.values()),
        }
        for name, v in compiled.items()
    }


if __name__ == "__main__":
    print(json.dumps(main()))

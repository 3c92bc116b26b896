"""What the CUDA side of a fused operator (backend ``fused``) launches besides its kernel.

Each ``hope::`` operator's CUDA wrapper (``triton_*.py``) hands its kernel dense
tensors: a strided tensor argument (a chunk sliced out of [B, H, T, D], a transposed
conv output, the gates split out of [B, T, 3H]) is first copied by ``.contiguous()``,
one more launch, inside the operator where a dispatch counter cannot see it. A few
arguments are read through their strides instead (``STRIDED_READS``). ``dense_copies``
counts the copies a call makes, so a CPU's launch count (``hope.bench.measure``) is
what a GPU pays, copies included.
"""

from __future__ import annotations

from typing import Any

import torch

# Operator -> its tensor arguments the kernel reads through their strides: None for the
# whole argument, or the positions read so inside a list argument.
STRIDED_READS: dict[str, dict[str, frozenset[int] | None]] = {
    "hope::smt_step": {"alpha_bias": None},  # its batch stride (b_alpha expanded)
    "hope::smt_step_backward": {"saved": frozenset({6})},  # the same b_alpha
    "hope::chunk_end_weights": {"eta": None, "keep": None},
    "hope::chunk_end_weights_backward": {"eta": None, "keep": None, "grad": None},
}


def _copied(value: Any, kept: frozenset[int] | None, listed: bool) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel() > 0 and not value.is_contiguous() and not listed)
    if isinstance(value, (list, tuple)):
        return sum(
            _copied(item, None, kept is not None and index in kept)
            for index, item in enumerate(value)
        )
    return 0


def dense_copies(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The copies the CUDA wrapper of ``func`` (a ``hope::`` operator; 0 for any other)
    makes before its kernel: one per strided tensor argument it does not read through
    its strides."""
    if func.namespace != "hope":
        return 0
    strided = STRIDED_READS.get(func._schema.name, {})
    names = [argument.name for argument in func._schema.arguments]
    values = dict(zip(names, args, strict=False)) | kwargs
    count = 0
    for name, value in values.items():
        if name in strided and strided[name] is None:
            continue
        count += _copied(value, strided.get(name), False)
    return count

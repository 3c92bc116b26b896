"""What the CUDA side of a fused operator (backend ``fused``) launches besides its kernel.

Each ``hope::`` operator's CUDA wrapper (``triton_*.py``) hands its kernel dense
tensors: a strided tensor argument (a chunk sliced out of [B, H, T, D], a transposed
conv output, the gates split out of [B, T, 3H]) is first copied by ``.contiguous()``,
one more launch, inside the operator where a dispatch counter cannot see it. A few
arguments are read through their strides instead (``STRIDED_READS``). ``dense_copies``
counts the copies a call makes and ``wrapper_launches`` adds the launches a wrapper
makes after its kernel (``EXTRA_LAUNCHES``), so a CPU's launch count
(``hope.bench.measure``) is what a GPU pays, copies included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Operator -> its tensor arguments the kernel reads in place: by name, the number of
# leading dimensions whose strides the kernel reads (the rest must be dense: ``ALL`` for
# every stride); for a list argument, that number by position in the list.
ALL = 8
Leading = int | dict[int, int]
STRIDED_READS: dict[str, dict[str, Leading]] = {
    # x (a chunk of the conv's output as heads), the query (a chunk of x W_q) and b_alpha
    # (expanded over the batch); in the backward the same, the read's gradient, and the
    # rows' and gates' gradients per (sample, head) (slices of the next step's).
    "hope::smt_step": {"x": ALL, "query": ALL, "alpha_bias": ALL},
    "hope::smt_step_backward": {"saved": {2: ALL, 3: ALL, 6: ALL}, "grads": {4: 2, 5: 2, 6: ALL}},
    # a walk of chunk steps: the same, for the call's span of x, the query and the reads
    "hope::smt_walk": {"x": ALL, "query": ALL, "alpha_bias": ALL},
    "hope::smt_walk_backward": {"saved": {2: ALL, 3: ALL, 6: ALL}, "grads": {4: ALL}},
    "hope::chunk_end_weights": {"eta": ALL, "keep": ALL},
    # q and k: views of the fused qkv projection; the gradient as autograd hands it.
    "hope::rotary": {"x": ALL},
    "hope::chunk_end_weights_backward": {"eta": ALL, "keep": ALL, "grad": ALL},
    # every argument (gates, curvature, kernel bound, gradients) through its strides
    "hope::titans_chunk_rates": dict.fromkeys(
        ("theta", "eta", "alpha", "curvature", "coupling"), ALL
    ),
    # the conv weight per sample through its batch stride (MAC's: expanded); in the
    # backward also the outputs' gradients (any layout autograd hands over)
    "hope::titans_heads": {"weight": 1},
    "hope::titans_heads_backward": {"weight": 1, "grads": dict.fromkeys(range(7), ALL)},
    # q, k, v: slices of the call's projections, h's keys and values their projection,
    # the angles slices of the call's tables
    "hope::segment_attention": dict.fromkeys(
        ("q", "kv_mem", "cos", "sin", "k_seg", "v_seg", "p_scores", "p_values"), ALL
    ),
    "hope::segment_attention_backward": {"inputs": dict.fromkeys(range(8), ALL), "grad": ALL},
    # the reads' gradient (a slice of MAC's joined reads' gradient) through its strides
    "hope::memory_pass_backward": {"grads": {1: ALL}},
    # z (a chunk of a call's queries), and in the backward the output's gradient (a
    # token-major output's, as W_o's input gradient hands it over)
    "hope::memory_apply": {"z": ALL},
    "hope::memory_apply_backward": {"z": ALL, "grad": ALL},
    "hope::titans_chunk_rates_backward": dict.fromkeys(
        ("theta", "eta", "alpha", "curvature", "coupling", "g_keep", "g_weights", "g_rate"), ALL
    ),
}


# Operator -> the launches its CUDA wrapper makes after its kernel, whatever the layouts
# (the RMSNorm backward sums its blocks' shares of the weight's gradient when asked for
# it; the Titans heads' backward the conv weight's per-sample gradients, and the segment
# attention's backward P's values', when that weight or P's values come shared rather
# than per sample: the latter are its inputs' slot 7; a walk's backward makes zeros
# for each increment's gradient it is given, which its earlier chunks read).
EXTRA_LAUNCHES: dict[str, int | Callable[[dict[str, Any]], int]] = {
    "hope::smt_walk_backward": lambda values: sum(
        int(g is not None and g.numel() > 0) for g in values["grads"][2:4] + values["grads"][7:9]
    ),
    "hope::rms_norm_backward": lambda values: int(values.get("weight_grad", True)),
    "hope::titans_heads_backward": lambda values: int(values["weight"].dim() == 2),
    "hope::segment_attention_backward": lambda values: int(
        values["inputs"][7] is not None and values["inputs"][7].shape[0] != values["grad"].shape[0]
    ),
}


def dense_below(t: torch.Tensor, leading: int) -> bool:
    """Whether ``t`` is dense (row-major, no gaps) in its dimensions after ``leading``."""
    if leading >= t.dim():
        return True
    expected = 1
    sizes, strides = t.shape[leading:], t.stride()[leading:]
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _copies(value: Any, leading: Leading | None) -> int:
    if isinstance(value, torch.Tensor):
        depth = leading if isinstance(leading, int) else 0
        return int(value.numel() > 0 and not dense_below(value, depth))
    if isinstance(value, (list, tuple)):
        at = leading if isinstance(leading, dict) else {}
        return sum(_copies(item, at.get(index)) for index, item in enumerate(value))
    return 0


def dense_copies(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The copies the CUDA wrapper of ``func`` (a ``hope::`` operator; 0 for any other)
    makes before its kernel: one per tensor argument not dense where its kernel needs it."""
    if func.namespace != "hope":
        return 0
    reads = STRIDED_READS.get(func._schema.name, {})
    names = [argument.name for argument in func._schema.arguments]
    values = dict(zip(names, args, strict=False)) | kwargs
    return sum(_copies(value, reads.get(name)) for name, value in values.items())


def wrapper_launches(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    """The launches the CUDA wrapper of ``func`` makes besides its kernel: its copies of
    strided arguments (``dense_copies``) and its fixed extra launches (0 for any op
    that is not a ``hope::`` operator)."""
    if func.namespace != "hope":
        return 0
    extra = EXTRA_LAUNCHES.get(func._schema.name, 0)
    if callable(extra):
        names = [argument.name for argument in func._schema.arguments]
        extra = extra(dict(zip(names, args, strict=False)) | kwargs)
    return dense_copies(func, args, kwargs) + extra

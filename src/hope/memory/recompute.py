"""Activation checkpointing of a function of nested states (``torch.utils.checkpoint``).

Non-reentrant checkpointing keeps its inputs for the rerun: the tensors among its
positional arguments through ``save_for_backward`` (so saved-tensor hooks see them:
``hope.train.plan``'s ledger, offloading hooks), anything else by a plain Python
reference. A memory's carry or a block's state is a dataclass of tensors, so the
tensors it holds for backward were invisible to those hooks (the SMT's stack of fast
weights at every segment boundary: 4.8 GiB of the 21.6 GiB per 4K row that the pilot
preset holds, docs/SCALING.md).
``checkpointed`` passes every tensor leaf of the arguments as an argument of its own
and rebuilds the nesting inside: the same values, the same rerun, and what is held
is what the hooks count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hope.memory.fast_state import map_tensors, tensor_leaves

R = TypeVar("R")


def with_leaves(tree: Any, leaves: tuple[Tensor, ...] | list[Tensor]) -> Any:
    """``tree`` with its tensor leaves replaced, in ``tensor_leaves`` order, by ``leaves``."""
    replacements = iter(leaves)
    return map_tensors(tree, lambda _: next(replacements))


def checkpointed(fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)`` under non-reentrant checkpointing (autocast replayed, no RNG state
    stashed: nothing checkpointed here draws random numbers, and reading the CUDA
    generator's state is what a CUDA graph cannot capture), every tensor the
    arguments hold saved as an input (module docstring)."""
    leaves = tensor_leaves(args)

    def rerun(*given: Tensor) -> R:
        return fn(*with_leaves(args, given))

    return checkpoint(rerun, *leaves, use_reentrant=False, preserve_rng_state=False)  # type: ignore[no-any-return]

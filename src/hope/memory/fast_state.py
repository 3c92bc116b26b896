"""Helpers for per-sample fast state (MECHANISMS §5): reset with a mask, detach.

A state is any nesting of dataclasses, lists, tuples and dicts whose tensor leaves
carry a leading batch dimension B. Non-tensor leaves (static Python ints such as
pending counts and chunk phases) are batch-wide and pass through unchanged, so these
helpers never sync with the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

S = TypeVar("S")


def map_tensors(state: S, fn: Callable[[Tensor], Tensor]) -> S:
    """Apply fn to every tensor leaf of a nested state, rebuilding the containers."""
    if isinstance(state, Tensor):
        return fn(state)  # type: ignore[return-value]
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {
            f.name: map_tensors(getattr(state, f.name), fn) for f in dataclasses.fields(state)
        }
        return dataclasses.replace(state, **changes)  # type: ignore[return-value]
    if isinstance(state, list):
        return [map_tensors(item, fn) for item in state]  # type: ignore[return-value]
    if isinstance(state, tuple):
        return type(state)(map_tensors(item, fn) for item in state)  # type: ignore[return-value]
    if isinstance(state, dict):
        return {key: map_tensors(value, fn) for key, value in state.items()}  # type: ignore[return-value]
    return state


def where_samples(reset_mask: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """Sample b of ``new`` where reset_mask[b], else of ``old``; tensors [B, ...], mask [B]."""
    if reset_mask.shape != old.shape[:1]:
        raise ValueError(
            f"reset mask shape {tuple(reset_mask.shape)} does not match batch {old.shape[0]}"
        )
    if new.shape != old.shape:
        raise ValueError(f"a fresh state leaf {tuple(new.shape)} for {tuple(old.shape)}")
    mask = reset_mask.to(torch.bool).view(-1, *([1] * (old.dim() - 1)))
    return torch.where(mask, new.to(old.dtype), old)


def restore_state(state: Any, fresh: Any, reset_mask: Tensor) -> Any:
    """Per-sample reset: the samples with reset_mask [B] True take their leaves from
    ``fresh`` (a new context's state of the same structure: the memories'
    meta-learned initial weights, zero momenta and conv tails), the others keep
    theirs. A container that knows better (a KV cache, a CMS level's pending
    buffer) defines ``reset_where(fresh, mask)``."""
    custom = getattr(state, "reset_where", None)
    if callable(custom):
        return custom(fresh, reset_mask)
    if isinstance(state, Tensor):
        return where_samples(reset_mask, fresh, state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {
            f.name: restore_state(getattr(state, f.name), getattr(fresh, f.name), reset_mask)
            for f in dataclasses.fields(state)
        }
        return dataclasses.replace(state, **changes)
    if isinstance(state, (list, tuple)):
        items = (restore_state(a, b, reset_mask) for a, b in zip(state, fresh, strict=True))
        return type(state)(items)
    if isinstance(state, dict):
        return {key: restore_state(value, fresh[key], reset_mask) for key, value in state.items()}
    return state


def detach_state(state: S) -> S:
    """Cut the autograd history of every tensor leaf (state carried across segments)."""
    return map_tensors(state, lambda t: t.detach())


def tensor_leaves(state: Any) -> list[Tensor]:
    """All tensor leaves in a fixed traversal order (``map_tensors``'s; tests, logging and
    ``recompute.checkpointed``)."""
    leaves: list[Tensor] = []

    def collect(tensor: Tensor) -> Tensor:
        leaves.append(tensor)
        return tensor

    map_tensors(state, collect)
    return leaves


def _children(state: Any) -> list[tuple[str, Any]]:
    """(path suffix, child) of a container, in ``map_tensors``'s order; [] for a leaf."""
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return [(f".{f.name}", getattr(state, f.name)) for f in dataclasses.fields(state)]
    if isinstance(state, (list, tuple)):
        return [(f"[{i}]", item) for i, item in enumerate(state)]
    if isinstance(state, dict):
        return [(f"[{key!r}]", item) for key, item in state.items()]
    return []


def named_tensor_leaves(
    state: Any, path: str = "state", *, weights_only: bool = False
) -> list[tuple[str, Tensor]]:
    """Every tensor leaf with its path through the containers, e.g.
    ``blocks[1].cms.levels[0].delta_out`` (error messages naming a memory). With
    ``weights_only``, only the fast weights: the leaves under the fields a state class
    names in its ``FAST_WEIGHTS`` (caches, pending buffers, conv tails and momenta are
    not weights)."""
    if isinstance(state, Tensor):
        return [] if weights_only else [(path, state)]
    named = getattr(state, "FAST_WEIGHTS", ()) if weights_only else ()
    return [
        leaf
        for suffix, item in _children(state)
        for leaf in named_tensor_leaves(
            item, path + suffix, weights_only=weights_only and suffix[1:] not in named
        )
    ]


def first_nonfinite(state: Any, path: str = "state") -> str | None:
    """The path of the first tensor leaf holding a non-finite value, or None (one host
    read per leaf: for error reports, never inside a step)."""
    return next(
        (name for name, t in named_tensor_leaves(state, path) if not bool(t.isfinite().all())),
        None,
    )


def fast_weight_norms(state: Any, path: str = "state") -> dict[str, Tensor]:
    """The per-sample Frobenius norm [B] (float32, on the device) of every fast weight
    in a nested state, keyed by its path (``blocks[0].cms[1].delta_out``)."""
    return {
        name: t.detach().float().flatten(1).norm(dim=1)
        for name, t in named_tensor_leaves(state, path, weights_only=True)
    }

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


def named_tensor_leaves(state: Any, path: str = "state") -> list[tuple[str, Tensor]]:
    """Every tensor leaf with its path through the containers, e.g.
    ``blocks[1].cms.levels[0].delta_out`` (error messages naming a memory)."""
    if isinstance(state, Tensor):
        return [(path, state)]
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        items = [(f".{f.name}", getattr(state, f.name)) for f in dataclasses.fields(state)]
    elif isinstance(state, (list, tuple)):
        items = [(f"[{i}]", item) for i, item in enumerate(state)]
    elif isinstance(state, dict):
        items = [(f"[{key!r}]", item) for key, item in state.items()]
    else:
        return []
    return [leaf for name, item in items for leaf in named_tensor_leaves(item, path + name)]


def first_nonfinite(state: Any, path: str = "state") -> str | None:
    """The path of the first tensor leaf holding a non-finite value, or None (one host
    read per leaf: for error reports, never inside a step)."""
    return next(
        (name for name, t in named_tensor_leaves(state, path) if not bool(t.isfinite().all())),
        None,
    )


def fast_weight_norms(state: Any, path: str = "state") -> dict[str, Tensor]:
    """The per-sample Frobenius norm [B] (float32, on the device) of every fast weight
    in a nested state, keyed by its path (``blocks[0].cms[1].delta_out``): the fields
    a state class names in its ``FAST_WEIGHTS`` (a tensor or a tuple of them). Caches,
    pending buffers, conv tails and momenta are not weights and are left out."""
    if isinstance(state, Tensor):
        return {}
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        named = getattr(state, "FAST_WEIGHTS", ())
        norms: dict[str, Tensor] = {}
        for f in dataclasses.fields(state):
            value, where = getattr(state, f.name), f"{path}.{f.name}"
            if f.name not in named:
                norms.update(fast_weight_norms(value, where))
            elif isinstance(value, Tensor):
                norms[where] = value.detach().float().flatten(1).norm(dim=1)
            else:
                for i, t in enumerate(value):
                    norms[f"{where}[{i}]"] = t.detach().float().flatten(1).norm(dim=1)
        return norms
    if isinstance(state, (list, tuple)):
        items = [(f"[{i}]", item) for i, item in enumerate(state)]
    elif isinstance(state, dict):
        items = [(f"[{key!r}]", item) for key, item in state.items()]
    else:
        return {}
    return {k: v for name, item in items for k, v in fast_weight_norms(item, path + name).items()}

"""Helpers for per-sample fast state (MECHANISMS §5): reset with a mask, detach.

A state is any nesting of dataclasses, lists, tuples and dicts whose tensor leaves
carry a leading batch dimension B. Non-tensor leaves (static Python ints such as
pending counts) pass through unchanged, so these helpers never sync with the device.
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


def reset_where(tensor: Tensor, reset_mask: Tensor) -> Tensor:
    """Zero the samples b with reset_mask[b] True; tensor [B, ...], reset_mask [B] bool."""
    if reset_mask.shape != tensor.shape[:1]:
        raise ValueError(
            f"reset mask shape {tuple(reset_mask.shape)} does not match batch {tensor.shape[0]}"
        )
    mask = reset_mask.to(torch.bool).view(-1, *([1] * (tensor.dim() - 1)))
    return torch.where(mask, torch.zeros_like(tensor), tensor)


def reset_state(state: S, reset_mask: Tensor) -> S:
    """Per-sample reset of every tensor leaf (fast deltas, momenta, buffers, counters)."""
    return map_tensors(state, lambda t: reset_where(t, reset_mask))


def detach_state(state: S) -> S:
    """Cut the autograd history of every tensor leaf (state carried across segments)."""
    return map_tensors(state, lambda t: t.detach())


def tensor_leaves(state: Any) -> list[Tensor]:
    """All tensor leaves in a fixed traversal order (for tests and logging)."""
    leaves: list[Tensor] = []

    def collect(tensor: Tensor) -> Tensor:
        leaves.append(tensor)
        return tensor

    map_tensors(state, collect)
    return leaves

"""Surprise gate: per sample, per chunk, on device (MECHANISMS §4 "Ours").

Per-token score u_{b,t}: ||δ_{b,t}|| (``l2``), the token's CE loss (``loss``) or the
entropy of its predicted distribution (``entropy``). Chunk score
s_{b,n} = mean_{t∈n} u_{b,t}; gate g_{b,n} = (s_{b,n} ≥ τ); token mask
m_{b,t} = (u_{b,t} ≥ τ)·teach_mask_{b,t}. With τ = None the gate is always open and
the mask is the teach mask. Nothing here leaves the device; the update counters are
summed on device and read only at log time.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

SurpriseMetric = Literal["l2", "loss", "entropy"]
METRICS: tuple[str, ...] = ("l2", "loss", "entropy")


def token_scores(
    metric: str,
    teach: Tensor,
    token_loss: Tensor | None = None,
    token_entropy: Tensor | None = None,
) -> Tensor:
    """Per-token surprise u [B, T] from the teach signal δ [B, T, d] or a passed-in value."""
    if metric == "l2":
        return teach.norm(dim=-1)
    if metric == "loss":
        if token_loss is None:
            raise ValueError(
                "surprise_metric='loss' needs the per-token loss (token_loss [B, T]); none given"
            )
        return _check_shape("token_loss", token_loss, teach)
    if metric == "entropy":
        if token_entropy is None:
            raise ValueError(
                "surprise_metric='entropy' needs the per-token logit entropy "
                "(token_entropy [B, T]); none given"
            )
        return _check_shape("token_entropy", token_entropy, teach)
    raise ValueError(f"surprise_metric must be one of {METRICS}, got {metric!r}")


def _check_shape(name: str, value: Tensor, teach: Tensor) -> Tensor:
    if value.shape != teach.shape[:2]:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}, expected {tuple(teach.shape[:2])} ([B, T])"
        )
    return value.to(teach.dtype)


def token_mask(scores: Tensor, threshold: float | None) -> Tensor | None:
    """m [B, T] = (u ≥ τ) in the scores' dtype; None when the gate is disabled."""
    return None if threshold is None else (scores >= threshold).to(scores.dtype)


def chunk_gate(chunk_scores: Tensor, threshold: float | None) -> Tensor | None:
    """g [B, n] bool: the mean score of each whole chunk [B, n, C] is ≥ τ (a level
    writes whole chunks only). None when the gate is disabled."""
    if threshold is None:
        return None
    return chunk_scores.mean(dim=-1) >= threshold

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

import torch
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


def token_mask(
    scores: Tensor, threshold: float | None, teach_mask: Tensor | None = None
) -> Tensor | None:
    """m [B, T] = (u ≥ τ)·teach_mask, in the scores' dtype; None when nothing masks."""
    mask = None if threshold is None else (scores >= threshold).to(scores.dtype)
    if teach_mask is not None:
        teach = teach_mask.to(scores.dtype)
        mask = teach if mask is None else mask * teach
    return mask


def chunk_gate(chunk_scores: Tensor, threshold: float | None, last_len: int) -> Tensor | None:
    """g [B, n] bool from per-token scores laid out in chunks [B, n, C].

    The last chunk may be partial (``last_len`` real tokens, the rest zero padding);
    its mean is over the real tokens only. Returns None when the gate is disabled.
    """
    if threshold is None:
        return None
    n_chunks, chunk = chunk_scores.shape[1], chunk_scores.shape[2]
    if not 0 < last_len <= chunk:
        raise ValueError(f"last_len must be in 1..{chunk}, got {last_len}")
    counts = torch.full(
        (n_chunks,), float(chunk), dtype=chunk_scores.dtype, device=chunk_scores.device
    )
    counts[-1] = float(last_len)
    means = chunk_scores.sum(dim=-1) / counts  # [B, n]
    return means >= threshold

"""Held-out next-token loss and perplexity.

The loss is the mean token cross-entropy of the model's own ``forward`` logits
(not ``training_loss``, which teach-driven variants may redefine): the number a
reader compares across variants must be plain next-token prediction. Sums stay
on the device in float64 and are read once, after the last batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hope.errors import StageError
from hope.model.lm import LanguageModel


@dataclass(frozen=True)
class PerplexityResult:
    loss: float  # mean token cross-entropy, nats
    ppl: float
    tokens: int
    # Entropy (nats) of the evaluated targets' own unigram distribution: the lowest
    # loss any context-free model could reach on exactly these tokens.
    unigram_entropy: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "loss": self.loss,
            "ppl": self.ppl,
            "tokens": self.tokens,
            "unigram_entropy": self.unigram_entropy,
        }


def bits_per_byte(loss_nats: float, bytes_per_token: float) -> float:
    """Mean token loss (nats) as bits per UTF-8 byte of the text the tokens encode."""
    return loss_nats / (math.log(2.0) * bytes_per_token)


# no_grad, not inference_mode: a memory variant may compute inner-loop gradients
# under torch.enable_grad() inside its forward, which inference mode would forbid.
@torch.no_grad()
def evaluate_perplexity(
    model: LanguageModel,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> PerplexityResult:
    """Mean next-token CE over ``(x [B, T], y [B, T])`` batches; each batch a fresh context."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    counts: torch.Tensor | None = None  # [V] target histogram, allocated once V is known
    tokens = 0
    try:
        for x, y in batches:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast(
                device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ):
                logits, _ = model.forward_teach(x, y)  # [B, T, V]
            ce = F.cross_entropy(
                logits.float().flatten(0, 1), y.flatten(), reduction="sum"
            )  # summed in fp32 per batch, accumulated across batches in fp64
            loss_sum += ce.double()
            if counts is None:
                counts = torch.zeros(logits.shape[-1], dtype=torch.long, device=device)
            # index_add_, not bincount: CUDA bincount reads the max back to the host.
            counts.index_add_(0, y.flatten(), torch.ones_like(y.flatten()))
            tokens += y.numel()  # a shape, not a device value: no sync
    finally:
        model.train(was_training)
    if counts is None or tokens == 0:
        raise StageError("no evaluation batches: the val split is shorter than one window")
    p = counts.double() / tokens
    entropy = -(p * p.clamp_min(1e-300).log()).sum()
    loss_host, entropy_host = torch.stack([loss_sum, entropy]).cpu().tolist()  # the one host read
    loss = loss_host / tokens
    return PerplexityResult(
        loss=loss, ppl=math.exp(min(loss, 700.0)), tokens=tokens, unigram_entropy=entropy_host
    )

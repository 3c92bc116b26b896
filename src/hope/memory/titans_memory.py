"""Titans neural long-term memory (LMM; Ti §3.1-3.2, eqs. 12-18; MECHANISMS §1).

x [B, T, d] -> q, k, v = SiLU(x W) -> causal depthwise conv -> heads, with q
and k L2-normalized. The memory is a per-head 2-layer MLP M(z) = z + W1 gelu(W2 z)
(depth L_M = 2, residual as in all Titans blocks, Ti §4.4) whose weights are
per-sample fast state. Inner loss ||M(k_t) - v_t||^2 (Ti eq. 12); update

  S_t = eta_t S_{t-1} - theta_t grad,   M_t = (1 - alpha_t) M_{t-1} + S_t   (eqs. 13-14)

with data-dependent gates eta, alpha = sigmoid(linear(x)) per head and token.
Deviation (stabiliser): theta_t = theta_max sigmoid(linear(x_t)) / max(1, lambda_t),
theta_max = 1 / (C (C + 1)) and lambda_t >= the Gauss-Newton curvature of the
memory at k_t, so a chunk of C stale gradients never overshoots (``max_step``).
Chunked training (Ti eqs. 16-18): every gradient of a chunk of
``titans_chunk`` tokens is taken at the chunk-start weights; momentum and decay
across its tokens are applied in closed form (``ops/chunk.py``).

Retrieval y_t = M*(q_t) (eq. 15) uses the chunk-start weights: read before
write at chunk granularity, so y_t never depends on tokens >= its chunk start
through the memory (strictly causal; titans-pytorch instead lets a chunk's
last token read its own chunk's write). A partial final chunk is flushed, so
chained calls equal one call when split points are multiples of the chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.memory.conv import CausalDepthwiseConv
from hope.memory.ops.dispatch import compiled, momentum_write, resolve_backend
from hope.memory.residual_mlp import FastWeights, MemoryInit, curvature_bound, mlp_apply
from hope.model.config import ModelConfig

# Gate values at init (the paper gives none): theta at half its cap (a
# fraction of ``max_step``), a long surprise momentum eta ~ 0.9 and a slow
# forgetting alpha ~ 0.005 per token.
_GATE_INIT = {"theta": 0.5, "eta": 0.9, "alpha": 0.005}


def max_step(chunk: int) -> float:
    """Cap theta_max = 1 / (C (C + 1)) of the inner step for chunks of C tokens.

    Chunked training (Ti eq. 16) takes all C gradients of a chunk at the
    chunk-start weights M_{t'}; with momentum (Ti eq. 18) the gradient of token
    s reaches the chunk-end weights with weight theta_s sum_{j>=s} prod eta,
    at most (C - s + 1) theta. When the chunk's keys share a direction (MAC
    writes attention outputs, nearly constant within a segment: mean cos^2 to
    the chunk-mean key ~ 0.85 at init), these stale steps add up instead of
    correcting each other, and M(k) moves along that direction by up to
    C (C + 1) / 2 * theta * 2 J J^T, 2 J J^T being the curvature of
    ||M(k) - v||^2 (Ti eq. 12). With the step divided by ``curvature_bound``
    (>= ||J J^T||) that is <= C (C + 1) theta, so theta <= theta_max keeps it
    <= 1: no overshoot, whatever eta and alpha. The momentum carried into later
    chunks is a heavy ball with beta = prod eta < 1, stable for steps < 2.
    Before (theta = sigmoid ~ 0.05, unnormalised, C = 16) the chunk step was
    ~ 4 lambda with lambda ~ 2-10, and titans_mac was NaN after 80 tokens.
    """
    return 1.0 / (chunk * (chunk + 1))


@dataclass
class NeuralMemoryState:
    """Per-sample fast state: weights, surprise momentum (in m1/m2), conv tail."""

    memory: FastWeights
    conv_tail: Tensor | None  # [B, W-1, 3d]
    chunks_done: int = 0

    def select(self, index: slice) -> NeuralMemoryState:
        tail = None if self.conv_tail is None else self.conv_tail[index]
        return NeuralMemoryState(self.memory.select(index), tail, self.chunks_done)


class NeuralMemory(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str | None = None):
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"model.dim={cfg.dim} not divisible by model.n_heads={cfg.n_heads}")
        if cfg.titans_chunk < 1:
            raise ValueError(f"model.titans_chunk={cfg.titans_chunk} must be >= 1")
        self.cfg = cfg
        self.backend = resolve_backend(backend) if backend is not None else None
        self.n_heads, self.d_head = cfg.n_heads, cfg.dim // cfg.n_heads
        self.w_qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        # The conv window is shared with SMT (one knob for "local conv on inputs").
        self.conv = (
            CausalDepthwiseConv(3 * cfg.dim, cfg.smt_conv_window, cfg.init_std)
            if cfg.smt_conv_window > 0
            else None
        )
        self.gates = nn.Linear(cfg.dim, 3 * cfg.n_heads)
        # Three scalar gates per head (θ, η, α), not a hidden map: AdamW, not Muon/M3.
        self.vector_params = ("gates.weight",)
        nn.init.normal_(self.gates.weight, std=cfg.init_std)
        self.init_extra_parameters()
        hidden = cfg.smt_expansion * self.d_head
        self.init = MemoryInit(cfg.n_heads, self.d_head, hidden, self.d_head, cfg.init_std)
        self.w_o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        nn.init.normal_(self.w_o.weight, std=cfg.init_std)

    def init_extra_parameters(self) -> None:
        """Gate biases; also rerun by ``LanguageModel.reset_parameters``, which zeroes biases."""
        with torch.no_grad():
            bias = [math.log(p / (1 - p)) for p in _GATE_INIT.values()]
            self.gates.bias.copy_(torch.tensor(bias).repeat_interleave(self.n_heads))

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None
    ) -> NeuralMemoryState:
        if device is not None and torch.device(device) != self.w_o.weight.device:
            raise ValueError(
                f"init_state device {device} != module device {self.w_o.weight.device}"
            )
        tail = None if self.conv is None else self.conv.init_tail(batch_size)
        return NeuralMemoryState(self.init.init_state(batch_size), tail, 0)

    def _project(self, x: Tensor, tail: Tensor | None) -> tuple[list[Tensor], Tensor | None]:
        """q, k, v heads [B, H, T, d_h] (Ti §4.4: SiLU, conv, L2-norm q and k)."""
        batch, seq, dim = x.shape
        qkv = F.silu(self.w_qkv(x))
        if self.conv is not None:
            assert tail is not None
            qkv, tail = self.conv(qkv, tail)
        q, k, v = (
            t.reshape(batch, seq, self.n_heads, self.d_head).transpose(1, 2)
            for t in qkv.split(dim, dim=-1)
        )
        return [F.normalize(q, dim=-1), F.normalize(k, dim=-1), v], tail

    def forward(
        self, x: Tensor, state: NeuralMemoryState | None = None, backend: str | None = None
    ) -> tuple[Tensor, NeuralMemoryState]:
        """x [B, T, d] -> (y [B, T, d], new state); never mutates parameters."""
        batch, seq, dim = x.shape
        if state is None:
            state = self.init_state(batch)
        backend = resolve_backend(backend or self.backend)
        (q, k, v), tail = self._project(x, state.conv_tail)
        # [B, T, 3H] -> three [B, H, T] gates
        theta, eta, alpha = torch.sigmoid(self.gates(x)).transpose(1, 2).split(self.n_heads, 1)
        fast, chunks_done, reads = state.memory, state.chunks_done, []
        size = self.cfg.titans_chunk
        # backend "compile": the whole chunk step (read, curvature, factors, write) in
        # one compiled graph, its write on the plain closed form.
        step = (
            compiled(NeuralMemory._chunk_step) if backend == "compile" else NeuralMemory._chunk_step
        )
        write_backend = "torch" if backend == "compile" else backend
        for start in range(0, seq, size):
            span = slice(start, start + size)
            fast, read = step(
                self, fast, q[:, :, span], k[:, :, span], v[:, :, span], theta[:, :, span],
                eta[:, :, span], alpha[:, :, span], write_backend,
            )  # fmt: skip
            reads.append(read)
            chunks_done += 1
            mode = self.cfg.write_grad
            if mode == "stopgrad" or (
                mode == "truncated" and chunks_done % self.cfg.write_grad_window == 0
            ):
                fast = fast.detach()
        out = torch.cat(reads, dim=2).transpose(1, 2).reshape(batch, seq, dim)
        return self.w_o(out), NeuralMemoryState(fast, tail, chunks_done)

    def _chunk_step(
        self,
        fast: FastWeights,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        theta: Tensor,
        eta: Tensor,
        alpha: Tensor,
        backend: str | None,
    ) -> tuple[FastWeights, Tensor]:
        """Read M(q) at the chunk-start state, then write the chunk (Ti eqs. 13-14);
        q, k, v [B, H, C, d_h], gates [B, H, C]."""
        read = mlp_apply(fast.w1, fast.w2, q, residual=True)
        # Inner step theta_t of Ti eq. 13 as theta_max * sigmoid(.) / max(1, lambda_t):
        # a deviation that keeps the chunked write stable (see ``max_step``). For
        # a linear memory with unit keys lambda_t = ||k_t||^2 = 1 (the paper's rule).
        curvature = curvature_bound(fast.w1, fast.w2, k).clamp_min(1.0)
        step = max_step(self.cfg.titans_chunk) * theta / curvature
        fast = momentum_write(
            fast, k, v, step, eta, 1.0 - alpha, objective="l2", residual=True, backend=backend
        )
        return fast, read

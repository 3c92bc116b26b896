"""Self-modifying Titans (SMT; NL-arXiv §8, eqs. ~83-94; MECHANISMS §3).

x [B, T, d] -> causal depthwise conv -> heads x~ [B, H, T, d_h]. Six residual
MLP memories M_k, M_v, M_q, M_eta, M_alpha, M_mem (M_q only with
``smt_adaptive_q``) are per-sample fast state; their initial states are meta
parameters. Per chunk of C_o tokens, with the chunk-start states:

  k = norm(M_k(x~)), v = M_v(x~), q = norm(x~ W_q)    (eq. 83; adaptive q: M_q)
  eta = s_eta softplus(M_eta(x~)), alpha = sigmoid(M_alpha(x~) + b_alpha)
  o = M_mem(q)                                         (eq. 94; read before write)
  v_hat_m = M_m(v); DGD write of every memory m          (eqs. 84, 88)

M_mem is written every C_m tokens (a multiple of C_o) from its own C_m-chunk
start state; the others every C_o tokens. A partial final chunk is flushed at
the end of every call, so chained calls equal one call when every split point
is a multiple of C_m (other splits flush early and differ).

Outer gradients (``write_grad``): ``full`` keeps every write in the graph, so
all initial states, W_q, the conv, b_alpha and W_o are meta-learned (Ti-style);
``truncated`` detaches every memory after each ``write_grad_window``-th C_o
chunk; ``stopgrad`` detaches every write (Ref parity): then M_k, M_v, M_eta,
M_alpha and b_alpha feed only writes and get no gradient, and M_mem's initial
state gets gradient only from the reads of the first C_m chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.memory.conv import CausalDepthwiseConv
from hope.memory.ops.dispatch import dgd_write, resolve_backend
from hope.memory.residual_mlp import FastWeights, MemoryInit, curvature_bound, mlp_apply
from hope.model.config import ModelConfig


@dataclass
class SMTState:
    """Per-sample fast state of one SMT layer (tensors have a leading B)."""

    memories: dict[str, FastWeights]
    conv_tail: Tensor | None  # [B, W-1, d]
    chunks_done: int = 0  # C_o chunks written so far (a static count, for truncation)

    def select(self, index: slice) -> SMTState:
        tail = None if self.conv_tail is None else self.conv_tail[index]
        mems = {n: m.select(index) for n, m in self.memories.items()}
        return SMTState(mems, tail, self.chunks_done)


@dataclass
class _Generated:
    """Chunk-start generation of one C_o chunk (NL-arXiv eq. 83)."""

    k: Tensor  # [B, H, C, d_h]
    v: Tensor  # [B, H, C, d_h]
    q: Tensor  # [B, H, C, d_h]
    eta: Tensor  # [B, H, C]
    alpha: Tensor  # [B, H, C]


def _validate(cfg: ModelConfig) -> None:
    checks = [
        (cfg.dim % cfg.n_heads == 0, f"model.dim={cfg.dim} not divisible by n_heads"),
        (cfg.smt_chunk >= 1, f"model.smt_chunk={cfg.smt_chunk} must be >= 1"),
        (
            cfg.smt_mem_chunk >= cfg.smt_chunk and cfg.smt_mem_chunk % cfg.smt_chunk == 0,
            f"model.smt_mem_chunk={cfg.smt_mem_chunk} must be a multiple of "
            f"model.smt_chunk={cfg.smt_chunk}",
        ),
        (0.0 < cfg.smt_retention_init < 1.0, "model.smt_retention_init must be in (0, 1)"),
        (cfg.smt_expansion >= 1, f"model.smt_expansion={cfg.smt_expansion} must be >= 1"),
        (cfg.smt_conv_window >= 0, f"model.smt_conv_window={cfg.smt_conv_window} must be >= 0"),
        (cfg.write_grad_window >= 1, "model.write_grad_window must be >= 1"),
        (cfg.write_grad in ("full", "truncated", "stopgrad"), f"bad write_grad={cfg.write_grad!r}"),
        (cfg.smt_objective in ("l2", "dot"), f"bad model.smt_objective={cfg.smt_objective!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


class SelfModifyingTitans(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str | None = None):
        super().__init__()
        _validate(cfg)
        self.cfg = cfg
        self.backend = resolve_backend(backend) if backend is not None else None
        self.n_heads, self.d_head = cfg.n_heads, cfg.dim // cfg.n_heads
        hidden = cfg.smt_expansion * self.d_head
        self.conv = (
            CausalDepthwiseConv(cfg.dim, cfg.smt_conv_window, cfg.init_std)
            if cfg.smt_conv_window > 0
            else None
        )
        outs = {"k": self.d_head, "v": self.d_head, "eta": 1, "alpha": 1, "mem": self.d_head}
        if cfg.smt_adaptive_q:
            outs["q"] = self.d_head
        self.residual = {n: d == self.d_head for n, d in outs.items()}
        self.inits = nn.ModuleDict(
            {
                n: MemoryInit(cfg.n_heads, self.d_head, hidden, d, cfg.init_std)
                for n, d in outs.items()
            }
        )
        # Fixed (non-adaptive) query map per head; M_q replaces it when adaptive.
        self.w_q = (
            None
            if cfg.smt_adaptive_q
            else nn.Parameter(
                torch.randn(cfg.n_heads, self.d_head, self.d_head) / math.sqrt(self.d_head)
            )
        )
        # b_alpha makes sigmoid(.) ~ smt_retention_init at init (MECHANISMS §3 "Init").
        logit = math.log(cfg.smt_retention_init / (1.0 - cfg.smt_retention_init))
        self.alpha_bias = nn.Parameter(torch.full((cfg.n_heads,), logit))
        self.w_o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        nn.init.normal_(self.w_o.weight, std=cfg.init_std)

    @property
    def written(self) -> tuple[str, ...]:
        """Memories written every C_o tokens (M_mem is written every C_m)."""
        return tuple(n for n in self.inits if n != "mem")

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> SMTState:
        mems = {n: cast(MemoryInit, init).init_state(batch_size) for n, init in self.inits.items()}
        tail = None if self.conv is None else self.conv.init_tail(batch_size)
        state = SMTState(mems, tail, 0)
        if device is not None and torch.device(device) != self.alpha_bias.device:
            raise ValueError(
                f"init_state device {device} != module device {self.alpha_bias.device}"
            )
        return state

    def _run_memory(self, fast: FastWeights, name: str, z: Tensor) -> Tensor:
        return mlp_apply(fast.w1, fast.w2, z, self.residual[name])

    def _generate(self, mems: dict[str, FastWeights], xc: Tensor) -> _Generated:
        k = F.normalize(self._run_memory(mems["k"], "k", xc), dim=-1)
        # v is only ever the input of the self-generated targets v_hat = M(v) (eq. 84).
        # Unnormalised, M_v(v) feeds back on itself: a write that raises M_v's gain
        # raises v and with it every target (targets 5 -> 228 -> 3e8 within one
        # 128-token context after ~100 outer steps of the tiny preset). Normalising v
        # like k (a deviation; docs/FAITHFULNESS.md) keeps the targets' inputs on the
        # unit sphere.
        v = F.normalize(self._run_memory(mems["v"], "v", xc), dim=-1)
        if self.w_q is None:
            q = F.normalize(self._run_memory(mems["q"], "q", xc), dim=-1)
        else:
            q = F.normalize(torch.einsum("bhti,hio->bhto", xc, self.w_q), dim=-1)
        eta = self.cfg.smt_eta_scale * F.softplus(
            self._run_memory(mems["eta"], "eta", xc).squeeze(-1)
        )
        alpha_logit = self._run_memory(mems["alpha"], "alpha", xc).squeeze(-1)
        alpha = torch.sigmoid(alpha_logit + self.alpha_bias[:, None])
        return _Generated(k, v, q, eta, alpha)

    @staticmethod
    def _bounded_eta(fast: FastWeights, gen: _Generated) -> Tensor:
        """eta_t / (1 + C eta_t lambda_t): the inner step of eq. 88 with a curvature bound.

        A chunk applies C gradients taken at its start state (eq. 90). When its keys
        share a direction they add up and move M(k) by up to C eta lambda times the
        error, lambda = ||J J^T|| the memory's curvature at k (``curvature_bound``);
        past 1 the write overshoots, and the self-generated targets v_hat = M(v) then
        grow with it (seen as NaN after ~100 outer steps of the tiny preset). The
        bound keeps C eta lambda < 1 and leaves eta unchanged while C eta lambda << 1
        (at init: eta ~ 1e-3, lambda ~ 1-10). A deviation; docs/FAITHFULNESS.md.
        """
        chunk = gen.k.shape[2]
        curvature = curvature_bound(fast.w1, fast.w2, gen.k)  # [B, H, C]
        return gen.eta / (1.0 + chunk * gen.eta * curvature)

    def _write(
        self, fast: FastWeights, name: str, gen: _Generated, backend: str | None
    ) -> FastWeights:
        # v_hat = M(v) with this memory's chunk-start state (eq. 84). It is a
        # constant of the inner gradient (the factors treat it so) but stays in
        # the outer graph: it is M_v's only path to the loss.
        target = self._run_memory(fast, name, gen.v)
        new = dgd_write(
            fast, gen.k, target, self._bounded_eta(fast, gen), gen.alpha,
            objective=self.cfg.smt_objective, residual=self.residual[name],
            precondition=self.cfg.smt_precondition, momentum=self.cfg.smt_momentum,
            backend=backend,
        )  # fmt: skip
        return new.detach() if self.cfg.write_grad == "stopgrad" else new

    def forward(
        self, x: Tensor, state: SMTState | None = None, backend: str | None = None
    ) -> tuple[Tensor, SMTState]:
        """x [B, T, d] -> (y [B, T, d], new state). Never mutates parameters.

        ``backend="naive"`` runs every write as a token loop (test oracle).
        """
        batch, seq, dim = x.shape
        if state is None:
            state = self.init_state(batch)
        backend = backend or self.backend
        tail = state.conv_tail
        if self.conv is not None:
            assert tail is not None
            x, tail = self.conv(x, tail)
        heads = x.reshape(batch, seq, self.n_heads, self.d_head).transpose(1, 2)
        mems = dict(state.memories)
        c_o, c_m = self.cfg.smt_chunk, self.cfg.smt_mem_chunk
        pending: list[_Generated] = []
        pending_len, chunks_done = 0, state.chunks_done
        reads = []
        for start in range(0, seq, c_o):
            gen = self._generate(mems, heads[:, :, start : start + c_o])
            reads.append(self._run_memory(mems["mem"], "mem", gen.q))  # read before write
            for name in self.written:
                mems[name] = self._write(mems[name], name, gen, backend)
            pending.append(gen)
            pending_len += gen.k.shape[2]
            if pending_len == c_m or start + c_o >= seq:
                joined = _Generated(
                    *(torch.cat([getattr(g, f) for g in pending], dim=2) for f in _FIELDS)
                )
                mems["mem"] = self._write(mems["mem"], "mem", joined, backend)
                pending, pending_len = [], 0
            chunks_done += 1
            if self.cfg.write_grad == "truncated" and chunks_done % self.cfg.write_grad_window == 0:
                mems = {n: m.detach() for n, m in mems.items()}
        out = torch.cat(reads, dim=2).transpose(1, 2).reshape(batch, seq, dim)
        return self.w_o(out), SMTState(mems, tail, chunks_done)


_FIELDS = ("k", "v", "q", "eta", "alpha")

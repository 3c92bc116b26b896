"""Typed configs of the three memories, each holding only the knobs its module reads.

No defaults here: every default is written once, in ``hope.model.config.ModelConfig``,
which builds these (``ModelConfig.cms_config`` and friends). The memories import
nothing from ``hope.model``; a memory used outside the model zoo is built from one
of these directly. Imports no torch, so ``hope.config`` stays light.

Error messages name the ``model.*`` params key a user sets, not the field here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CMSRuleName = Literal[
    "gd",
    "momentum",
    "dgd",
    "delta_momentum",
    "ortho_momentum",
    "precond_momentum",
    "deep_momentum",
]
CMSLayout = Literal["chain", "independent"]
SurpriseMetric = Literal["l2", "loss", "entropy"]
WriteGrad = Literal["full", "truncated", "stopgrad"]
Objective = Literal["l2", "dot"]


@dataclass(frozen=True)
class CMSConfig:
    """Continuum Memory System (NL §3, eqs. 30–31; ``memory/cms.py``)."""

    dim: int
    hidden: int  # total MLP width, split across the levels (``split_hidden``)
    periods: tuple[int, ...]  # tokens between writes of each level
    rule: CMSRuleName  # the inner rule of every level (``optim/inner.py``)
    lr: float
    retention: float
    momentum: float
    erase: float
    momentum_width: int  # deep_momentum's hidden width
    adaptive_lr: bool  # η_t = lr·2σ(w·a_t + b) per token (eq. 31)
    layout: CMSLayout
    read_block: int  # tokens per block of the dual read (0: the whole call)
    norm_eps: float
    init_std: float
    surprise_threshold: float | None
    surprise_metric: SurpriseMetric


@dataclass(frozen=True)
class SMTConfig:
    """Self-modifying Titans (NL-arXiv §8; ``memory/smt.py``)."""

    dim: int
    n_heads: int
    chunk: int  # C_o: tokens per write of the generating memories
    mem_chunk: int  # C_m: tokens per write of M_mem, a multiple of C_o
    # R: M_mem read every R tokens inside a write chunk, frozen base (smt_frozen);
    # None: at each chunk's start state (the exact chunked SMT)
    read_chunk: int | None
    expansion: int  # hidden width of each memory = expansion × head dim
    objective: Objective
    eta_scale: float
    retention_init: float
    momentum: float
    precondition: bool
    adaptive_q: bool
    conv_window: int
    write_grad: WriteGrad
    write_grad_window: int
    checkpoint_chunks: int
    init_std: float

    def check(self) -> None:
        """ValueError naming the ``model.*`` key of the first bad value."""
        checks = [
            (self.dim % self.n_heads == 0, f"model.dim={self.dim} not divisible by n_heads"),
            (self.chunk >= 1, f"model.smt_chunk={self.chunk} must be >= 1"),
            (
                self.mem_chunk >= self.chunk and self.mem_chunk % self.chunk == 0,
                f"model.smt_mem_chunk={self.mem_chunk} must be a multiple of "
                f"model.smt_chunk={self.chunk}",
            ),
            *self._read_chunk_checks(),
            (0.0 < self.retention_init < 1.0, "model.smt_retention_init must be in (0, 1)"),
            (self.expansion >= 1, f"model.smt_expansion={self.expansion} must be >= 1"),
            (self.conv_window >= 0, f"model.smt_conv_window={self.conv_window} must be >= 0"),
            (self.write_grad_window >= 1, "model.write_grad_window must be >= 1"),
            (
                self.checkpoint_chunks >= 0,
                f"model.smt_checkpoint_chunks={self.checkpoint_chunks} must be >= 0",
            ),
            (
                self.write_grad in ("full", "truncated", "stopgrad"),
                f"bad write_grad={self.write_grad!r}",
            ),
            (self.objective in ("l2", "dot"), f"bad model.smt_objective={self.objective!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def frozen(self) -> bool:
        """Whether M_mem is read inside write chunks (``smt_frozen``)."""
        return self.read_chunk is not None and self.read_chunk < self.chunk

    def _read_chunk_checks(self) -> list[tuple[bool, str]]:
        read = self.read_chunk
        if read is None:
            return []
        key = f"model.smt_read_chunk={read}"
        checks = [(1 <= read <= self.chunk and self.chunk % read == 0,
                   f"{key} must divide model.smt_chunk={self.chunk}")]  # fmt: skip
        if read < self.chunk:  # frozen base: one write chunk for every memory
            checks += [
                (self.mem_chunk == self.chunk,
                 f"{key} reads inside write chunks: it needs model.smt_mem_chunk="
                 f"{self.mem_chunk} equal to model.smt_chunk={self.chunk}"),
                (self.momentum == 0.0,
                 f"{key} reads inside write chunks: model.smt_momentum={self.momentum} "
                 "must be 0 (chunk-level momentum has no state between read chunks)"),
            ]  # fmt: skip
        return checks


@dataclass(frozen=True)
class TitansMemoryConfig:
    """Titans neural long-term memory (Ti §3; ``memory/titans_memory.py``)."""

    dim: int
    n_heads: int
    chunk: int  # tokens per chunked write (Ti eqs. 16–18)
    depth: int  # L_M
    expansion: int  # hidden width = expansion × head dim
    conv_window: int
    write_grad: WriteGrad
    write_grad_window: int
    checkpoint_chunks: int  # chunk-loop checkpoint segments (``chunk_loop``); 0 = off
    init_std: float

    def check(self) -> None:
        """ValueError naming the ``model.*`` key of the first bad value."""
        if self.checkpoint_chunks < 0:
            raise ValueError(
                f"model.titans_checkpoint_chunks={self.checkpoint_chunks} must be >= 0"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} not divisible by model.n_heads={self.n_heads}")
        if self.chunk < 1:
            raise ValueError(f"model.titans_chunk={self.chunk} must be >= 1")

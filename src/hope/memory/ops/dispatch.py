"""One dispatch point for memory writes (STYLE habit 8).

Backends:
- ``"torch"`` (default): closed-form chunk updates of ``chunk.py`` on rank-1
  gradient factors; no loop over tokens.
- ``"naive"``: the token-loop twins of ``naive.py`` with autograd-materialized
  per-token gradients; the test oracle.
- ``"fla"``: flash-linear-attention's ``chunk_gated_delta_rule`` supplies the
  W2 delta-rule part of a preconditioned DGD write (MECHANISMS §8.1 note);
  imported lazily, so the package never needs it; its parity test
  (tests/test_memory_fla.py) runs where CUDA and ``fla`` are present. Every write
  it has no kernel for (the Titans momentum write, an SMT write with momentum or
  without preconditioning) falls back to the ``"torch"`` closed form, the same
  values; asking for it where it cannot run (no CUDA, no package) is refused when
  the default is set, before any work.
- ``"compile"``: the ``"torch"`` closed forms wrapped in ``torch.compile``
  (fuses the many small ops of a chunk update); compiled lazily on first use,
  never the default. The SMT and the Titans memory compile their whole chunk
  step this way (``memory/smt.py``: generation, the fused memory pass and the
  write; ``memory/titans_memory.py``: read, curvature and write), and the MAC block
  each segment's retrieval and attention (``model/titans.py``): 12-16% off a
  tiny-shape training step on a 2-core CPU (bench, ``bench.memory_backend=compile``).
- ``"fused"``: the SMT's default write (preconditioned DGD, no momentum) as one
  operator with a closed-form backward, ``hope::dgd_chunk`` (``fused.py``): one
  Triton kernel forward and one backward on CUDA instead of ~113 launches, the same
  closed form in PyTorch ops elsewhere (so a CPU counts what a GPU launches); the
  Titans memory's momentum write likewise (``hope::momentum_chunk``) and its chunk's
  step sizes with their overshoot cap (``chunk_rates``: ``chunk_rates.py``), the SMT's
  bounded step (``bounded_step``) as one operator instead of ~30; a memory's chunk-start pass
  (``residual_mlp.chunk_pass(fused=True)``: ``memory_pass.py``), stacked memories on a
  shared input (``residual_mlp.stacked_apply``: ``memory_apply.py``), the SMT's
  generation epilogue (``smt_state.generate_stacked``: ``generation.py``), a group's
  whole write, pass, bounded step and DGD (``smt_state.fused_group_write``:
  ``smt_write.py``), the SMT's whole chunk step with M_mem's pending tokens and write
  (``memory/smt_fused.py``: ``smt_step.py``), the CMS dual form's chunk scan
  (``cms_dual``: ``cms_factor_scan.py``), the normalisation ``unit_rows``
  (``pointwise.py``), every RMSNorm (``rms_normalized``: ``rms_norm.py``) and rotary
  embedding (``rotated``: ``rotary.py``); the Titans memory's heads and gates
  (``titans_heads.py``, called by ``memory/titans_memory.py``) and MAC's segment attention
  (``segment_attention.py``, called by ``model/sliding_attention.py``). The other
  writes (SMT with momentum or without preconditioning) run the ``"torch"`` closed
  form; on CUDA it needs Triton (shipped with CUDA builds of torch), refused when the
  default is set otherwise.

The default is set once per process from the ``train.memory_backend`` /
``bench.memory_backend`` knob (``train.device.setup_runtime`` calls
``set_default_backend``); a memory's ``forward(..., backend=...)`` overrides it for
one call (the tests' naive oracles).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.layers import apply_rotary
from hope.memory.ops.chunk import chunk_dgd_update, chunk_momentum_update, momentum_chunk_weights
from hope.memory.ops.chunk_rates import chunk_rates_reference, titans_chunk_rates
from hope.memory.ops.end_weights import chunk_end_weights
from hope.memory.ops.fused import dgd_chunk, momentum_chunk
from hope.memory.ops.naive import naive_dgd_update, naive_inner_grads, naive_momentum_update
from hope.memory.ops.overshoot import bounded_step_op
from hope.memory.ops.pointwise import l2_normalize, unit_rows_torch
from hope.memory.ops.rms_norm import rms_norm, rms_norm_reference
from hope.memory.ops.rotary import rotary
from hope.memory.ops.stacking import repeat_heads
from hope.memory.residual_mlp import (
    FastWeights,
    GradFactors,
    Objective,
    Residual,
    grad_factors,
    overshoot_ratio,
)

Backend = Literal["torch", "naive", "fla", "compile", "fused"]
BACKENDS: tuple[str, ...] = ("torch", "naive", "fla", "compile", "fused")
_default_backend: Backend = "torch"


def set_default_backend(name: str, knob: str = "memory_backend") -> None:
    """The process's backend (``knob`` names the setting in errors)."""
    global _default_backend
    backend = resolve_backend(name)
    if backend == "fla" and (missing := fla_missing()) is not None:
        raise ValueError(f"{knob}=fla needs {missing}; use torch or compile")
    if backend == "fused" and torch.cuda.is_available() and find_spec("triton") is None:
        raise ValueError(f"{knob}=fused on CUDA needs Triton (pip install triton); use torch")
    _default_backend = backend


@contextlib.contextmanager
def default_backend(name: str, knob: str = "memory_backend") -> Iterator[None]:
    """``set_default_backend(name, knob)`` for the block; the previous default after."""
    global _default_backend
    before = _default_backend
    set_default_backend(name, knob)
    try:
        yield
    finally:
        _default_backend = before


def fla_missing() -> str | None:
    """What the ``"fla"`` backend lacks on this machine, or None."""
    if not torch.cuda.is_available():
        return "a CUDA device (flash-linear-attention's kernels are Triton on CUDA)"
    if find_spec("fla") is None:
        return "flash-linear-attention (pip install flash-linear-attention)"
    return None


def resolve_backend(name: str | None) -> Backend:
    if name is None:
        return _default_backend
    if name not in BACKENDS:
        raise ValueError(f"unknown memory backend {name!r}; expected one of {BACKENDS}")
    return cast(Backend, name)


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=False)


def compiled(fn: _Fn) -> _Fn:
    """``torch.compile(fn)`` with static shapes, built once per function on first use
    (backend 'compile'). Its results equal ``fn``'s (tests/test_memory_compile.py)."""
    return cast(_Fn, _compiled(fn))


def _chunk_fn(name: Backend, fn: _Fn) -> _Fn:
    return compiled(fn) if name == "compile" else fn


def _fla_delta_w2(w2: Tensor, k: Tensor, d: Tensor, eta: Tensor, alpha: Tensor) -> Tensor:
    """W2 after a preconditioned chunk via FLA's gated delta rule.

    Ours: S_t = alpha_t S_{t-1} (I - beta_t k k^T) + beta_t v'_t k_t^T with
    beta = eta/alpha and v' = -alpha D (MECHANISMS §8.1); FLA keeps S^T as
    [B, H, K, V] and takes [B, T, H, *] inputs with log-space gates.
    """
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        raise RuntimeError(
            "memory backend 'fla' needs flash-linear-attention "
            "(pip install flash-linear-attention); use backend 'torch'"
        ) from err
    value = -alpha.unsqueeze(-1) * d  # [B, H, C, M]
    _, final = chunk_gated_delta_rule(
        q=k.transpose(1, 2),
        k=k.transpose(1, 2),
        v=value.transpose(1, 2),
        g=alpha.log().transpose(1, 2),
        beta=(eta / alpha).transpose(1, 2),
        initial_state=w2.transpose(-1, -2).contiguous(),
        output_final_state=True,
    )
    return final.transpose(-1, -2).to(w2.dtype)


def unit_rows(x: Tensor, backend: str | None = None) -> Tensor:
    """x / ||x|| over the last axis (``F.normalize``): one operator under ``fused``;
    ``F.normalize`` itself for the ``naive`` oracle; elsewhere with its gradient written
    out (``pointwise.unit_rows_torch``)."""
    resolved = resolve_backend(backend)
    if resolved == "fused":
        return l2_normalize(x)  # type: ignore[no-any-return]
    return F.normalize(x, dim=-1) if resolved == "naive" else unit_rows_torch(x)


def rms_normalized(x: Tensor, weight: Tensor, eps: float, backend: str | None = None) -> Tensor:
    """x / rms(x) ⊙ w over the last axis (``rms_norm_reference``); one operator each
    way under ``fused``."""
    if resolve_backend(backend) == "fused":
        return rms_norm(x, weight, eps)  # type: ignore[no-any-return]
    return rms_norm_reference(x, weight, eps)


def rotated(x: Tensor, cos: Tensor, sin: Tensor, backend: str | None = None) -> Tensor:
    """``hope.layers.apply_rotary`` of x [B, H, T, D] by cos, sin [T, D/2]; one operator
    each way under ``fused``."""
    if resolve_backend(backend) == "fused":
        return rotary(x, cos.to(x.dtype), sin.to(x.dtype), False)  # type: ignore[no-any-return]
    return apply_rotary(x, cos, sin)


def end_weights_of(eta: Tensor, keep: Tensor, backend: str | None = None) -> Tensor:
    """``momentum_chunk_weights`` [B, H, C] of a Titans chunk's momentum decay and
    retention; one operator under ``fused``."""
    if resolve_backend(backend) == "fused":
        return chunk_end_weights(eta, keep)  # type: ignore[no-any-return]
    return momentum_chunk_weights(eta, keep)


def chunk_rates(
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    curvature: Tensor,
    coupling: Tensor,
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(keep = 1 - alpha, the momentum end weights, the capped inner steps) [B, H, C] of
    a Titans chunk (``chunk_rates.chunk_rates_reference``); one operator each way under
    ``fused``."""
    if resolve_backend(backend) == "fused":
        return titans_chunk_rates(theta, eta, alpha, curvature, coupling.detach())  # type: ignore[no-any-return]
    return chunk_rates_reference(theta, eta, alpha, curvature, coupling)


def bounded_step(kernel: Tensor, eta: Tensor, backend: str | None = None) -> Tensor:
    """eta / (1 + rho), rho = ``overshoot_ratio`` of the kernel bound [B, G*H, C, C] and
    eta [B, G*H or H, C] (shared by G stacked members) without a gradient
    (``smt_state.bounded_eta``); one operator under ``fused``. -> [B, G*H, C]."""
    if resolve_backend(backend) == "fused":
        return bounded_step_op(kernel.detach(), eta)[0]  # type: ignore[no-any-return]
    eta = repeat_heads(eta, kernel.shape[1] // eta.shape[1])
    rho = overshoot_ratio(kernel, eta.detach())
    return eta / (1.0 + rho.unsqueeze(-1))


def dgd_write(
    fast: FastWeights,
    k: Tensor,
    target: Tensor,
    eta: Tensor,
    alpha: Tensor,
    *,
    objective: Objective,
    residual: Residual,
    precondition: bool,
    momentum: float,
    backend: str | None = None,
    factors: GradFactors | None = None,
) -> FastWeights:
    """One chunk's DGD write of a self-modifying memory (NL-arXiv eq. 88).

    k [B,H,C,I] keys, target [B,H,C,O] self-generated v_hat, eta/alpha [B,H,C]; with G
    memories stacked in ``fast`` (H = G*H_k) k and alpha may be shared, [B,H_k,...].
    Gradients are taken at ``fast`` (the chunk-start state). ``factors``: the
    caller's ``grad_factors(fast.w1, fast.w2, k, target, ...)`` when it already
    has them (the naive backend ignores them and differentiates by autograd).
    """
    name = resolve_backend(backend)
    # The closed form and the fused operator read k and alpha shared by the members
    # (the Gram matrix and decay ratios once per head); the token loop, FLA's rule and
    # the factors made here take one copy per member.
    if name in ("naive", "fla") or factors is None or k.shape[1] != alpha.shape[1]:
        k, alpha = (repeat_heads(t, fast.w1.shape[1] // t.shape[1]) for t in (k, alpha))
    if name == "naive":
        if not isinstance(residual, bool):
            raise ValueError("the naive backend writes one memory per call (residual: bool)")
        g1, g2 = naive_inner_grads(fast.w1, fast.w2, k, target, objective, residual)
        out = naive_dgd_update(
            fast.w1, fast.w2, fast.m1, fast.m2, k, g1, g2, eta, alpha, precondition, momentum
        )
        return fast.with_weights(*out)
    if name == "fla" and (not precondition or momentum):
        name = "torch"  # no fla kernel for this rule: the same values by the closed form
    fac = factors or grad_factors(fast.w1, fast.w2, k, target, objective, residual)
    if name == "fused" and precondition and not momentum:
        # One dtype into the kernel: the fast state's (autocast may make factors bf16).
        dt = fast.w1.dtype
        parts = (k, fac.e, fac.a, fac.d, eta, alpha, fac.pre)
        return fast.with_weights(*dgd_chunk(fast.w1, fast.w2, *(t.to(dt) for t in parts)))
    # For 'fla' the cheap decay-only W2 path runs here and is replaced below.
    w1, w2, m1, m2 = _chunk_fn(name, chunk_dgd_update)(
        fast.w1,
        fast.w2,
        fast.m1,
        fast.m2,
        k,
        fac.e,
        fac.a,
        fac.d,
        eta,
        alpha,
        precondition and name != "fla",
        momentum,
        fac.pre,
    )
    if name == "fla":
        w2 = _fla_delta_w2(fast.w2, k, fac.d, eta, alpha)
        m2 = torch.zeros_like(w2)  # momentum is 0, so m2 is never read
    return fast.with_weights(w1, w2, m1, m2)


def momentum_write(
    fast: FastWeights,
    k: Tensor,
    target: Tensor,
    theta: Tensor,
    eta: Tensor,
    keep: Tensor,
    *,
    objective: Objective,
    residual: bool,
    backend: str | None = None,
    end_weights: Tensor | None = None,
    factors: GradFactors | None = None,
) -> FastWeights:
    """One chunk's Titans write (Ti eqs. 13-14; chunked per Ti eqs. 16-18).

    ``fast.m1/m2`` hold the surprise momentum S; theta (step), eta (momentum
    decay) and keep = 1 - alpha (retention) are [B,H,C]; ``end_weights`` =
    ``momentum_chunk_weights(eta, keep)`` and ``factors`` = ``grad_factors`` at
    ``fast`` when the caller has them (the naive backend differentiates by autograd).
    """
    name = resolve_backend(backend)
    if name == "naive":
        g1, g2 = naive_inner_grads(fast.w1, fast.w2, k, target, objective, residual)
        out = naive_momentum_update(fast.w1, fast.w2, fast.m1, fast.m2, g1, g2, theta, eta, keep)
        return fast.with_weights(*out)
    if name == "fla":
        name = "torch"  # no fla kernel for the momentum write: the closed form
    fac = factors or grad_factors(fast.w1, fast.w2, k, target, objective, residual)
    if name == "fused":
        weights = end_weights_of(eta, keep, name) if end_weights is None else end_weights
        dt = fast.w1.dtype  # one dtype into the kernel, as for the DGD write
        parts = (k, fac.e, fac.a, fac.d, theta, eta, keep, weights)
        state = (fast.w1, fast.w2, fast.m1, fast.m2)
        return fast.with_weights(*momentum_chunk(*state, *(t.to(dt) for t in parts)))
    chunked = _chunk_fn(name, chunk_momentum_update)(
        fast.w1, fast.w2, fast.m1, fast.m2, k, fac.e, fac.a, fac.d, theta, eta, keep, end_weights
    )
    return fast.with_weights(*chunked)

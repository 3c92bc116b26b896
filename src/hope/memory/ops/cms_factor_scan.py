"""The chunk scan of a CMS level's dual form as one operator (backend ``fused``):
``hope::cms_factor_scan``.

``cms_dual`` reads a level through Δ_j without forming it, but the chunk-start factors
stay sequential (NL eq. 31): for each fired chunk j of C tokens, with earlier chunks'
factors already known,

  z_t = z⁰_t + Σ_{s in chunks < j} κ_ts u_s,   h_t = gelu(z_t)
  u_t = (b⁰_t + Σ_{s in chunks < j} λ_ts h_s) ⊙ gelu'(z_t)

(κ, λ the coefficient-weighted key and teach score matrices, z⁰, b⁰ the reads through
the carried state). As PyTorch ops that is 5 launches per fired chunk (two batched
products over the rows written so far, the GELU and its row copy, the slope written
into its rows): ~420 per layer-step at the pilot chunking. Every hidden unit evolves
on its own, so one program per (sample, block of hidden units) walks the chunks in
order (``triton_cms.py``): one launch. No gradient (the level's writes are under
stop-gradient). Elsewhere the loop in PyTorch ops, which is this operator's
reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor


def cms_factor_scan_reference(
    pre_0: Tensor, back_0: Tensor, key_scores: Tensor, teach_scores: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """(h, u) [B, F, h] of the F = n_fire * C fired tokens (module docstring); pre_0,
    back_0 [B, >= F, h], key_scores, teach_scores [B, >= F, F]."""
    batch, fired = pre_0.shape[0], key_scores.shape[-1]
    hidden = pre_0.new_empty(batch, fired, pre_0.shape[-1])
    back = torch.empty_like(hidden)
    with _native_gelu(pre_0):
        _scan_chunks(pre_0, back_0, key_scores, teach_scores, chunk, hidden, back)
    return hidden, back


@contextlib.contextmanager
def _native_gelu(like: Tensor) -> Iterator[None]:
    """On a CPU, GELU and its slope by ATen's own kernels, not oneDNN's: a oneDNN call
    costs 10-40 us of setup whatever its size (2-core AMD EPYC, torch 2.13), which the
    scan's row-sized calls, two per chunk, pay in full (5 us natively). The flag is
    global, so it is cleared only around the loop and put back as it was (only that
    flag: ``torch.backends.mkldnn.flags`` would reset the others); compiled code never
    reads it."""
    if like.device.type != "cpu" or torch.compiler.is_compiling():
        yield
        return
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)


def _scan_chunks(
    pre_0: Tensor, back_0: Tensor, key_scores: Tensor, teach_scores: Tensor, chunk: int,
    hidden: Tensor, back: Tensor,
) -> None:  # fmt: skip
    """The loop of ``cms_factor_scan_reference``, filling ``hidden`` and ``back``."""
    for j in range(key_scores.shape[-1] // chunk):
        rows = slice(j * chunk, (j + 1) * chunk)
        # Only the rows written so far (the rest of the buffers is not initialised; the
        # scores' columns there are zero anyway), and the slope straight into its rows:
        # five launches per chunk. (Not the GELU: its CPU ``out=`` into a strided row
        # block writes wrong float32 values in torch 2.13.)
        before, through = slice(0, j * chunk), slice(0, (j + 1) * chunk)
        pre = torch.baddbmm(pre_0[:, rows], key_scores[:, rows, before], back[:, before])
        hidden[:, rows] = F.gelu(pre)
        signal = torch.baddbmm(back_0[:, rows], teach_scores[:, rows, through], hidden[:, through])
        torch.ops.aten.gelu_backward.grad_input(signal, pre, grad_input=back[:, rows])


@torch.library.custom_op("hope::cms_factor_scan", mutates_args=())
def cms_factor_scan(
    pre_0: Tensor, back_0: Tensor, key_scores: Tensor, teach_scores: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """``cms_factor_scan_reference`` in one launch on CUDA (module docstring)."""
    if key_scores.shape[-1] % chunk:
        raise ValueError(f"cms_factor_scan: {key_scores.shape[-1]} tokens in chunks of {chunk}")
    if pre_0.device.type == "cuda":
        from hope.memory.ops.triton_cms import cms_factor_scan_triton

        return cms_factor_scan_triton(pre_0, back_0, key_scores, teach_scores, chunk)
    return cms_factor_scan_reference(pre_0, back_0, key_scores, teach_scores, chunk)


@cms_factor_scan.register_fake
def _(
    pre_0: Tensor, back_0: Tensor, key_scores: Tensor, teach_scores: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    out = pre_0.new_empty(pre_0.shape[0], key_scores.shape[-1], pre_0.shape[-1])
    return out, torch.empty_like(out)

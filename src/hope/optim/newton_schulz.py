"""Newton–Schulz orthogonalisation used by M3 (MECHANISMS §6, NL-arXiv Alg. 1).

M3 uses the classic cubic iteration: X0 = G / ||G||_F, then
X <- ½ X (3I − XᵀX), T times, on G (a 2-D G as written; a per-head stack
[H, a, b] head by head, where the spec's reshape to (shape[0], −1) would mix heads). Each step maps
every singular value s of X to ½ s (3 − s²), which drives s in (0, √3) towards 1,
so X tends to the polar factor U Vᵀ of G = U S Vᵀ. Dividing by the Frobenius
norm puts every s in (0, 1]; small ones grow by only ×1.5 per step, so with the
paper's T = 3 the output is an approximate, not an exact, orthogonalisation.

The Muon hybrid does not use this module: it wraps ``torch.optim.Muon`` and its
quintic iteration (see :mod:`hope.optim.muon`).
"""

from __future__ import annotations

import torch


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """The matrices NS acts on: a 2-D parameter as itself; a >2-D one as the stack
    [prod(leading), a, b] of its last two dims (per-head weights [H, a, b] stay H
    separate matrices; flattening to (H, a·b) would mix the heads)."""
    if tensor.ndim < 2:
        raise ValueError(
            f"Newton–Schulz needs a tensor with >= 2 dims, got shape {tuple(tensor.shape)}"
        )
    if tensor.ndim == 2:
        return tensor
    return tensor.reshape(-1, *tensor.shape[-2:])


def cubic_iteration(x: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """X/||X||_F, then X <- ½X(3I − XᵀX) ``steps`` times, batched over leading dims.

    x [..., m, n]; a zero matrix stays zero (the norm is clamped, not branched on).
    """
    if steps < 0:
        raise ValueError(f"Newton–Schulz steps must be >= 0, got {steps}")
    x = x / torch.linalg.matrix_norm(x).clamp_min(eps)[..., None, None]
    wide = x.shape[-2] <= x.shape[-1]
    for _ in range(steps):
        # ½ X (3I − XᵀX) = 1.5 X − ½ X XᵀX; form the Gram on the short side (cheaper).
        cubic = (x @ x.mT) @ x if wide else x @ (x.mT @ x)
        x = 1.5 * x - 0.5 * cubic
    return x


def newton_schulz_cubic(update: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """NS_T(G): T cubic Newton–Schulz steps on each matrix of G (``as_matrix``).

    Returns a tensor of G's shape and dtype. Works in fp32 (fp64 for fp64 input);
    a zero G gives zero (the norm is clamped by ``eps``). Sync-free.
    """
    matrix = as_matrix(update)  # [m, n] or [heads, m, n]
    work = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    return cubic_iteration(matrix.to(work), steps, eps).reshape(update.shape).to(update.dtype)

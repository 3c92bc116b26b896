"""The optional flash-linear-attention backend (MECHANISMS §8.1 note): its gated delta
rule gives the same preconditioned W2 write as the closed form of ``chunk.py``.

Needs CUDA and the ``fla`` package (neither is a dependency of the project); skips
otherwise. What runs everywhere: the backend refuses what it cannot do.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.nn import functional as F

from hope.memory.ops.dispatch import dgd_write, momentum_write
from hope.memory.residual_mlp import FastWeights

B, H, C, D_IN, D_HID = 2, 4, 16, 32, 64
HAVE_FLA = importlib.util.find_spec("fla") is not None


def _inputs(device: str, seed: int = 0) -> tuple[FastWeights, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device).requires_grad_()

    fast = FastWeights(
        rand(B, H, D_IN, D_HID, scale=0.1),
        rand(B, H, D_HID, D_IN, scale=0.2),
        torch.zeros(B, H, D_IN, D_HID, device=device),
        torch.zeros(B, H, D_HID, D_IN, device=device),
    )
    k = F.normalize(torch.randn(B, H, C, D_IN, generator=gen), dim=-1).to(device)
    inputs = {
        "k": k.requires_grad_(),
        "target": rand(B, H, C, D_IN),
        "eta": (0.01 + 0.05 * torch.rand(B, H, C, generator=gen)).to(device).requires_grad_(),
        "alpha": (0.9 + 0.1 * torch.rand(B, H, C, generator=gen)).to(device).requires_grad_(),
    }
    return fast, inputs


def test_fla_backend_refuses_what_it_cannot_do() -> None:
    fast, x = _inputs("cpu")
    args = (fast, x["k"], x["target"], x["eta"], x["alpha"])
    with pytest.raises(ValueError, match="precondition=True, momentum=0"):
        dgd_write(*args, objective="l2", residual=True, precondition=False, momentum=0.0,
                  backend="fla")  # fmt: skip
    with pytest.raises(ValueError, match="no Titans momentum write"):
        momentum_write(fast, x["k"], x["target"], x["eta"], x["eta"], x["alpha"],
                       objective="l2", residual=True, backend="fla")  # fmt: skip


@pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_FLA), reason="needs CUDA and flash-linear-attention"
)
def test_fla_backend_equals_closed_form_with_grads() -> None:
    fast, x = _inputs("cuda")
    kw = dict(objective="l2", residual=True, precondition=True, momentum=0.0)
    probes = [torch.randn_like(t) for t in (fast.w1, fast.w2)]
    results = {}
    for backend in ("torch", "fla"):
        out = dgd_write(fast, x["k"], x["target"], x["eta"], x["alpha"], backend=backend, **kw)
        loss = sum((t * p).sum() for t, p in zip((out.w1, out.w2), probes, strict=True))
        params = [fast.w1, fast.w2, *x.values()]
        results[backend] = ((out.w1, out.w2), torch.autograd.grad(loss, params))
    for got, ref in zip(results["fla"][0], results["torch"][0], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4)
    names = ["w1", "w2", *x]
    for name, got, ref in zip(names, results["fla"][1], results["torch"][1], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3, msg=name)

"""The optional flash-linear-attention backend (MECHANISMS §8.1 note): its gated delta
rule gives the same preconditioned W2 write as the closed form of ``chunk.py``.

Needs CUDA and the ``fla`` package (neither is a dependency of the project); skips
otherwise. What runs everywhere: the writes it has no kernel for fall back to the
closed form, and asking for it where it cannot run is refused before any work.
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


@pytest.mark.parametrize(("precondition", "momentum"), [(False, 0.0), (True, 0.5)])
def test_fla_backend_falls_back_to_the_closed_form_where_it_has_no_kernel(
    precondition: bool, momentum: float
) -> None:
    """An SMT write fla cannot do and the Titans momentum write run the "torch" closed
    form under "fla": bit for bit the same (no fla import, so this runs on any machine)."""
    fast, x = _inputs("cpu")
    args = (fast, x["k"], x["target"], x["eta"], x["alpha"])
    kw = {"objective": "l2", "residual": True, "precondition": precondition, "momentum": momentum}
    got, want = dgd_write(*args, **kw, backend="fla"), dgd_write(*args, **kw, backend="torch")
    for name in ("w1", "w2", "m1", "m2"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    args = (fast, x["k"], x["target"], x["eta"], x["eta"], x["alpha"])
    got = momentum_write(*args, objective="l2", residual=True, backend="fla")
    want = momentum_write(*args, objective="l2", residual=True, backend="torch")
    for name in ("w1", "w2", "m1", "m2"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)


@pytest.mark.skipif(
    torch.cuda.is_available() and HAVE_FLA, reason="fla can run here: nothing to refuse"
)
def test_fla_where_it_cannot_run_is_refused_naming_the_knob(tmp_path) -> None:
    from hope.config import TrainConfig
    from hope.errors import ConfigError
    from hope.train.device import setup_runtime

    missing = "a CUDA device" if not torch.cuda.is_available() else "flash-linear-attention"
    for section in ("train", "bench"):
        with pytest.raises(ConfigError, match=f"{section}.memory_backend=fla needs {missing}"):
            setup_runtime(TrainConfig(memory_backend="fla"), torch.device("cpu"), section)


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

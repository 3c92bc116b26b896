"""CUDA autocast's dtype rules on a CPU: every variant trains a bf16 step.

CPU and CUDA autocast cast different ops. On CUDA the reductions, exponentials,
powers, norms and softmaxes run in fp32 (PyTorch's "CUDA ops that can autocast to
float32"), on a CPU in bf16, so a CPU bf16 step never meets the dtype mixtures a CUDA
step does: fp32 normalised keys beside bf16 activations, fp32 gradients into a
backward that saved bf16. The first H200 run failed there (titans_mac's curvature
backward), after every CPU test had passed. Here those ops are wrapped to run in fp32
under CPU autocast, which reproduces that failure on the code before its fix, and one
training step of every variant and backend must run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hope
from conftest import TINY_SHAPE
from hope.memory.ops.dispatch import set_default_backend
from hope.optim.outer import build_optimizer
from hope.train.step import train_step

# The ops of CUDA autocast's fp32 list that the models call (torch, Tensor and F names).
CUDA_FP32_OPS = (
    "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "__pow__", "__rpow__",
    "reciprocal", "rsqrt", "sum", "prod", "cumsum", "cumprod", "softmax", "log_softmax",
    "logsumexp", "norm", "normalize", "softplus", "layer_norm", "cross_entropy", "nll_loss",
    "mse_loss",
)  # fmt: skip
VARIANTS = ("transformer", "hope_attention", "hope", "titans_lmm", "titans_mac", "titans_mag",
            "titans_mal")  # fmt: skip


def _widen(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    if isinstance(value, list | tuple):
        return type(value)(_widen(v) for v in value)
    return value


def _in_fp32_under_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled("cpu"):
            args, kwargs = _widen(args), {k: _widen(v) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return run


@pytest.fixture
def cuda_autocast_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CUDA_FP32_OPS:
        for owner in (torch, torch.Tensor, F):
            if hasattr(owner, name):
                monkeypatch.setattr(owner, name, _in_fp32_under_autocast(getattr(owner, name)))


def test_the_rules_run_cuda_fp32_ops_in_fp32(cuda_autocast_rules: None) -> None:
    x = torch.randn(4, 8)
    with torch.autocast("cpu", torch.bfloat16):
        h = x @ x.T  # bf16, as on both devices
        assert h.dtype == torch.bfloat16
        assert h.sum().dtype == torch.float32 and torch.exp(h).dtype == torch.float32
        assert F.normalize(h, dim=-1).dtype == torch.float32
    assert x.sum().dtype == torch.float32 and torch.exp(x.bfloat16()).dtype == torch.bfloat16


# Modes with their own paths through the memories (variant, backend, overrides).
MODES = (
    ("hope", "torch", ("model.smt_chunk=8", "model.smt_mem_chunk=8", "model.smt_read_chunk=4")),
    ("hope", "fused", ("model.checkpoint_blocks=true",)),
    ("hope", "torch", ("model.cms_rule=momentum", "model.cms_momentum=0.9")),
    ("hope", "torch", ("model.cms_adaptive_lr=true", "model.smt_adaptive_q=true")),
    ("hope", "torch", ("model.cms_mode=exact_online", "model.smt_checkpoint_chunks=2")),
    ("titans_mac", "torch", ("model.titans_depth=3",)),
)


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_bf16_training_step_runs_under_cuda_autocast_rules(
    variant: str, backend: str, cuda_autocast_rules: None
) -> None:
    _bf16_step(variant, backend, ())


@pytest.mark.parametrize(("variant", "backend", "overrides"), MODES)
def test_memory_modes_run_a_bf16_step_under_cuda_autocast_rules(
    variant: str, backend: str, overrides: tuple[str, ...], cuda_autocast_rules: None
) -> None:
    _bf16_step(variant, backend, overrides)


def _bf16_step(variant: str, backend: str, overrides: tuple[str, ...]) -> None:
    cfg = hope.load_config(None, [f"model.variant={variant}", *TINY_SHAPE, *overrides])
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, cfg.model.vocab_size or 1, (2, 17))
    set_default_backend(backend)
    try:
        loss = train_step(model, optimizer, None, tokens[:, :-1], tokens[:, 1:], 1.0,
                          torch.bfloat16)  # fmt: skip
    finally:
        set_default_backend("torch")
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)

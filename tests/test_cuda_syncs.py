"""On CUDA, one full training step runs under sync-debug mode "error" (no host syncs),
and the bench's kernel counter counts a toy's eager and compiled kernels.

The CPU twin of this check is the counting test in tests/test_train_loop.py,
tests/test_model_hope.py and tests/test_model_titans.py; this one needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

import hope
from hope.bench.measure import CudaKernelCounter
from hope.memory.ops.dispatch import set_default_backend
from hope.optim.outer import build_optimizer
from hope.train.schedule import build_scheduler
from hope.train.step import train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


FROZEN_READS = ("model.smt_chunk=64", "model.smt_mem_chunk=64", "model.smt_read_chunk=16")


@pytest.mark.parametrize(
    ("variant", "extra", "backend"),
    [("transformer", (), "torch"), ("hope_attention", (), "torch"), ("hope", (), "torch"),
     ("hope", FROZEN_READS, "torch"), ("titans_mac", (), "torch"), ("hope", (), "fused"),
     ("titans_mac", (), "fused")],
    ids=["transformer", "hope_attention", "hope", "hope-frozen_reads", "titans_mac",
         "hope-fused", "titans_mac-fused"],
)  # fmt: skip
def test_training_step_is_sync_free_on_cuda(
    variant: str, extra: tuple[str, ...], backend: str
) -> None:
    set_default_backend(backend)  # the fused write's Triton kernels launch no sync either
    try:
        _sync_free_step(variant, extra)
    finally:
        set_default_backend("torch")


def _sync_free_step(variant: str, extra: tuple[str, ...]) -> None:
    cfg = hope.load_config(None, [f"model.variant={variant}", "train.device=cuda", *extra])
    device = torch.device("cuda")
    model = hope.build_model(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, 10)
    vocab = cfg.model.vocab_size or 1
    x = torch.randint(0, vocab, (2, cfg.data.seq_len), device=device)
    y = torch.randint(0, vocab, (2, cfg.data.seq_len), device=device)
    train_step(model, optimizer, scheduler, x, y, 1.0, torch.bfloat16)  # warm-up: allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = train_step(model, optimizer, scheduler, x, y, 1.0, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_cuda_kernel_counter_sees_eager_and_compiled_kernels() -> None:
    """A toy with a known count: three pointwise ops are three eager kernels and one
    fused kernel once compiled (scripts/gpu_check.sh runs this file)."""
    x = torch.randn(1024, device="cuda")

    def toy(t: torch.Tensor) -> torch.Tensor:
        return ((t + 1.0) * 2.0).exp()

    compiled = torch.compile(toy)
    compiled(x)  # compile outside the count
    torch.cuda.synchronize()
    counts = {}
    for name, fn in (("eager", toy), ("compiled", compiled)):
        with CudaKernelCounter() as counter:
            fn(x)
        counts[name] = counter.count
    assert counts == {"eager": 3, "compiled": 1}

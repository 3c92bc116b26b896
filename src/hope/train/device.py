"""Device, precision, threads and determinism for a training run."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from hope.config import TrainConfig
from hope.errors import ConfigError
from hope.memory.ops.dispatch import set_default_backend


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda``/``cuda:N`` must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"train.device: unknown device {name!r} (auto, cpu, cuda, cuda:N)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"train.device: unsupported device {name!r} (auto, cpu, cuda, cuda:N)")
    return device


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """bf16 autocast dtype, or None for fp32. ``auto`` = bf16 on CUDA that supports it."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def allows_tf32(precision: str) -> bool:
    """Whether a run of ``train.precision`` ``precision`` lets CUDA fp32 matmuls (and the
    fused kernels' fp32 products) use TF32: bf16 and auto do, fp32 is strict."""
    return precision != "fp32"


def configure_numerics(cfg: TrainConfig, device: torch.device) -> None:
    """Everything besides the seed that changes a run's numbers, from the config only.

    Threads: CPU kernels split reductions per thread, so the count is pinned (never
    the machine's default). Determinism: ``torch.use_deterministic_algorithms`` and,
    on CUDA, cuBLAS's fixed workspace and deterministic cuDNN. ``precision: fp32``
    is strict fp32 on CUDA (no TF32 matmuls); ``bf16``/``auto`` allow TF32 for the
    fp32 ops outside autocast.
    """
    torch.set_num_threads(cfg.num_threads)
    if device.type == "cuda":
        if cfg.deterministic:
            # Must be set before the first cuBLAS handle is made (torch docs,
            # "Reproducibility"); setdefault keeps a user's own choice.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = cfg.deterministic
        torch.backends.cudnn.benchmark = not cfg.deterministic
        tf32 = allows_tf32(cfg.precision)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    torch.use_deterministic_algorithms(cfg.deterministic)


def upload(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device`` without the host waiting for the device. On CUDA from
    pinned memory: a copy from pageable memory is staged by the driver, which may wait
    for the stream's earlier work (CUDA runtime API, "API synchronization behavior"),
    a hidden sync per step that keeps the host from running ahead (under
    ``train.cuda_graph`` it would wait for each replay to finish)."""
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def runtime_record(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """The resolved numerics of this process, for the reports (train.json, eval.json)."""
    amp = autocast_dtype(device, cfg.precision)
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": "fp32" if amp is None else str(amp).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch": str(torch.__version__),  # TorchVersion would not pass weights_only loads
    }


def setup_runtime(cfg: TrainConfig, device: torch.device, section: str = "train") -> None:
    """Numerics, seeds and the memory-write backend, before the model is built; a
    backend this machine cannot run is a ConfigError naming ``{section}.memory_backend``."""
    try:
        set_default_backend(cfg.memory_backend, f"{section}.memory_backend")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    configure_numerics(cfg, device)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

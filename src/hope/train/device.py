"""Device, precision, threads and determinism for a training run."""

from __future__ import annotations

import random

import numpy as np
import torch

from hope.config import ConfigError, TrainConfig
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


def setup_runtime(cfg: TrainConfig, device: torch.device) -> None:
    """Threads, seeds, the memory-write backend and (on CPU) deterministic kernels,
    before the model is built."""
    set_default_backend(cfg.memory_backend)
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if device.type == "cpu":
        # CUDA determinism would need CUBLAS_WORKSPACE_CONFIG and slower kernels; CPU is free.
        torch.use_deterministic_algorithms(True)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

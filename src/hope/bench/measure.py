"""Measuring one training step: wall time, peak memory, host-device syncs.

- Time: ``time.perf_counter`` around each whole step; on CUDA the device is
  synchronized at the timing boundaries only, outside the step.
- Memory: CUDA ``max_memory_allocated`` after a reset; on CPU the process's
  resident-set high-water mark. That mark is process-wide and only grows, so the
  bench runs each measurement in a fresh process; on Linux it is also reset
  (``/proc/self/clear_refs``) right before the model is built.
- Syncs: calls to the Tensor methods that copy a value to the host during one
  step, counted by patching them (the technique of tests/test_train_loop.py).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
MB = 1024 * 1024


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Patch ``torch.Tensor`` sync methods; yields the list of method names called."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(name, original))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    step: Callable[[int], Any], warmup: int, steps: int, device: torch.device
) -> list[float]:
    """Run ``step(i)`` for i < warmup (untimed), then ``steps`` timed calls; seconds each."""
    for i in range(warmup):
        step(i)
    seconds: list[float] = []
    for i in range(warmup, warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step(i)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def current_rss_mb() -> float:
    return psutil.Process().memory_info().rss / MB


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """VmHWM from /proc/self/status, else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MB if sys.platform == "darwin" else peak * 1024 / MB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return peak_rss_mb()


def baseline_memory_mb(device: torch.device) -> float:
    """Memory in use before the model is built (CUDA allocated, or process RSS)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MB
    return current_rss_mb()

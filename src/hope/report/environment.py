"""What a result was produced on: interpreter, libraries, machine, device, commit.

No timestamps or host names: the record is part of DVC-tracked outputs and
should change only when the environment does.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(cwd: Path | None = None) -> str | None:
    """``git rev-parse HEAD``, or None outside a repository / without commits / without git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def device_name(device: str | None = None) -> str:
    """``cpu`` or the CUDA device's name (the first one unless ``device`` says cuda:N)."""
    import torch

    if device is not None and not device.startswith("cuda") and device != "auto":
        return device
    if not torch.cuda.is_available():
        return "cpu"
    index = torch.device(device).index if device and device.startswith("cuda:") else None
    return f"cuda ({torch.cuda.get_device_name(index)})"


def collect_environment(device: str | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """The environment record stored in release bundles and benchmark reports."""
    import numpy
    import torch

    import hope

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "hope": hope.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": _cpu_count(),
        "device": device_name(device),
        "git_commit": git_commit(cwd),
    }


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

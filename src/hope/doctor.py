"""``hope doctor``: is this machine ready to run the pipeline? Each problem with its fix.

Checks the torch build and device (CUDA, bf16), the pipeline tools (dvc, snakemake,
wandb, sentencepiece, datasets, safetensors), the git identity ``dvc exp run`` needs,
free disk, and whether ``data.source`` of the params file can be reached.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
from dataclasses import dataclass
from glob import glob
from pathlib import Path

import torch

from hope.config import load_config
from hope.errors import ConfigError

TOOLS = ("dvc", "snakemake", "wandb", "sentencepiece", "datasets", "safetensors")
MIN_FREE_GB = 5.0
HF_HOST = ("huggingface.co", 443)
INSTALL = "run `make setup` (installs the project with its pinned tools into .venv)"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # a failed optional check is a warning

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.required else "warn")
        fix = f" -- fix: {self.fix}" if not self.ok and self.fix else ""
        return f"{mark}  {self.name}: {self.detail}{fix}"


def check_torch() -> list[Check]:
    build = f"torch {torch.__version__}, Python {platform.python_version()}"
    checks = [Check("torch", True, build)]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        checks.append(Check("device", True, f"CUDA {torch.version.cuda}: {names}"))
        bf16 = torch.cuda.is_bf16_supported()
        checks.append(
            Check("bf16", bf16, "supported" if bf16 else "not supported on this GPU",
                  "set train.precision=fp32", required=False)
        )  # fmt: skip
    else:
        checks.append(
            Check("device", False, "no CUDA device: training runs on the CPU (fine for `tiny`)",
                  "for the paper presets install a CUDA build: make setup "
                  'TORCH_SPEC="torch==2.13.0 --extra-index-url '
                  'https://download.pytorch.org/whl/cu128"', required=False)
        )  # fmt: skip
    return checks


def check_tools() -> list[Check]:
    checks = []
    for name in TOOLS:
        try:
            checks.append(Check(name, True, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            checks.append(Check(name, False, "not installed", INSTALL))
    return checks


def check_git_identity() -> Check:
    values = []
    for key in ("user.name", "user.email"):
        env = "GIT_AUTHOR_NAME" if key == "user.name" else "GIT_AUTHOR_EMAIL"
        out = subprocess.run(["git", "config", key], capture_output=True, text=True, check=False)
        values.append(out.stdout.strip() or os.environ.get(env, ""))
    if all(values):
        return Check("git identity", True, f"{values[0]} <{values[1]}>")
    return Check(
        "git identity", False, "not set (`dvc exp run` commits experiments)",
        'git config --global user.name "Your Name" && '
        "git config --global user.email you@example.org",
    )  # fmt: skip


def check_disk(path: Path = Path(".")) -> Check:
    free = shutil.disk_usage(path).free / 2**30
    return Check(
        "free disk", free >= MIN_FREE_GB, f"{free:.1f} GiB free in {path.resolve()}",
        f"free space: the paper presets need far more than {MIN_FREE_GB:.0f} GiB "
        "(shards, checkpoints, DVC cache)", required=False,
    )  # fmt: skip


def _reachable(host: tuple[str, int], timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(host, timeout=timeout):
            return True
    except OSError:
        return False


def check_data_source(params: Path) -> Check:
    try:
        cfg = load_config(params if params.is_file() else None)
    except ConfigError as err:
        return Check("params", False, str(err), f"fix {params}")
    data = cfg.data
    if data.source == "builtin":
        return Check("data.source", True, "builtin (bundled corpus, no network)")
    if data.source == "local":
        found = len(glob(data.local_glob, recursive=True)) if data.local_glob else 0
        return Check(
            "data.source", found > 0, f"local: {found} files match {data.local_glob!r}",
            "set data.local_glob to your text files, or data.source=builtin",
        )  # fmt: skip
    offline = (
        os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    )
    ok = not offline and _reachable(HF_HOST)
    why = "HF_HUB_OFFLINE is set" if offline else "huggingface.co:443 unreachable"
    return Check(
        "data.source", ok, f"hf {data.hf_name}: " + ("reachable" if ok else why),
        "give this machine network access, or use data.source=local / builtin",
    )  # fmt: skip


def run_doctor(params: Path = Path("params.yaml")) -> tuple[list[Check], int]:
    """All checks and the exit code: 1 if a required check failed, else 0."""
    checks = [
        *check_torch(), *check_tools(), check_git_identity(), check_disk(),
        check_data_source(params),
    ]  # fmt: skip
    failed = any(not c.ok and c.required for c in checks)
    return checks, int(failed)

"""Shared fixtures: a clean copy of the repository for end-to-end pipeline runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def pipeline_env(home: Path) -> dict[str, str]:
    """Environment for pipeline subprocesses: this venv first, offline, no telemetry."""
    env = dict(os.environ)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        DVC_NO_ANALYTICS="1",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        GIT_AUTHOR_NAME="ci",
        GIT_AUTHOR_EMAIL="ci@example.invalid",
        GIT_COMMITTER_NAME="ci",
        GIT_COMMITTER_EMAIL="ci@example.invalid",
        XDG_CACHE_HOME=str(home / "xdg-cache"),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"),
    )
    return env


def copy_repo(dest: Path) -> Path:
    """Copy the tracked and untracked-but-not-ignored files, then commit them in a new repo."""
    dest.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    env = pipeline_env(dest)
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "snapshot"],
    ):
        subprocess.run(cmd, cwd=dest, env=env, check=True)
    # Keep DVC's machine-wide site cache inside the test folder.
    site = dest.parent / f"{dest.name}-dvc-site"
    run(["dvc", "config", "--local", "core.site_cache_dir", str(site)], dest)
    return dest


def run(cmd: list[str], cwd: Path, timeout: float = 2400) -> subprocess.CompletedProcess[str]:
    """Run a pipeline command; on timeout kill its whole process group (no orphan stages)."""
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=pipeline_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.communicate()
            raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode})\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def dvc_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository copy on which `dvc repro` has run once (shared by the slow tests)."""
    repo = copy_repo(tmp_path_factory.mktemp("dvc") / "repo")
    # The README's main command, pointed at the venv running these tests. `-o` keeps
    # make from re-running its install step (which would re-point this venv's
    # editable install at the temporary copy); CI's `make test` has just installed it.
    stamp = BIN.parent / ".installed"
    run(["make", "-o", str(stamp), "repro", f"VENV={BIN.parent}"], repo)
    return repo

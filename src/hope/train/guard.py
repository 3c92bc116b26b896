"""Guards of a training run: one run per checkpoint folder, and non-finite losses.

``RunLock`` takes an exclusive ``flock`` on ``<ckpt_dir>/.lock`` for the whole run and
writes its holder (pid, host, start time) into it; a second run on the same folder
stops at once, naming the holder. The kernel drops the lock when its process dies,
SIGKILL included, so no stale lock is ever left to clean up.

``NonFiniteWatch`` counts non-finite step losses on the device (no host sync per
step) and is read once per log/validation/checkpoint boundary, before anything is
logged or saved: so no checkpoint ever holds a diverged model.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
from pathlib import Path
from types import TracebackType
from typing import IO

import torch

from hope.errors import StageError
from hope.train import distributed as dist_env

LOCK_NAME = ".lock"


class RunLock(contextlib.AbstractContextManager["RunLock"]):
    def __init__(self, ckpt_dir: Path) -> None:
        self.path = Path(ckpt_dir) / LOCK_NAME
        self.handle: IO[str] | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115  (held for the whole run)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise StageError(
                f"{self.path.parent} is in use by another training run ({holder}); "
                "wait for it to finish or train into another folder"
            ) from None
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n")
        handle.flush()
        self.handle = handle
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None


class NonFiniteWatch:
    """Device-side count of non-finite step losses since the last verified step."""

    def __init__(self, device: torch.device, step: int) -> None:
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.verified_step = step  # every step up to here had a finite loss

    def observe(self, loss: torch.Tensor) -> None:
        self.count += (~torch.isfinite(loss)).to(torch.int64)  # on device, no sync

    def reset(self, step: int) -> None:
        self.count.zero_()
        self.verified_step = step

    def total(
        self, env: dist_env.DistEnv, params: list[torch.Tensor] | None = None
    ) -> tuple[int, bool]:
        """The count summed over ranks and, given ``params``, whether any of them is no
        longer finite (``train.nan_policy=skip``: a finite gradient may still step the
        weights to inf): one host read, at a log/validation/checkpoint step (all ranks
        agree)."""
        bad_weights = torch.zeros_like(self.count)
        if params:
            norms = torch.stack(torch._foreach_norm(params))
            bad_weights = (~torch.isfinite(norms)).any().to(torch.int64)
        counts = dist_env.all_reduce_sum(torch.stack((self.count, bad_weights)), env)
        losses, weights = counts.tolist()
        return int(losses), bool(weights)


def divergence_error(
    what: str, span: str, policy: str, rewinds: int, last_good: str | None
) -> StageError:
    """The one line ending a diverged run: what went wrong where, under which policy,
    the last good checkpoint (``last_good``, None: none) and what is left to do, never
    the policy already set."""
    kept = f"the last good checkpoint ({last_good}) is intact" if last_good else "no checkpoint"
    setting = f"train.nan_policy={policy}"
    if policy == "rewind":
        setting += f", after {rewinds} rewinds" if last_good else ", nothing to rewind to"
    also = {
        "stop": ", or set train.nan_policy=rewind",
        "rewind": "",
        "skip": " (skipping steps cannot undo it), or set train.nan_policy=rewind",
    }
    return StageError(
        f"train: {what} in {span} ({setting}); {kept}: lower optim.lr{also[policy]} (a new "
        "optim.lr starts a fresh run, keeping this run's checkpoints aside)"
    )

"""How a train run is started on one process, several, or several nodes.

One node: ``python stages/train.py`` with ``train.nproc_per_node > 1`` re-runs itself
under ``torch.distributed.run --standalone`` (``relaunch_command``). Several nodes
(``train.nnodes > 1``): the same command runs once per node (SLURM: one ``srun`` task
per node, ``srun_prefix``) and each copy starts ``torch.distributed.run`` with
``nproc_per_node`` local ranks; the copies meet at a c10d rendezvous on the first node
of the allocation (``rendezvous``). Under an existing torchrun environment
(``WORLD_SIZE`` set) the stage joins it instead.

``slurm_resources`` is what the Snakefile's train rule asks of the scheduler, from the
same params: nodes, one task per node, GPUs per node. Torch-free, so the Snakefile can
import it while it parses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from hope.config import Config
from hope.errors import ConfigError

# The rendezvous port on the first node: 29500 plus the job id modulo 1000 (two jobs
# that share a node do not collide), unless HOPE_RDZV_PORT says otherwise.
BASE_PORT = 29500


def on_gpus(cfg: Config) -> bool:
    """Whether the train stage asks for GPUs ("auto" means CUDA where there is one)."""
    return cfg.train.device != "cpu"


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[01-04]`` forms expanded by scontrol)."""
    try:
        listed = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        raise ConfigError(
            f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with `scontrol show hostnames` "
            f"({err}); set HOPE_RDZV_ENDPOINT=host:port instead"
        ) from err
    if not listed:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return listed[0]


def rendezvous(nnodes: int, environ: Mapping[str, str]) -> tuple[str, str]:
    """(endpoint host:port, run id) where the ``nnodes`` copies of a run meet.

    ``HOPE_RDZV_ENDPOINT`` when set (any launcher); else, inside a SLURM job step, the
    first node of ``SLURM_JOB_NODELIST`` at ``HOPE_RDZV_PORT`` (default 29500 + job id
    mod 1000). The run id is ``HOPE_RDZV_ID``, else the SLURM job id: every copy of one
    job meets the others and no other job's.
    """
    job = environ.get("SLURM_JOB_ID", "")
    run_id = environ.get("HOPE_RDZV_ID") or job or "hope"
    endpoint = environ.get("HOPE_RDZV_ENDPOINT")
    if endpoint:
        return endpoint, run_id
    nodelist = environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ConfigError(
            f"train.nnodes={nnodes} needs a rendezvous: run inside a SLURM job step "
            "(one task per node; SLURM_JOB_NODELIST) or set HOPE_RDZV_ENDPOINT=host:port "
            "to the first node, and start the same command on every node"
        )
    default_port = BASE_PORT + (int(job) % 1000 if job.isdigit() else 0)
    port = environ.get("HOPE_RDZV_PORT", str(default_port))
    return f"{first_node(nodelist)}:{port}", run_id


def relaunch_command(
    cfg: Config, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> list[str] | None:
    """The torchrun command that runs this stage on ``train.nproc_per_node`` processes
    (per node, ``train.nnodes`` nodes), or None when it should run in this process."""
    environ = os.environ if environ is None else environ
    nproc, nnodes = cfg.train.nproc_per_node, cfg.train.nnodes
    if (nproc == 1 and nnodes == 1) or "WORLD_SIZE" in environ:
        return None
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1:
        command.append("--standalone")
    else:
        endpoint, run_id = rendezvous(nnodes, environ)
        command += [
            f"--nnodes={nnodes}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_id={run_id}",
        ]  # fmt: skip
    return [*command, *argv]


def slurm_resources(cfg: Config) -> dict[str, int | str]:
    """The train rule's scheduler resources (snakemake-executor-plugin-slurm keys).

    One node: ``nproc_per_node`` GPUs (``--gpus``; none on CPU) for the one task that
    starts torchrun. Several nodes: ``--nodes`` and one task per node (``tasks``; the
    ``mpi`` key makes the job run the rule's own ``srun``, see ``srun_prefix``), GPUs per
    node as ``--gres=gpu:N``, and no ``--ntasks-per-gpu`` (``tasks_per_gpu=0``): a task
    drives all of its node's GPUs.
    """
    nproc, nnodes = cfg.train.nproc_per_node, cfg.train.nnodes
    gpus = nproc if on_gpus(cfg) else 0
    if nnodes == 1:
        return {"gpu": gpus} if gpus else {}
    resources: dict[str, int | str] = {
        "nodes": nnodes, "tasks": nnodes, "mpi": "srun", "tasks_per_gpu": 0,
    }  # fmt: skip
    if gpus:
        resources["gres"] = f"gpu:{gpus}"
    return resources


def eval_resources(cfg: Config) -> dict[str, int | str]:
    """An evaluation rule's resources: one process on ``train.device``, so one GPU
    unless that is the CPU."""
    return {"gpu": 1} if on_gpus(cfg) else {}


def srun_prefix(cfg: Config) -> str:
    """What the train rule's command starts with: on several nodes, one task per node."""
    nnodes = cfg.train.nnodes
    if nnodes == 1:
        return ""
    return f"srun --nodes={nnodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "

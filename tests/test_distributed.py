"""Data parallelism (hope.train.distributed): two gloo processes under torchrun train
exactly what one process trains (fast state is per sample), and the knobs that cannot
be kept exact are refused."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hope
from hope.errors import ConfigError
from hope.train import distributed as d
from hope.train import launch

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
from test_train_loop import run
from pathlib import Path
metrics = run(Path({out!r}), *{extra!r})
if {rank_file!r}:
    import os
    Path({out!r}, "rank" + os.environ.get("RANK", "0")).write_text(json.dumps(metrics))
"""


def _run_worker(out: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess[str]:
    script = out / "worker.py"
    out.mkdir(parents=True, exist_ok=True)
    script.write_text(WORKER.format(tests=str(ROOT / "tests"), out=str(out), extra=extra,
                                    rank_file=True))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, str(script)]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", str(script)]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: one process x 4 rows, whole batches (micro-batches and FSDP2 change
    only the order of fp32 sums, which the comparisons below allow)."""
    out = tmp_path_factory.mktemp("one")
    one = _run_worker(out, 1)
    assert one.returncode == 0, one.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("train.micro_batch_size=1",),
        ("train.parallel=fsdp", "train.micro_batch_size=1"),
    ],
)
def test_two_processes_train_what_one_process_trains(
    tmp_path: Path, one_process: Path, extra: tuple[str, ...]
) -> None:
    """hope on 2 ranks x 2 rows (and micro-batches of 1 row; and FSDP2, sharded, with
    micro-batches; every variant under FSDP2: test_distributed_variants.py) vs 1
    process x 4 rows: the same train and validation losses at every logged step, within
    fp32 summation-order noise; rank 0 alone writes reports and checkpoints."""
    two = _run_worker(tmp_path / "two", 2, *extra)
    assert two.returncode == 0, two.stderr[-3000:]
    single = json.loads((one_process / "reports/train.json").read_text())
    parallel = json.loads((tmp_path / "two/reports/train.json").read_text())
    for key in ("train_loss", "val_subset_loss"):
        assert parallel[key] == pytest.approx(single[key], rel=1e-5), key
    assert parallel["tokens_seen"] == single["tokens_seen"]
    rows_one = (one_process / "reports/train_log.tsv").read_text().splitlines()
    rows_two = (tmp_path / "two/reports/train_log.tsv").read_text().splitlines()
    assert len(rows_one) == len(rows_two) > 3
    rank1 = json.loads((tmp_path / "two/rank1").read_text())
    assert (
        rank1["val_subset_loss"] == parallel["val_subset_loss"]
    )  # every rank ends with the reduced metrics


def test_rows_split_the_global_batch_evenly() -> None:
    env = d.DistEnv(rank=1, world_size=4, local_rank=1)
    assert env.rows(8) == slice(2, 4) and not env.is_main and env.enabled
    assert d.DistEnv().rows(8) == slice(0, 8)


def test_uneven_batches_and_micro_batches_are_refused() -> None:
    env = d.DistEnv(0, 3, 0)
    with pytest.raises(ConfigError, match="train.batch_size=8 must be a multiple"):
        d.check_world(hope.load_config(None, ["train.batch_size=8"]), env)
    cfg = hope.load_config(None, ["train.batch_size=6", "train.micro_batch_size=3"])
    with pytest.raises(ConfigError, match="train.micro_batch_size=3 exceeds the 2 rows"):
        d.check_world(cfg, env)


@pytest.mark.parametrize(
    "knobs",
    [["optim.name=muon"], ["optim.name=m3", "model.final_norm=true"], ["train.nan_policy=skip"]],
)
def test_what_fsdp_cannot_keep_is_refused_naming_the_knob(knobs: list[str]) -> None:
    with pytest.raises(ConfigError, match=re.escape(knobs[0])):
        hope.load_config(None, ["train.parallel=fsdp", *knobs])
    hope.load_config(None, ["train.parallel=ddp", *knobs])  # DDP keeps it


@pytest.mark.parametrize(
    "knobs, named",
    [
        (["train.parallel=ddp", "train.precision=bf16"], "train.parallel=fsdp (got ddp)"),
        (["train.parallel=fsdp", "train.precision=fp32"], "train.precision=bf16 (got fp32;"),
    ],
)
def test_bf16_blocks_need_fsdp_and_bf16_autocast(knobs: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        hope.load_config(None, ["train.fsdp_param_dtype=bf16", *knobs])
    hope.load_config(
        None, ["train.fsdp_param_dtype=bf16", "train.parallel=fsdp", "train.precision=bf16"]
    )


def test_the_stage_relaunches_itself_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = hope.load_config(None, ["train.nproc_per_node=2"])
    command = launch.relaunch_command(cfg, ["stages/train.py", "--set", "train.nproc_per_node=2"])
    assert command is not None
    assert command[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    assert command[-3:] == ["stages/train.py", "--set", "train.nproc_per_node=2"]
    assert launch.relaunch_command(hope.load_config(None, []), ["x"]) is None
    # already under torchrun: join, do not relaunch
    assert launch.relaunch_command(cfg, ["x"], {"WORLD_SIZE": "2"}) is None


FAKE_SLURM = ROOT / "tests" / "fake_slurm"


def test_several_nodes_meet_at_the_first_node_of_the_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """train.nnodes=2: torchrun with a c10d rendezvous on the allocation's first node
    (scontrol expands the node list), keyed by the job id; HOPE_RDZV_ENDPOINT wins;
    with neither, the error says what to set."""
    monkeypatch.setenv("PATH", f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("FAKE_SLURM_STATE", str(tmp_path / "state"))
    cfg = hope.load_config(None, ["train.nnodes=2", "train.nproc_per_node=4"])
    job = {"SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "gpu07,gpu08"}
    command = launch.relaunch_command(cfg, ["stages/train.py"], job)
    assert command is not None and command[-1] == "stages/train.py"
    assert command[3:8] == [
        "--nproc_per_node=4", "--nnodes=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu07:29821", "--rdzv_id=4321",
    ]  # fmt: skip
    assert launch.rendezvous(2, {**job, "HOPE_RDZV_PORT": "6000"}) == ("gpu07:6000", "4321")
    assert launch.rendezvous(2, {**job, "HOPE_RDZV_ENDPOINT": "head:1234"}) == (
        "head:1234",
        "4321",
    )
    with pytest.raises(ConfigError, match="HOPE_RDZV_ENDPOINT"):
        launch.relaunch_command(cfg, ["x"], {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with pytest.raises(ConfigError, match="scontrol show hostnames"):
        launch.rendezvous(2, job)


def test_the_train_rule_asks_slurm_for_params_nodes_and_gpus() -> None:
    def resources(*sets: str) -> tuple[dict[str, int | str], str]:
        cfg = hope.load_config(None, list(sets))
        return launch.slurm_resources(cfg), launch.srun_prefix(cfg)

    assert resources() == ({}, "")  # tiny: one CPU process
    assert resources("train.device=cuda") == ({"gpu": 1}, "")
    assert resources("train.device=auto", "train.nproc_per_node=8") == ({"gpu": 8}, "")
    two_nodes = {"nodes": 2, "tasks": 2, "mpi": "srun", "tasks_per_gpu": 0}
    assert resources("train.device=cuda", "train.nproc_per_node=8", "train.nnodes=2") == (
        {**two_nodes, "gres": "gpu:8"},
        "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 ",
    )
    assert resources("train.nnodes=2")[0] == two_nodes
    # The evaluation rules: one process on train.device.
    assert launch.eval_resources(hope.load_config(None)) == {}
    assert launch.eval_resources(hope.load_config(None, ["train.device=cuda"])) == {"gpu": 1}
    assert launch.eval_resources(hope.load_config(None, ["train.device=auto"])) == {"gpu": 1}


LONG = ("train.steps=30", "train.checkpoint_every=5", "train.keep_checkpoints=20")


def _kill_all(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker``, and wait for them."""
    import signal
    import time

    def holders() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    for pid in holders():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while holders() and time.monotonic() < deadline:
        time.sleep(0.05)


def _metrics(out: Path) -> dict[str, float]:
    return json.loads((out / "reports/train.json").read_text())


@pytest.mark.slow
def test_a_killed_fsdp_run_resumes_on_one_process_and_back(tmp_path: Path) -> None:
    """Two FSDP2 ranks killed mid-run resume on one process (checkpoint layout by name
    -> by index), and a one-process checkpoint resumes on two FSDP2 ranks (by index ->
    by name): both end with the metrics of an uninterrupted run."""
    import shutil
    import time

    whole = _run_worker(tmp_path / "whole", 1, *LONG)
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = _metrics(tmp_path / "whole")

    out = tmp_path / "killed"
    out.mkdir()
    script = out / "worker.py"
    extra = (*LONG, "train.parallel=fsdp")
    script.write_text(WORKER.format(tests=str(ROOT / "tests"), out=str(out), extra=extra,
                                    rank_file=False))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(script)]  # fmt: skip
    log = out / "torchrun.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=sink,
                                stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 300
        while not (out / "ckpt/step_0000010.pt").exists() and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        _kill_all(str(script))  # torchrun and its workers (their own sessions), as a scheduler
        proc.wait()
    reached = (out / "ckpt/step_0000010.pt").exists()
    assert reached, f"no checkpoint at step 10 (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
    assert not (out / "ckpt/step_0000030.pt").exists(), "the run ended before the kill"
    # A resume continues from the newest checkpoint and never rewrites it (a fresh
    # start would: same numbers, new file).
    newest = sorted((out / "ckpt").glob("step_*.pt"))[-1]
    inode = newest.stat().st_ino
    resumed = _run_worker(out, 1, *LONG)  # train.parallel=ddp: one plain process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert newest.stat().st_ino == inode
    for key in ("train_loss", "val_subset_loss"):
        assert _metrics(out)[key] == pytest.approx(reference[key], rel=1e-5), key

    back = tmp_path / "back"
    shutil.copytree(tmp_path / "whole/ckpt", back / "ckpt")
    for late in sorted((back / "ckpt").glob("step_*"))[:]:
        if int(late.name[5:12]) > 15:
            late.unlink()
    inode = (back / "ckpt/step_0000015.pt").stat().st_ino
    two = _run_worker(back, 2, *LONG, "train.parallel=fsdp")
    assert two.returncode == 0, two.stderr[-3000:]
    assert (back / "ckpt/step_0000015.pt").stat().st_ino == inode
    for key in ("train_loss", "val_subset_loss"):
        assert _metrics(back)[key] == pytest.approx(reference[key], rel=1e-5), key

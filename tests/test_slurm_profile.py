"""`snakemake --profile configs/slurm` end to end, against stand-in SLURM commands.

tests/fake_slurm/ holds small sbatch, sacct, squeue, scontrol, sinfo, srun and
scancel scripts. sbatch logs its argv, runs the `--wrap` payload in the
background and prints the job id (`--parsable`); sacct reports each job's real
final state from its exit code. So the real executor plugin builds, submits and
polls every job, and the jobstep plugin runs each rule through srun, as on a
cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, copy_repo, pipeline_env, run, set_params
from hope.config import load_config
from hope.train.launch import eval_resources, slurm_resources

FAKE_SLURM = ROOT / "tests" / "fake_slurm"
PROFILE = ROOT / "configs" / "slurm" / "config.yaml"
# The README command, plus two test-only knobs: the plugin waits 40 s before its
# first status check and 10 s between checks, which would make seven dependent
# jobs spend minutes waiting.
COMMAND = [
    "snakemake",
    "--profile",
    "configs/slurm",
    "--slurm-init-seconds-before-status-checks",
    "1",
    "--seconds-between-status-checks",
    "1",
]
TIMEOUT_S = 420  # 12 jobs, 4 of them evaluations, side by side on 2 cores

SMALL_RUN = {
    ("train", "steps"): 4,
    ("train", "batch_size"): 2,
    ("train", "val_every"): 2,
    ("train", "checkpoint_every"): 2,
    ("train", "wandb_mode"): "disabled",
    ("tokenizer", "vocab_size"): 512,
    ("eval", "max_batches"): 2,
    ("eval", "passkey_trials"): 2,
    ("bench", "variants"): ["transformer"],
    ("bench", "shapes"): ["tiny"],
    ("bench", "warmup"): 0,
    ("bench", "steps"): 1,
    # The stand-in cluster runs its jobs side by side on this machine's cores: one
    # torch thread per job (spinning OpenMP threads of parallel jobs would thrash),
    # and two for the tokenizer rules, so --cpus-per-task is seen to follow params.
    ("train", "num_threads"): 1,
    ("bench", "num_threads"): 1,
    ("bench", "project_presets"): [],
    ("tokenizer", "num_threads"): 2,
    ("recall", "variants"): ["transformer"],
    ("recall", "steps"): 2,
    ("recall", "batch_size"): 2,
    ("recall", "eval_sequences"): 4,
    ("recall", "num_threads"): 1,
    # The evaluation stages, each at its smallest meaningful size.
    ("zeroshot", "items"): 8,
    ("niah", "tasks"): ["s_niah_1"],
    ("niah", "lengths"): [160],
    ("niah", "depths"): [0.5],
    ("niah", "trials"): 1,
    ("longctx", "length"): 256,
    ("longctx", "sequences"): 1,
    ("continual", "segments"): ["json", "csv"],
    ("continual", "write_tokens"): 64,
    ("continual", "probe_tokens"): 16,
}


def _submitted_rules() -> list[str]:
    """Every rule of the Snakefile with a command; `all` only gathers targets."""
    rules = re.findall(r"^rule (\w+):", (ROOT / "Snakefile").read_text(), flags=re.M)
    return [rule for rule in rules if rule != "all"]


def _expected_resources(rule: str, repo: Path) -> dict[str, object]:
    """The profile's resources for ``rule``; its CPUs are the rule's threads from params."""
    profile = yaml.safe_load(PROFILE.read_text())
    resources = dict(profile["default-resources"])
    resources.update(profile.get("set-resources", {}).get(rule, {}))
    assert "cpus_per_task" not in resources, "CPUs must follow the params' thread counts"
    cfg = load_config(repo / "params.yaml")
    assert "gpu" not in resources and "nodes" not in resources  # from params, not here
    if rule == "train":
        resources.update(slurm_resources(cfg))
    elif rule in ("eval", "zeroshot", "niah", "longctx", "continual", "recall"):
        resources.update(eval_resources(cfg))
    threads = {
        "tokenizer": cfg.tokenizer.num_threads,
        "shard": cfg.tokenizer.num_threads,
        "train": cfg.train.num_threads * cfg.train.nproc_per_node,
        "eval": cfg.train.num_threads,
        "bench": cfg.bench.num_threads,
        "recall": cfg.recall.num_threads,
    }
    resources["cpus_per_task"] = threads.get(rule, 1)
    return resources


def _options(argv: list[str]) -> dict[str, str]:
    """sbatch/srun options as a dict: `--k v`, `--k=v` and `-k v` forms; flags map to ''."""
    options: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            options[key] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            options[arg] = argv[i + 1]
            i += 1
        else:
            options[arg] = ""
        i += 1
    return options


def _step(argv: list[str]) -> tuple[str, dict[str, str]]:
    """An srun call as (rule of the step's snakemake command, srun's own options)."""
    command_at = next(i for i, arg in enumerate(argv) if not arg.startswith("-"))
    return argv[argv.index("--allowed-rules") + 1], _options(argv[:command_at])


def _calls(log: Path, command: str) -> list[list[str]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [shlex.split(line)[1:] for line in lines if line.split(" ", 1)[0] == command]


def _stop_leftover_jobs(state: Path) -> None:
    """End the sessions of fake jobs still running (only after a failed or timed-out run)."""
    for file in state.glob("*.state"):
        _name, status, pid = file.read_text().strip().split("|")
        if status == "RUNNING" and pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)


def _run_snakemake(
    repo: Path, log: Path, state: Path, *targets: str
) -> subprocess.CompletedProcess[str]:
    env = pipeline_env(repo)
    env.update(
        PATH=f"{FAKE_SLURM}{os.pathsep}{env['PATH']}",
        FAKE_SLURM_LOG=str(log),
        FAKE_SLURM_STATE=str(state),
        FAKE_SLURM_WAIT_S="40",  # status queries as long polls (fake_slurm/sacct)
        OMP_NUM_THREADS="1",
    )
    # No stray allocation of an outer job may leak into the fake one.
    for var in [v for v in env if v.startswith("SLURM_")]:
        del env[var]
    proc = subprocess.Popen(
        [*COMMAND, *targets],
        cwd=repo,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        _stop_leftover_jobs(state)
        raise AssertionError(f"snakemake timed out after {TIMEOUT_S}s\n{out[-6000:]}") from None
    if proc.returncode != 0:
        _stop_leftover_jobs(state)
        job_logs = "\n".join(
            f"--- {p}\n{p.read_text()[-2000:]}" for p in (repo / ".snakemake").rglob("*.log")
        )
        raise AssertionError(
            f"snakemake exited {proc.returncode}\n{out[-6000:]}\n{job_logs[-6000:]}"
        )
    return subprocess.CompletedProcess(COMMAND, proc.returncode, out, "")


@pytest.mark.parametrize(("exit_code", "final_state"), [(0, "COMPLETED"), (3, "FAILED")])
def test_fake_sbatch_reports_the_job_exit_code(
    tmp_path: Path, exit_code: int, final_state: str
) -> None:
    """The stand-ins themselves: a job's exit code becomes its sacct state."""
    env = dict(
        os.environ,
        PATH=f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_LOG=str(tmp_path / "log"),
        FAKE_SLURM_STATE=str(tmp_path / "state"),
    )
    submit = ["sbatch", "--parsable", "--job-name", "run-1", "--output", str(tmp_path / "%j.log")]
    submit += ["-D", str(tmp_path), f"--wrap=echo in job $SLURM_JOB_ID; exit {exit_code}"]
    jobid = subprocess.run(submit, env=env, capture_output=True, text=True, check=True).stdout
    query = ["sacct", "-X", "--parsable2", "--noheader", "--name", "run-1"]
    for _ in range(100):
        answer = subprocess.run(query, env=env, capture_output=True, text=True, check=True)
        if answer.stdout.strip().split("|")[-1] in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.05)
    assert answer.stdout == f"{jobid.strip()}|{final_state}\n"
    assert (tmp_path / f"{jobid.strip()}.log").read_text() == f"in job {jobid}"
    rejected = subprocess.run(["sbatch", "--gpus-per-node=1"], env=env, capture_output=True)
    assert rejected.returncode == 1 and b"unrecognized option" in rejected.stderr


@pytest.mark.slow
def test_slurm_profile_runs_pipeline_through_sbatch(tmp_path: Path) -> None:
    """The whole DAG through the profile, training on two nodes (train.nnodes=2; the
    README's multi-node command, then its plain one for the rest): every rule is one
    job with the profile's and the params' resources, run through srun inside its job;
    the train job spans 2 nodes with one task each, the rule's own srun starts the
    stage once per node, each copy starts torchrun with its local rank and they meet
    at the first node (`scontrol show hostnames`). The 2 ranks train what one process
    trains on the same global batch, and the evaluations run on what they trained."""
    repo = copy_repo(tmp_path / "repo")
    set_params(repo, {**SMALL_RUN, ("train", "nnodes"): 2})
    log, state = tmp_path / "fake_slurm.log", tmp_path / "fake_slurm_state"
    # The README's two commands: training alone, then the rest of the DAG on top of it.
    print(_run_snakemake(repo, log, state, "reports/train.json").stdout[-3000:])
    first = [_options(argv)["--comment"] for argv in _calls(log, "sbatch")]
    assert sorted(first) == ["rule_download", "rule_shard", "rule_tokenizer", "rule_train"]
    print(_run_snakemake(repo, log, state).stdout[-3000:])

    assert (repo / "release" / "MANIFEST").is_file()
    assert (repo / "reports" / "eval.json").is_file()

    sbatch = [_options(argv) for argv in _calls(log, "sbatch")]
    # The submissions without their long --wrap payload, for the test log.
    print(
        "\n".join(
            shlex.join(a for a in argv if not a.startswith("--wrap="))
            for argv in _calls(log, "sbatch")
        )
    )
    by_rule: dict[str, list[dict[str, str]]] = {}
    for options in sbatch:
        by_rule.setdefault(options["--comment"].removeprefix("rule_"), []).append(options)
    rules = _submitted_rules()
    assert sorted(by_rule) == sorted(rules)
    assert all(len(submissions) == 1 for submissions in by_rule.values()), by_rule

    # All jobs of one run share the run id as job name; the two runs have two.
    run_ids = [options["--job-name"] for options in sbatch]
    assert len(set(run_ids[: len(first)])) == len(set(run_ids[len(first) :])) == 1, run_ids
    assert len(set(run_ids)) == 2, run_ids
    for rule in rules:
        options, expected = by_rule[rule][0], _expected_resources(rule, repo)
        assert "--parsable" in options and options["-D"] == str(repo), rule
        assert options["-p"] == str(expected["slurm_partition"]), rule
        assert options["-t"] == str(expected["runtime"]), rule
        assert options["--mem"] == str(expected["mem_mb"]), rule
        assert options["--cpus-per-task"] == str(expected["cpus_per_task"]), rule
        gpu = expected.get("gpu")
        assert options.get("--gpus") == (str(gpu) if gpu else None), rule
        assert "--gres" not in options, rule
    # The tiny preset runs on the CPU (train.device=cpu): no job holds a GPU.
    assert not any("--gpus" in jobs[0] for jobs in by_rule.values())
    for cpu_rule in ("download", "tokenizer", "shard"):
        assert "--gpus" not in by_rule[cpu_rule][0]
    # Training: one job over 2 nodes with one task each, no GPU option on a CPU.
    train_job = by_rule["train"][0]
    assert train_job["--nodes"] == "2" and train_job["--ntasks"] == "2", train_job
    assert "--ntasks-per-gpu" not in train_job
    assert all("--nodes" not in jobs[0] for rule, jobs in by_rule.items() if rule != "train")

    # Inside each job the jobstep plugin ran its rule through srun with the same CPUs
    # and GPUs; the step's command names the rule with --allowed-rules. The train
    # rule's own srun starts the stage once per node; the copies meet at the first.
    sruns = _calls(log, "srun")
    launches = [argv for argv in sruns if "--ntasks-per-node=1" in argv]
    assert len(launches) == 1 and "--nodes=2" in launches[0], launches
    assert launches[0][-2:] == ["python", "stages/train.py"], launches
    assert ["show", "hostnames", "127.0.0.1,127.0.0.2"] in _calls(log, "scontrol")
    # (No jobstep wraps the multi-node rule: its job runs that srun itself.)
    steps = dict(_step(argv) for argv in sruns if "--allowed-rules" in argv)
    assert sorted(steps) == sorted(rule for rule in rules if rule != "train")
    for rule in steps:
        expected = _expected_resources(rule, repo)
        assert steps[rule]["--cpus-per-task"] == str(expected["cpus_per_task"]), rule
        gpu = expected.get("gpu")
        assert steps[rule].get("--gpus") == (str(gpu) if gpu else None), rule
    # Status came from sacct, filtered by the run id, and every job reached COMPLETED.
    polls = _calls(log, "sacct")
    assert any(argv[argv.index("--name") + 1] in run_ids for argv in polls if "--name" in argv)
    states = [f.read_text().split("|")[1] for f in state.glob("*.state")]
    assert states == ["COMPLETED"] * len(rules)

    meta = json.loads((repo / "reports/train_meta.json").read_text())
    assert meta["runtime"]["world_size"] == 2
    single = tmp_path / "single"
    shutil.copytree(repo, single, ignore=shutil.ignore_patterns("models", "reports", ".snakemake"))
    run([sys.executable, "stages/train.py", "--set", "train.nnodes=1"], single)
    ours = json.loads((repo / "reports/train.json").read_text())
    one = json.loads((single / "reports/train.json").read_text())
    assert ours["tokens_seen"] == one["tokens_seen"]
    for key in ("train_loss", "val_subset_loss"):
        assert ours[key] == pytest.approx(one[key], rel=1e-5), key

"""The speed benchmark: one full training step per variant at fixed shapes.

For every variant in ``bench.variants`` and every shape in ``bench.shapes`` the
bench builds the model, a real AdamW (``build_optimizer`` with the default
``OptimConfig``, so optimizer knobs cannot change the benchmark) and the
warmup/cosine schedule, runs ``bench.warmup`` untimed and ``bench.steps`` timed
``train_step`` calls on seeded random tokens, then one more step with the host-sync
counters on. Each (shape, variant) runs in a fresh process so its peak memory is
its own (see :mod:`hope.bench.measure`), forked from a server that imported torch
once (``fresh_processes``).

Shapes: :mod:`hope.bench.shapes` (tiny, smoke, pilot_chunks, pilot_frozen, pilot).

Every row also counts the kernel launches of one step (``launches_per_step``, see
:mod:`hope.bench.measure`): the host cost a GPU pays per step whatever its batch.
``projection`` holds, for each ``bench.project_presets`` entry and variant, the
projected GPU step time and MFU on H200/H100/A100 (:mod:`hope.bench.projection`).

Variants not in ``hope.VARIANTS`` and measurements that fail are
recorded under ``skipped`` with the reason; the bench itself does not fail.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, TypeVar

import torch

from hope.bench import flops, projection
from hope.bench import measure as m
from hope.bench.report_files import STEP_TABLE, split_report, write_step_table
from hope.bench.shapes import apply_read_forms, bench_shape
from hope.config import BenchConfig, Config, OptimConfig, TrainConfig, config_from_dict
from hope.errors import ConfigError
from hope.io import write_metrics
from hope.memory.ops.dispatch import default_backend
from hope.model.zoo import build_model
from hope.optim.outer import build_optimizer
from hope.report import headline
from hope.report.environment import collect_environment
from hope.train.device import autocast_dtype, resolve_device, setup_runtime
from hope.train.graphed import WARMUP_STEPS, CapturedStep
from hope.train.schedule import build_scheduler
from hope.train.step import train_step

log = logging.getLogger("hope.bench")
_Row = TypeVar("_Row")


def check_bench_config(bench: BenchConfig) -> None:
    graph_ok = not bench.cuda_graph or resolve_device(bench.device).type == "cuda"
    checks = [
        (graph_ok, f"bench.cuda_graph=true needs a CUDA device; bench.device={bench.device}"),
        (
            not bench.cuda_graph or bench.warmup > WARMUP_STEPS,
            f"bench.cuda_graph=true: bench.warmup={bench.warmup} must exceed the "
            f"{WARMUP_STEPS} eager warm-up steps, so the capture is not timed",
        ),
        (bench.steps >= 1, f"bench.steps must be >= 1, got {bench.steps}"),
        (bench.warmup >= 0, f"bench.warmup must be >= 0, got {bench.warmup}"),
        (bench.batch_size >= 1, f"bench.batch_size must be >= 1, got {bench.batch_size}"),
        (len(set(bench.shapes)) == len(bench.shapes), f"bench.shapes repeats: {bench.shapes}"),
        (
            len(set(bench.variants)) == len(bench.variants),
            f"bench.variants repeats: {bench.variants}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _batches(
    vocab: int, batch: int, seq_len: int, count: int, seed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` seeded (x, y) pairs of random tokens [B, T], y shifted by one."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        pairs.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return pairs


def measure_variant(cfg: Config, variant: str, shape_name: str) -> dict[str, Any]:
    """Measure one (shape, variant) in this process; the row of ``reports/bench.json``."""
    bench = cfg.bench
    device = resolve_device(bench.device)
    # Deterministic kernels cost nothing on CPU; on CUDA the bench times the fast ones
    # a paper-scale run would use (the paper presets set train.deterministic: false).
    runtime = TrainConfig(
        seed=bench.seed,
        num_threads=bench.num_threads,
        memory_backend=bench.memory_backend,
        precision=bench.precision,
        deterministic=device.type == "cpu",
    )
    setup_runtime(runtime, device, "bench")
    if bench.memory_backend == "compile" and device.type == "cpu":
        m.enable_cpu_kernel_events()  # before the first compile: its kernels are counted
    amp_dtype = autocast_dtype(device, bench.precision)
    shape = bench_shape(cfg, shape_name)
    model_cfg = dataclasses.replace(shape.model, variant=variant)  # type: ignore[arg-type]
    assert model_cfg.vocab_size is not None
    total = bench.warmup + bench.steps + 2  # + the launch- and sync-counting steps
    batches = _batches(
        model_cfg.vocab_size, shape.batch_size, shape.seq_len, total, bench.seed, device
    )

    baseline_mb = m.baseline_memory_mb(device)
    m.reset_peak_memory(device)
    model = build_model(model_cfg).to(device)
    if shape.cms_read_forms is not None:
        apply_read_forms(model, shape.cms_read_forms)
    model.train()
    optim_cfg = OptimConfig()
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, total)

    def eager(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return train_step(model, optimizer, None, x, y, optim_cfg.grad_clip, amp_dtype)

    run = eager
    if bench.cuda_graph:
        run = CapturedStep(eager, optimizer, device, knob="bench.cuda_graph")

    def step(i: int) -> torch.Tensor:
        loss = run(*batches[i])
        scheduler.step()  # outside the step: a captured step replays it
        return loss

    seconds = m.time_steps(step, bench.warmup, bench.steps, device)
    # On CUDA the profiler counts the kernels of every backend; on a CPU the dispatch
    # counter sees eager ops only, so compiled regions are counted from the profiler.
    launches: m.LaunchCounter | m.CudaKernelCounter | m.ProfiledLaunchCounter
    launches = m.LaunchCounter()
    if device.type == "cuda":
        launches = m.CudaKernelCounter()
    elif bench.memory_backend == "compile":
        launches = m.ProfiledLaunchCounter()
    with launches:
        step(total - 2)  # launches of one step, apart from the sync count (profiler syncs)
    with m.count_host_syncs() as calls:
        loss = step(total - 1)
    syncs = len(calls)
    m.synchronize(device)
    peak_mb = m.peak_memory_mb(device)
    loss_value = float(loss)
    if not math.isfinite(loss_value):
        raise RuntimeError(f"{variant} at shape {shape_name}: non-finite loss {loss_value}")

    step_s = m.median(seconds)
    tokens_per_s = shape.batch_size * shape.seq_len / step_s
    flops_per_token = flops.training_flops_per_token(model_cfg, shape.seq_len)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak_flops = flops.peak_bf16_flops(gpu)
    return {
        "tokens_per_s": tokens_per_s,
        "step_ms": step_s * 1e3,
        "step_ms_min": min(seconds) * 1e3,
        "peak_mem_mb": peak_mb,
        "mem_baseline_mb": baseline_mb,
        "host_syncs_per_step": syncs,
        "launches_per_step": launches.count,
        "params": model.num_parameters(),
        "flops_per_token": flops_per_token,
        "achieved_gflops_per_s": flops_per_token * tokens_per_s / 1e9,
        "mfu": None if peak_flops is None else flops_per_token * tokens_per_s / peak_flops,
        "loss": loss_value,
        "torch_threads": torch.get_num_threads(),
        "precision": "fp32" if amp_dtype is None else str(amp_dtype).removeprefix("torch."),
    }


def fresh_processes() -> BaseContext:
    """Processes forked from a server that has imported torch and the bench once and run
    nothing: each starts clean (own peak RSS, allocator and thread pools, as a new
    interpreter) without paying the ~3 s of imports a new interpreter would."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["hope.bench.run"])
    return context


def _measure_job(config: dict[str, Any], variant: str, shape_name: str) -> dict[str, Any]:
    return measure_variant(config_from_dict(config), variant, shape_name)


def measure_isolated(cfg: Config, variant: str, shape_name: str) -> dict[str, Any]:
    """``measure_variant`` in a fresh process (``fresh_processes``); its exception, or
    ``BrokenProcessPool`` when it dies, is raised here."""
    with ProcessPoolExecutor(1, mp_context=fresh_processes(), max_tasks_per_child=1) as pool:
        return pool.submit(_measure_job, cfg.to_dict(), variant, shape_name).result()


def add_relative(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's speed relative to the transformer's in the same run and shape."""
    base = rows.get("transformer")
    for row in rows.values():
        row["relative_to_transformer"] = (
            row["tokens_per_s"] / base["tokens_per_s"] if base else None
        )
        row["step_time_ratio_vs_transformer"] = row["step_ms"] / base["step_ms"] if base else None


def machine_info(cfg: Config) -> dict[str, Any]:
    device = resolve_device(cfg.bench.device)
    env = collect_environment(str(device))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "cpu": env["cpu"],
        "logical_cores": os.cpu_count(),
        "usable_cores": env["cpu_count"],
        "torch_threads": None,  # filled in from the measuring processes
        "device": env["device"],
        "gpu": gpu,
        "peak_bf16_flops": flops.peak_bf16_flops(gpu),
        "torch": env["torch"],
        "cuda": env["cuda"],
        "python": env["python"],
        "platform": env["platform"],
        "hope": env["hope"],
        "git_commit": env["git_commit"],
    }


def run_bench(cfg: Config, out_path: Path, *, isolate: bool = True) -> dict[str, Any]:
    """Measure every (shape, variant), write ``out_path`` atomically, return the report.

    ``isolate=True``: each measurement in a fresh process (``measure_isolated``), the
    projection's counts in ``bench.num_threads`` processes side by side, after the
    timed measurements. ``isolate=False`` measures and projects in this process
    (tests: patched methods and test-registered variants are visible; peak memory is
    then the process's).
    """
    from hope.model.zoo import VARIANTS

    bench = cfg.bench
    check_bench_config(bench)
    started = time.perf_counter()
    report: dict[str, Any] = {"machine": machine_info(cfg)}
    skipped: dict[str, dict[str, str]] = {}
    shapes = {name: bench_shape(cfg, name) for name in bench.shapes}
    for name in shapes:
        rows: dict[str, dict[str, Any]] = {}
        for variant in bench.variants:
            reason = _measure_into(rows, cfg, variant, name, VARIANTS, isolate)
            if reason is not None:
                skipped.setdefault(name, {})[variant] = reason
                log.warning("bench %s/%s skipped: %s", name, variant, reason)
        add_relative(rows)
        threads = [row.pop("torch_threads") for row in rows.values()]
        if threads and report["machine"]["torch_threads"] is None:
            report["machine"]["torch_threads"] = threads[0]
        report[name] = rows
    workers = max(1, bench.num_threads) if isolate else 1
    report["projection"] = _project(cfg, VARIANTS, skipped, workers)
    report["skipped"] = skipped
    report["config"] = {
        **dataclasses.asdict(bench),
        "optimizer": "adamw (default OptimConfig)",
        "shapes_used": {name: shape.record() for name, shape in shapes.items()},
    }
    report["wall_s"] = time.perf_counter() - started
    metrics, meta = split_report(report)
    write_metrics(Path(out_path), metrics, meta, headline.bench(metrics, bench.shapes[0]))
    write_step_table(Path(out_path).with_name(STEP_TABLE), metrics, bench.shapes)
    return report


def _project(
    cfg: Config,
    registered: Sequence[str],
    skipped: dict[str, dict[str, str]],
    workers: int = 1,
) -> dict[str, Any]:
    """``bench.project_presets`` x ``bench.variants``: projected GPU steps (launch
    counts on this CPU, see :mod:`hope.bench.projection`); failures go to skipped.
    ``workers`` > 1: the (preset, variant) projections run in that many fresh
    single-threaded processes (counting is host-bound and deterministic: running side
    by side changes no count); 1: here, one after another."""
    # The launches of the bench's memory backend where the dispatch count sees what a
    # GPU runs (torch, fused); compiled and FLA steps are projected as torch.
    backend = cfg.bench.memory_backend if cfg.bench.memory_backend == "fused" else "torch"
    jobs = [
        (preset, variant)
        for preset in cfg.bench.project_presets
        for variant in cfg.bench.variants
        if variant in registered
    ]
    tasks = counting_tasks(jobs)
    if workers > 1 and len(tasks) > 1:
        processes = min(workers, len(tasks))
        context = fresh_processes()
        with ProcessPoolExecutor(processes, context, torch.set_num_threads, (1,)) as pool:
            futures = [pool.submit(_project_jobs, task, backend) for task in tasks]
            done: dict[tuple[str, str], dict[str, Any] | str] = {}
            for task, future in zip(tasks, futures, strict=True):
                rows_or_reason = _outcome(future.result)  # a worker that died: its reason
                if isinstance(rows_or_reason, str):
                    done |= {job: rows_or_reason for job in task}
                else:
                    done |= rows_or_reason
    else:
        done = {job: row for task in tasks for job, row in _project_jobs(task, backend).items()}
    rows = {job: done[job] for job in jobs}  # the configured order
    presets: dict[str, dict[str, Any]] = {preset: {} for preset in cfg.bench.project_presets}
    for (preset, variant), row in rows.items():
        if isinstance(row, str):
            skipped.setdefault(f"projection/{preset}", {})[variant] = row
        else:
            presets[preset][variant] = row
    return {"constants": projection.constants(), "memory_backend": backend, "presets": presets}


def counting_tasks(jobs: Sequence[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The (preset, variant) projections as the tasks the workers run, longest counting
    context first (so no long count starts last). Jobs whose counts coincide (mid and
    target share their narrow models) form one task, run one after the other, so the
    second reads the first's counts from the process's cache instead of recounting
    them in another worker (the bench stage's projection: 175 -> 106 s on 2 cores)."""
    groups: dict[object, list[tuple[str, str]]] = {}
    for job in jobs:
        groups.setdefault(_counting_group(job), []).append(job)
    return sorted(groups.values(), key=lambda task: _counting_cost(task[0]), reverse=True)


def _counting_group(job: tuple[str, str]) -> object:
    """What the counts of a (preset, variant) projection depend on; the job itself when
    its preset does not load (it then runs on its own and reports why)."""
    try:
        return projection.counting_group(*job)
    except ConfigError:
        return job


def _counting_cost(job: tuple[str, str]) -> float:
    try:
        cfg = projection.preset_model(*job)
        return projection.counting_lengths(cfg, projection.preset_seq_len(job[0]))[1]
    except ConfigError:  # a bad preset: its job runs (first) and reports why
        return math.inf


def _project_jobs(
    jobs: list[tuple[str, str]], backend: str
) -> dict[tuple[str, str], dict[str, Any] | str]:
    """Each (preset, variant) projection counted under ``backend`` (the process's
    default backend restored after): its row, or why it failed."""
    with default_backend(backend):
        return {job: _outcome(functools.partial(projection.project_variant, *job)) for job in jobs}


def _outcome(run: Callable[[], _Row]) -> _Row | str:
    """``run()``'s row(s), or the reason it failed (the other projections are kept)."""
    try:
        return run()
    except Exception as err:  # noqa: BLE001 - keep the other projections
        return f"{type(err).__name__}: {err}"


def _measure_into(
    rows: dict[str, dict[str, Any]],
    cfg: Config,
    variant: str,
    shape: str,
    registered: Sequence[str],
    isolate: bool,
) -> str | None:
    """Measure into ``rows[variant]``; the reason when it is skipped, else None."""
    if variant not in registered:
        return f"variant {variant!r} is not registered (available: {', '.join(registered)})"
    try:
        measure = measure_isolated if isolate else measure_variant
        rows[variant] = measure(cfg, variant, shape)
    except Exception as err:  # noqa: BLE001 - one bad variant must not lose the others' numbers
        return f"{type(err).__name__}: {err}"
    log.info(
        "bench %s/%s: %.0f tokens/s, %.1f ms/step, %d host syncs/step, %s launches/step",
        shape, variant, rows[variant]["tokens_per_s"], rows[variant]["step_ms"],
        rows[variant]["host_syncs_per_step"], rows[variant]["launches_per_step"],
    )  # fmt: skip
    return None

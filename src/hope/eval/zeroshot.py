"""The ``zeroshot`` stage's body: lm-eval tasks on the latest checkpoint.

Offline tasks (``hope_*``, YAMLs in ``configs/lm_eval``) get their items written
first from the run's validation texts (hope.eval.zeroshot_items); any other name is an
lm-eval task (the paper presets name the paper's Table 1 tasks), whose data lm-eval
fetches from the HuggingFace hub. Names are checked against lm-eval's task index
before the model is loaded. Scoring: hope.eval.harness (teach path, fresh context per
request).

The report: ``metrics`` (task -> metric -> number, with lm-eval's stderr beside each
metric as ``<metric>_stderr`` and the scored document count ``n``) and ``records``
(lm-eval version, task versions, checkpoint, variant).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hope.config import Config
from hope.data.download import iter_jsonl_texts
from hope.errors import ConfigError, StageError
from hope.eval.zeroshot_items import TASKS as OFFLINE_TASKS
from hope.eval.zeroshot_items import write_items

log = logging.getLogger("hope.eval")


def task_manager(tasks: list[str], include_path: Path) -> Any:
    """lm-eval's task index with ours included; lm-eval's own ~15k task configs are
    indexed (~12 s) only when a task outside ours is asked for."""
    from lm_eval.tasks import TaskManager

    offline_only = all(task in OFFLINE_TASKS for task in tasks)
    return TaskManager(include_path=str(include_path), include_defaults=not offline_only)


def check_tasks(tasks: list[str], manager: Any) -> None:
    """Every name is a task (or group) lm-eval knows."""
    known = set(manager.all_tasks)
    unknown = [task for task in tasks if task not in known]
    if unknown:
        raise ConfigError(
            f"zeroshot.tasks: unknown lm-eval task {unknown[0]!r} (offline tasks: "
            f"{', '.join(OFFLINE_TASKS)}; others: `lm-eval ls tasks`)"
        )


def flatten_results(results: dict[str, Any], n_samples: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``{"acc,none": x, "acc_stderr,none": s, "alias": ...}`` per task as
    numbers only: ``{"acc": x, "acc_stderr": s, "n": documents}`` (a filter other than
    ``none`` stays in the name, ``acc/flexible``); "N/A" stderrs are left out."""
    table: dict[str, Any] = {}
    for task, row in results.items():
        flat: dict[str, Any] = {}
        for key, value in row.items():
            if "," not in key or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            metric, filt = key.split(",", 1)
            flat[metric if filt == "none" else f"{metric}/{filt}"] = value
        if task in n_samples:
            flat["n"] = n_samples[task].get("effective", n_samples[task].get("original"))
        table[task] = flat
    return table


def run_zeroshot(
    cfg: Config,
    ckpt_dir: Path,
    tokenizer_model: Path,
    raw_val: Path,
    items_dir: Path,
    include_path: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the offline items, run lm-eval on ``zeroshot.tasks``; (metrics, records)."""
    zs = cfg.zeroshot
    manager = task_manager(zs.tasks, include_path)
    check_tasks(zs.tasks, manager)
    texts = list(iter_jsonl_texts(raw_val))
    counts = write_items(texts, items_dir, zs.items, zs.seed, zs.cloze_words, zs.choice_words)
    log.info("zeroshot: offline items %s", counts)
    if all(task in OFFLINE_TASKS for task in zs.tasks):
        # Nothing to fetch: fail at once rather than retry an unreachable hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import lm_eval

    from hope.eval.harness import HopeHarnessLM
    from hope.train.device import configure_numerics, resolve_device

    device = resolve_device(cfg.train.device)
    configure_numerics(cfg.train, device)
    model = HopeHarnessLM(
        str(ckpt_dir), tokenizer=str(tokenizer_model), device=str(device),
        batch_size=zs.batch_size, precision=cfg.train.precision,
    )  # fmt: skip
    try:
        out = lm_eval.simple_evaluate(
            model=model, tasks=list(zs.tasks),
            task_manager=manager,
            num_fewshot=zs.num_fewshot, limit=zs.limit, bootstrap_iters=zs.bootstrap_iters,
            random_seed=zs.seed, numpy_random_seed=zs.seed, torch_random_seed=zs.seed,
            fewshot_random_seed=zs.seed, log_samples=False,
        )  # fmt: skip
    except ConnectionError as err:
        raise StageError(
            f"zeroshot: a task's data needs the HuggingFace hub, which is unreachable ({err}); "
            f"use the offline tasks ({', '.join(OFFLINE_TASKS)})"
        ) from None
    if out is None:
        raise StageError("zeroshot: lm-eval returned no results")
    metrics = {"step": model.loaded.step, **flatten_results(out["results"], out["n-samples"])}
    records = {
        "lm_eval": lm_eval.__version__,
        "versions": out.get("versions", {}),
        "n-shot": out.get("n-shot", {}),
        "checkpoint": str(ckpt_dir),
        "variant": model.model.cfg.variant,
        "offline_items": counts,
    }
    return metrics, records

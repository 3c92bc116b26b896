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

``zeroshot.memorize``: a second lm-eval run scores the cloze and multiple-choice tasks
adaptively (hope.eval.harness_memorize, the ``memorize`` section); each of their
metrics gets ``adaptive_<metric>`` and ``delta_<metric>`` beside it. With
``memorize.use_correct_answer`` the carried stream is written each document's correct
continuation after it is scored (``answer_checker``, from the task's own target).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from hope.config import Config
from hope.data.download import iter_jsonl_texts
from hope.errors import ConfigError, StageError
from hope.eval.memorizing import memorize_config, side_by_side
from hope.eval.zeroshot_items import TASKS as OFFLINE_TASKS
from hope.eval.zeroshot_items import write_items
from hope.model.lm import LanguageModel
from hope.model.memorize import MemorizeConfig

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


ADAPTIVE_TYPES = ("loglikelihood", "multiple_choice")


def leaf_tasks(tasks: list[str], manager: Any) -> dict[str, Any]:
    """Task name -> lm-eval Task of every task (groups opened)."""
    return dict(manager.load(tasks)["tasks"])


def answer_checker(tasks: dict[str, Any]) -> Any:
    """Instance -> whether its continuation is its document's correct one: a cloze
    request is its own target; a multiple-choice request is correct when its choice
    index is the task's target (an index, or a choice's text)."""

    def is_answer(request: Any) -> bool:
        task = tasks[request.task_name]
        if task.OUTPUT_TYPE == "loglikelihood":
            return True
        gold = task.doc_to_target(request.doc)
        if isinstance(gold, str) and not gold.isdigit():
            gold = task.doc_to_choice(request.doc).index(gold)
        return int(gold) == int(request.idx)

    return is_answer


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


def adaptive_config(cfg: Config, model: LanguageModel) -> MemorizeConfig | None:
    """``zeroshot.memorize``: the adaptive run's memorisation (per document unless
    ``memorize.reset`` carries); refused for titans_mac (its state continues only at
    segment boundaries, a document's context ends anywhere)."""
    if not cfg.zeroshot.memorize:
        return None
    if model.cfg.variant == "titans_mac":
        raise ConfigError(
            "zeroshot.memorize: titans_mac continues a state only at segment boundaries; "
            "adaptive scoring is not defined for it here (set zeroshot.memorize=false)"
        )
    return memorize_config(cfg.memorize, "zeroshot", "reset_per_sample", model)


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
    mem = adaptive_config(cfg, model.model)  # bad memorize.* before any scoring

    def evaluate(tasks: list[str]) -> dict[str, Any]:
        try:
            out = lm_eval.simple_evaluate(
                model=model, tasks=tasks, task_manager=manager,
                num_fewshot=zs.num_fewshot, limit=zs.limit, bootstrap_iters=zs.bootstrap_iters,
                random_seed=zs.seed, numpy_random_seed=zs.seed, torch_random_seed=zs.seed,
                fewshot_random_seed=zs.seed, log_samples=False,
            )  # fmt: skip
        except ConnectionError as err:
            raise StageError(
                f"zeroshot: a task's data needs the HuggingFace hub, which is unreachable "
                f"({err}); use the offline tasks ({', '.join(OFFLINE_TASKS)})"
            ) from None
        if out is None:
            raise StageError("zeroshot: lm-eval returned no results")
        return out

    out = evaluate(list(zs.tasks))
    metrics = {"step": model.loaded.step, **flatten_results(out["results"], out["n-samples"])}
    if mem is not None:
        tasks = leaf_tasks(list(zs.tasks), manager)
        model.memorize, model.answer_of = mem, answer_checker(tasks)
        model.use_correct_answer = cfg.memorize.use_correct_answer
        adaptive = [n for n, t in tasks.items() if t.OUTPUT_TYPE in ADAPTIVE_TYPES]
        if not adaptive:  # rolling perplexity or generation only: nothing adaptive
            log.warning("zeroshot.memorize: no cloze or multiple-choice task to score")
        again = evaluate(adaptive) if adaptive else {"results": {}, "n-samples": {}}
        for task, row in flatten_results(again["results"], again["n-samples"]).items():
            metrics[task] = side_by_side(metrics.get(task, {}), row)
    records = {
        "lm_eval": lm_eval.__version__,
        "versions": out.get("versions", {}),
        "n-shot": out.get("n-shot", {}),
        "checkpoint": str(ckpt_dir),
        "variant": model.model.cfg.variant,
        "offline_items": counts,
        "memorize": None if mem is None else dataclasses.asdict(mem),
    }
    return metrics, records

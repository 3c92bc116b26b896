"""Continual learning in the fast state: forgetting as text segments are memorised in order.

Segments (``continual.segments``, offline: standard-library packages, their modules'
docstrings in sorted order, e.g. ``json``, ``email``) are each split into a *write*
part (``write_tokens``) and a held-out *probe* part (``probe_tokens``). Starting from a
fresh state, segment k's write part is memorised (hope.model.memorize, as the
``memorize`` section says: paths, layers, steps, τ), then every segment's probe is scored from the
memories alone (``fresh_context``: empty caches, position 0, so attention cannot read
the written text back; the probe's read never changes the carried state). Loss matrix
``after[k][j]``; with the fresh-state losses ``base[j]``:

- memorised delta of j: after[j][j] - base[j] (what writing j did for j; < 0 helps);
- forgetting of j: after[K-1][j] - min_{k>=j} after[k][j] (>= 0; how much of its best
  was lost by the end);
- backward transfer (BWT): mean over j < K-1 of after[K-1][j] - after[j][j] (> 0: later
  writes hurt earlier segments; losses, so the sign is the opposite of accuracy BWT).

``memorize.reset``: carry (the default here) writes the segments on top of each other;
reset_per_sample writes each into a fresh state, the no-interference control (its
forgetting is zero by construction; its off-diagonal shows transfer alone).

Across training (``continual.checkpoints``: steps of kept checkpoints, oldest first):
the same protocol on each, and ``training``: every segment's fresh-state loss per
checkpoint with its forgetting along training (last - best over the checkpoints).
"""

from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hope.config import ContinualConfig, MemorizeParams, TrainConfig
from hope.data.sources import module_docstrings, stdlib_sources
from hope.errors import ConfigError, StageError
from hope.eval.memorizing import memorize_config
from hope.model.lm import LanguageModel, LMState
from hope.model.memorize import MemorizeConfig, fresh_context, memorize


def package_text(package: str, stdlib: Path | None = None) -> str:
    """The docstrings of a stdlib package's (or module's) sources, in sorted order."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in stdlib_sources(root)
        if p.relative_to(root).parts[0] in (package, f"{package}.py")
    ]
    text = "\n\n".join(filter(None, (module_docstrings(p.read_bytes()) for p in files)))
    if not text.strip():
        raise ConfigError(f"continual.segments: {package!r} is no documented stdlib package")
    return text


def split_segment(
    name: str, ids: list[int], write_tokens: int, probe_tokens: int
) -> tuple[list[int], list[int]]:
    if len(ids) < write_tokens + probe_tokens:
        raise StageError(
            f"continual: segment {name!r} has {len(ids)} tokens, fewer than continual."
            f"write_tokens + probe_tokens = {write_tokens + probe_tokens}"
        )
    return ids[:write_tokens], ids[write_tokens : write_tokens + probe_tokens]


@torch.no_grad()
def probe_loss(model: LanguageModel, probe: torch.Tensor, state: LMState) -> torch.Tensor:
    """Mean next-token loss of ``probe`` [1, P] read from the memories of ``state``."""
    logits, _ = model(probe[:, :-1], fresh_context(model, state))
    return F.cross_entropy(logits.double().flatten(0, 1), probe[:, 1:].flatten())


def forgetting_matrix(
    model: LanguageModel,
    segments: Sequence[tuple[list[int], list[int]]],
    cfg: MemorizeConfig,
) -> tuple[list[float], list[list[float]]]:
    """(base[j], after[k][j]) over all segments j (also those not yet written)."""
    device = model.device
    probes = [torch.tensor([probe], device=device) for _, probe in segments]
    fresh = model.init_state(1)
    base = torch.stack([probe_loss(model, p, fresh) for p in probes])
    state: LMState | None = None
    rows = []
    for write, _ in segments:
        state = memorize(model, torch.tensor([write], device=device), state, cfg)
        rows.append(torch.stack([probe_loss(model, p, state) for p in probes]))
    return base.tolist(), torch.stack(rows).tolist()  # the one host read


def summarise(names: Sequence[str], base: list[float], after: list[list[float]]) -> dict[str, Any]:
    last = len(names) - 1
    forgetting = {
        n: after[last][j] - min(after[k][j] for k in range(j, last + 1))
        for j, n in enumerate(names)
    }
    bwt = [after[last][j] - after[j][j] for j in range(last)]
    return {
        "bwt": sum(bwt) / len(bwt) if bwt else 0.0,
        "mean_forgetting": sum(forgetting.values()) / len(names),
        "base": dict(zip(names, base, strict=True)),
        "after": {
            f"{k}_{names[k]}": dict(zip(names, row, strict=True)) for k, row in enumerate(after)
        },
        "forgetting": forgetting,
        "memorised_delta": {n: after[j][j] - base[j] for j, n in enumerate(names)},
    }


def across_training(names: Sequence[str], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per checkpoint (``runs``, oldest first: the ``summarise`` of each): the fresh-state
    loss of every segment, and its forgetting along training (last - best)."""
    losses = {n: [run["base"][n] for run in runs.values()] for n in names}
    return {
        "base": {key: run["base"] for key, run in runs.items()},
        "forgetting": {n: values[-1] - min(values) for n, values in losses.items()},
        "summary": {
            key: {k: run[k] for k in ("bwt", "mean_forgetting")} for key, run in runs.items()
        },
    }


def run_continual(
    cfg: ContinualConfig,
    params: MemorizeParams,
    ckpt_dir: Path,
    tokenizer_model: Path,
    train: TrainConfig,
    texts: Callable[[str], str] = package_text,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``continual`` stage: (metrics, records) for reports/continual.json; every
    named checkpoint is found before any work."""
    from hope.data.tokenizer import load_tokenizer
    from hope.train.checkpoint import load_model
    from hope.train.device import configure_numerics, resolve_device

    sources = {name: texts(name) for name in cfg.segments}  # bad names before the model
    device = resolve_device(train.device)
    configure_numerics(train, device)
    earlier = [load_model(ckpt_dir, device, s) for s in cfg.checkpoints or []]
    model, ckpt_cfg, step = load_model(ckpt_dir, device)
    mem = memorize_config(params, "continual", "carry_across_samples", model)
    sp = load_tokenizer(tokenizer_model)
    segments = [
        split_segment(n, list(sp.encode(t)), cfg.write_tokens, cfg.probe_tokens)
        for n, t in sources.items()
    ]
    metrics = {"step": step, **summarise(cfg.segments, *forgetting_matrix(model, segments, mem))}
    if earlier:
        runs = {
            f"step_{s}": summarise(cfg.segments, *forgetting_matrix(m, segments, mem))
            for s, (m, _, _) in zip(cfg.checkpoints or [], earlier, strict=True)
        }
        runs.setdefault(f"step_{step}", {k: metrics[k] for k in ("base", "bwt", "mean_forgetting")})
        metrics["training"] = across_training(cfg.segments, runs)
    records = {
        "variant": ckpt_cfg.model.variant,
        "segments": list(cfg.segments),
        "memorize": dataclasses.asdict(mem),
    }
    return metrics, records

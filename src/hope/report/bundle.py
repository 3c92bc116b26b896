"""The release bundle: weights without pickle, tokenizer, config, metrics, provenance.

Layout of ``release/``::

    model.safetensors  config.yaml  tokenizer.model  environment.json  README.md
    metrics/{train,eval}.json  metrics/{train,eval}_meta.json  dvc.lock (when present)
    MANIFEST

``MANIFEST`` lists ``sha256  relative/path`` for every other file, sorted, in the
format ``sha256sum -c MANIFEST`` reads. The bundle is built in a temp directory
beside its destination and renamed into place, so a killed build never leaves a
half-written bundle under the final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from torch import nn

from hope.config import Config, config_from_dict, save_config
from hope.errors import StageError
from hope.io import (
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temps,
    sha256_file,
)
from hope.report.environment import collect_environment

WEIGHTS = "model.safetensors"
MANIFEST = "MANIFEST"
REQUIRED = (
    WEIGHTS,
    "tokenizer.model",
    "config.yaml",
    "metrics/train.json",
    "metrics/eval.json",
    "metrics/train_meta.json",
    "metrics/eval_meta.json",
    "environment.json",
    "README.md",
)
# Further evaluations the bundle carries when the pipeline ran them (the DAG always does).
OPTIONAL_REPORTS = tuple(
    f"{name}{tail}.json"
    for name in ("zeroshot", "niah", "longctx", "continual")
    for tail in ("", "_meta")
)
_ALIASES_KEY = "hope.aliases"
_SHA256 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------- weights


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def split_shared(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Deduplicate tied tensors: ``(tensors, aliases)`` with ``aliases[name] = kept_name``.

    safetensors refuses tensors that share memory. Entries that are the *same*
    view (tied weights) are stored once and restored by name from the
    ``hope.aliases`` metadata; entries that only overlap part of a storage are
    cloned, because an alias could not reproduce a partial view.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach()
        key = _storage_key(t)
        if t.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        storage = t.untyped_storage().data_ptr()
        shared = t.numel() > 0 and storage in storages
        tensors[name] = t.clone().contiguous() if shared or not t.is_contiguous() else t
        if t.numel() > 0:
            seen[key] = name
            storages.add(storage)
    return tensors, aliases


def canonical_safetensors(blob: bytes) -> bytes:
    """The same safetensors file with its JSON header in one canonical form.

    The writer serialises ``__metadata__`` from a hash map whose order changes from
    one save to the next, so the same tensors and metadata gave different bytes (and
    hashes). Keys are sorted here and the header re-padded with spaces to 8 bytes;
    tensor offsets are relative to the data section, which is left untouched.
    """
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + size :]


def save_weights(model: nn.Module, path: Path, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``model.state_dict()`` to safetensors (CPU tensors, tied entries deduplicated),
    byte-identical for identical weights and metadata."""
    cpu_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tensors, aliases = split_shared(cpu_state)
    meta = {"format": "pt", _ALIASES_KEY: json.dumps(aliases, sort_keys=True), **(metadata or {})}
    blob = canonical_safetensors(save(tensors, metadata=meta))
    atomic_write(Path(path), lambda tmp: tmp.write_bytes(blob))


def load_weights(model: nn.Module, path: Path) -> None:
    """Load a file written by :func:`save_weights` into ``model`` (strict: every key must match)."""
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:
        raise StageError(f"{path}: cannot read weights: {err}") from None
    aliases: dict[str, str] = json.loads(meta.get(_ALIASES_KEY, "{}"))
    state = dict(tensors)
    for name, target in aliases.items():
        state[name] = tensors[target]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise StageError(f"{path}: weights do not fit config.yaml's model: {err}") from None


# ---------------------------------------------------------------- manifest and verify


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def write_manifest(root: Path) -> None:
    lines = [f"{sha256_file(root / rel)}  {rel}\n" for rel in _files(root) if rel != MANIFEST]
    atomic_write_text(root / MANIFEST, "".join(lines))


def _read_manifest(root: Path) -> tuple[dict[str, str], list[str]]:
    listed: dict[str, str] = {}
    problems: list[str] = []
    for number, line in enumerate((root / MANIFEST).read_text().splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        unsafe = rel.startswith("/") or ".." in Path(rel).parts
        if not sep or not _SHA256.fullmatch(digest) or not rel or unsafe:
            problems.append(f"malformed: MANIFEST line {number}")
        else:
            listed[rel] = digest
    return listed, problems


def verify_bundle(bundle_dir: str | Path) -> list[str]:
    """Problems with a bundle, one per file: ``changed: X``, ``missing: X``, ``unlisted: X``."""
    root = Path(bundle_dir)
    if not root.is_dir():
        return [f"missing: {root} (no such directory)"]
    if not (root / MANIFEST).is_file():
        return [f"missing: {MANIFEST}"]
    listed, problems = _read_manifest(root)
    for rel, digest in sorted(listed.items()):
        path = root / rel
        if not path.is_file():
            problems.append(f"missing: {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"changed: {rel}")
    present = set(_files(root))
    problems += [f"missing: {rel}" for rel in REQUIRED if rel not in listed and rel not in present]
    problems += [f"unlisted: {rel}" for rel in sorted(present - set(listed) - {MANIFEST})]
    return problems


# ---------------------------------------------------------------- build


def _read_json(path: Path, make: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path} not found; run `{make}`") from None
    except json.JSONDecodeError as err:
        raise StageError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise StageError(f"{path}: expected a JSON object")
    return data


def _check_eval_matches(
    eval_metrics: Mapping[str, Any], step: int, variant: str, reports_dir: Path
) -> None:
    """Refuse to ship metrics measured on a different checkpoint than the weights
    (``eval_metrics``: eval.json with eval_meta.json's records)."""
    path = reports_dir / "eval.json"
    if "step" in eval_metrics and eval_metrics["step"] != step:
        raise StageError(
            f"{path} is for step {eval_metrics['step']} but the latest checkpoint is step {step}; "
            "run `python stages/eval.py`"
        )
    if "variant" in eval_metrics and eval_metrics["variant"] != variant:
        raise StageError(
            f"{reports_dir / 'eval_meta.json'} is for variant {eval_metrics['variant']!r}, "
            f"not {variant!r}; run `python stages/eval.py`"
        )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def model_card(
    name: str,
    ckpt_cfg: Config,
    n_params: int,
    step: int,
    train: Mapping[str, Any],
    ev: Mapping[str, Any],
    zeroshot: Mapping[str, Any] | None = None,
    niah: Mapping[str, Any] | None = None,
) -> str:
    """README.md of the bundle: what the model is, how well it does, how to load and check it."""
    m = ckpt_cfg.model
    lines = [
        f"# {name}",
        "",
        f"A `{m.variant}` language model from the HOPE / Nested Learning reproduction "
        f"(package `hope`), trained for {step} steps.",
        "",
        "| | |",
        "|---|---|",
        f"| variant | `{m.variant}` |",
        f"| parameters | {n_params:,} |",
        f"| dim / layers / heads | {m.dim} / {m.n_layers} / {m.n_heads} |",
        f"| vocab | {m.vocab_size} (SentencePiece {ckpt_cfg.tokenizer.model_type}) |",
        f"| context (train seq_len) | {ckpt_cfg.data.seq_len} |",
        f"| data source | {ckpt_cfg.data.source} |",
        "",
        "## Metrics",
        "",
    ]
    val = ev.get("val", {})
    lines += [f"- validation {k}: {_fmt(v)}" for k, v in val.items()]
    for length, r in ev.get("passkey", {}).items():
        lines.append(
            f"- passkey {length}: acc {_fmt(r.get('acc'))} (chance {_fmt(r.get('chance'))}), "
            f"true-key log-prob {_fmt(r.get('true_logprob'))}"
        )
    for task, row in sorted((zeroshot or {}).items()):
        if isinstance(row, Mapping):
            shown = ", ".join(
                f"{k} {_fmt(v)}" for k, v in sorted(row.items()) if not k.endswith("_stderr")
            )
            lines.append(f"- zero-shot `{task}` (lm-eval): {shown}")
    for task, rows in sorted((niah or {}).items()):
        if isinstance(rows, Mapping):
            shown = ", ".join(
                f"{n.removeprefix('len_')} tokens {_fmt(r['acc'])}" for n, r in rows.items()
            )
            lines.append(f"- needle in a haystack `{task}`: {shown}")
    scalars = {k: v for k, v in train.items() if isinstance(v, (int, float, str))}
    lines += [f"- train {k}: {_fmt(v)}" for k, v in sorted(scalars.items())]
    lines += [
        "",
        "Full numbers: `metrics/train.json`, `metrics/eval.json`; the pipeline's lock: `dvc.lock`.",
        "",
        "## Use",
        "",
        "```python",
        "from hope.report.bundle import load_released_model",
        "model = load_released_model('release')  # verifies MANIFEST, no pickle",
        "logits, state = model(tokens)  # tokens: int64 [B, T] from tokenizer.model",
        "```",
        "",
        "Check integrity with `python stages/release.py --verify release`",
        "or `sha256sum -c MANIFEST`.",
        "",
    ]
    return "\n".join(lines)


def _fill_bundle(
    root: Path,
    cfg: Config,
    ckpt_dir: Path,
    tokenizer_dir: Path,
    reports_dir: Path,
) -> None:
    from hope.train.checkpoint import load_model

    train = _read_json(reports_dir / "train.json", "python stages/train.py")
    ev = _read_json(reports_dir / "eval.json", "python stages/eval.py")
    records = {
        name: _read_json(reports_dir / f"{name}_meta.json", f"python stages/{name}.py")
        for name in ("train", "eval")
    }
    tokenizer = tokenizer_dir / "spm.model"
    if not tokenizer.is_file():
        raise StageError(f"{tokenizer} not found; run `python stages/tokenizer.py`")
    model, ckpt_cfg, step = load_model(ckpt_dir)
    _check_eval_matches({**ev, **records["eval"]}, step, ckpt_cfg.model.variant, reports_dir)

    save_weights(
        model, root / WEIGHTS, {"hope.step": str(step), "hope.variant": ckpt_cfg.model.variant}
    )
    shutil.copyfile(tokenizer, root / "tokenizer.model")
    save_config(ckpt_cfg, root / "config.yaml")
    atomic_write_json(root / "metrics" / "train.json", train)
    atomic_write_json(root / "metrics" / "eval.json", ev)
    for name, record in records.items():
        atomic_write_json(root / "metrics" / f"{name}_meta.json", record)
    for name in OPTIONAL_REPORTS:  # evaluations beyond eval, when they have run
        if (reports_dir / name).is_file():
            shutil.copyfile(reports_dir / name, root / "metrics" / name)
    if Path("dvc.lock").is_file():
        shutil.copyfile("dvc.lock", root / "dvc.lock")
    atomic_write_json(root / "environment.json", collect_environment(cfg.train.device))
    n_params = sum(p.numel() for p in model.parameters())  # parameters() skips tied duplicates
    extra = {
        name: _read_json(reports_dir / f"{name}.json", f"python stages/{name}.py")
        if (reports_dir / f"{name}.json").is_file()
        else None
        for name in ("zeroshot", "niah")
    }
    card = model_card(cfg.release.name, ckpt_cfg, n_params, step, train, ev, **extra)
    atomic_write_text(root / "README.md", card)
    write_manifest(root)


def build_bundle(
    cfg: Config,
    ckpt_dir: str | Path,
    tokenizer_dir: str | Path,
    reports_dir: str | Path,
    out_dir: str | Path,
) -> Path:
    """Build the release bundle into ``out_dir`` (replacing any old one); returns ``out_dir``."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # what a killed earlier build left beside ``out``
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _fill_bundle(tmp, cfg, Path(ckpt_dir), Path(tokenizer_dir), Path(reports_dir))
        tmp.chmod(0o755)  # mkdtemp makes it private
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _swap_into_place(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``. An old bundle is first renamed aside, then deleted:
    at every instant ``out`` is either the complete old or the complete new bundle
    (or briefly absent), never a mixture."""
    if not out.exists():
        os.replace(new, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- load


def load_released_model(bundle_dir: str | Path, verify: bool = True) -> nn.Module:
    """Rebuild the model from ``config.yaml`` + ``model.safetensors`` (no pickle involved)."""
    from hope.model.zoo import build_model

    root = Path(bundle_dir)
    if verify and (problems := verify_bundle(root)):
        raise StageError(f"release bundle {root} fails verification: {'; '.join(problems)}")
    config_path = root / "config.yaml"
    try:
        cfg = config_from_dict(yaml.safe_load(config_path.read_text()))
    except FileNotFoundError:
        raise StageError(f"{config_path} not found") from None
    model = build_model(cfg.model)
    load_weights(model, root / WEIGHTS)
    model.eval()
    return model

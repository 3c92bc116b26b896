"""A context's fast state (``LMState``) in a safetensors file: memories, KV caches,
conv tails, pending chunks and the position, e.g. a memorised document to query later.

Tensors are stored under their path in the state (``blocks[0].cms[1].delta_in``);
static counts, ``None`` leaves and the position go to the file's metadata as JSON,
with a fingerprint of the model config. Loading rebuilds the structure from the
model's own ``init_state``, so a file written by another model (variant, sizes, chunk
sizes) is refused, naming what differs. Nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hope.io import remove_stale_temps
from hope.memory.fast_state import map_tensors
from hope.model.lm import LanguageModel, LMState

_META_STATE = "hope.state"
_META_MODEL = "hope.model_config"


def model_fingerprint(model: LanguageModel) -> str:
    """sha256 of the model config (what decides the state's structure and meaning)."""
    text = json.dumps(dataclasses.asdict(model.cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _flatten(node: Any, path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if isinstance(node, torch.Tensor):
        tensors[path] = node.detach().to("cpu").contiguous().clone()
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            _flatten(getattr(node, field.name), f"{path}.{field.name}", tensors, meta)
    elif isinstance(node, (list, tuple)):
        meta[f"{path}#len"] = len(node)
        for i, item in enumerate(node):
            _flatten(item, f"{path}[{i}]", tensors, meta)
    elif isinstance(node, dict):
        meta[f"{path}#keys"] = list(node)
        for key, item in node.items():
            _flatten(item, f"{path}[{key}]", tensors, meta)
    elif node is None or isinstance(node, (bool, int, float, str)):
        meta[path] = node
    else:
        raise TypeError(f"state leaf {path} of type {type(node).__name__} cannot be saved")


def save_state_file(model: LanguageModel, state: LMState, path: Path) -> None:
    """Write ``state`` atomically (a crash leaves the old file or none, never half)."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    _flatten(state, "state", tensors, meta)
    metadata = {_META_STATE: json.dumps(meta), _META_MODEL: model_fingerprint(model)}
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _rebuild(
    template: Any, path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> Any:
    """The saved leaves poured into the structure of ``template`` (a fresh state)."""
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        changes = {
            f.name: _rebuild(getattr(template, f.name), f"{path}.{f.name}", tensors, meta)
            for f in dataclasses.fields(template)
        }
        return dataclasses.replace(template, **changes)
    if isinstance(template, (list, tuple)):
        if meta.get(f"{path}#len") != len(template):
            raise ValueError(
                f"{path} holds {meta.get(f'{path}#len')} entries, the model {len(template)}"
            )
        items = [_rebuild(t, f"{path}[{i}]", tensors, meta) for i, t in enumerate(template)]
        return type(template)(items)
    if isinstance(template, dict):
        if meta.get(f"{path}#keys") != list(template):
            raise ValueError(
                f"{path} has keys {meta.get(f'{path}#keys')}, the model {list(template)}"
            )
        return {k: _rebuild(t, f"{path}[{k}]", tensors, meta) for k, t in template.items()}
    if path in tensors:  # a tensor (also where a fresh state has None, e.g. a KV mask)
        return tensors.pop(path)
    if path in meta:
        return meta[path]
    raise ValueError(f"{path} is missing from the state file")


def load_state_file(model: LanguageModel, path: Path) -> LMState:
    """The state saved by ``save_state_file`` for this model, on the model's device."""
    if not path.is_file():
        raise FileNotFoundError(f"state file {path} not found")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:
        raise ValueError(
            f"state file {path} is not a readable safetensors file ({err}); it may be "
            "truncated: write it again with `hope memorize`"
        ) from None
    if _META_MODEL not in metadata or _META_STATE not in metadata:
        raise ValueError(f"state file {path} holds no fast state (not written by `hope memorize`)")
    if metadata.get(_META_MODEL) != model_fingerprint(model):
        raise ValueError(
            f"state file {path} was written by another model config "
            f"(variant, sizes or chunking differ from this {model.cfg.variant!r} model)"
        )
    meta = json.loads(metadata[_META_STATE])
    batch = next(iter(tensors.values())).shape[0] if tensors else 1
    template = model.init_state(batch)
    state = _rebuild(template, "state", tensors, meta)
    if tensors:
        raise ValueError(f"state file {path} has entries this model lacks: {sorted(tensors)[:3]}")
    device = model.device
    return LMState(map_tensors(state.blocks, lambda t: t.to(device)), state.pos)

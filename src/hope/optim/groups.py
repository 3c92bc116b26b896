"""Parameter partition for the matrix optimizers, and one optimizer made of several.

MECHANISMS §6: Muon/M3 act on the weights that are linear maps between hidden
features: >=2-D tensors that are not norms, embeddings or the LM head (tied or
not), whose last two dims are both > 1, and that their module does not list in
``vector_params`` (a module's tensors that are >=2-D but not maps: depthwise conv
kernels, persistent tokens, the Titans gate projection to a few scalars per head).
A >2-D matrix is a stack of matrices over its leading dims (per-head memory
initial states [H, a, b]): each [a, b] is orthogonalised on its own, never the
flattened (H, a·b). Everything else (embeddings, head, norm gains, biases, gates,
scalars, vectors) goes to AdamW. :class:`HybridOptimizer` presents such a
pair as a single ``torch.optim.Optimizer`` so LR schedulers, ``zero_grad`` and
checkpointing treat it like any other optimizer.
"""

from __future__ import annotations

import re
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hope.errors import ConfigError

# Modules whose parameters never go to the matrix group. The untied output head is
# excluded by name, as in Muon practice: its update must follow the logits' scale.
HEAD_NAMES = ("lm_head",)
# A module attribute: names (relative to the module) of its >=2-D parameters that
# are not linear maps and so belong to AdamW.
VECTOR_PARAMS_ATTR = "vector_params"
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_NORM_NAME = re.compile(r"Norm(\d+d)?$")  # RMSNorm, BatchNorm1d, InstanceNorm2d, ...

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class ParamPartition:
    """``matrix``: for Muon/M3; ``other``: for AdamW. Trainable params only, each once."""

    matrix: NamedParams = field(default_factory=list)
    other: NamedParams = field(default_factory=list)
    embedding_ids: set[int] = field(default_factory=set)


def _is_norm(module: nn.Module) -> bool:
    # Our RMSNorm (hope.layers) and any other "*Norm" class count as norms.
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def partition_params(model: nn.Module) -> ParamPartition:
    """Split ``model``'s trainable parameters into the matrix group and the rest.

    Deviation (docs/FAITHFULNESS.md): per-head stacks [H, a, b] go to the rest, since
    ``torch.optim.Muon`` takes 2-D tensors only (M3 orthogonalises each head)."""
    excluded: set[int] = set()
    embedding_ids: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            embedding_ids.add(id(module.weight))
        if (
            isinstance(module, nn.Embedding | nn.EmbeddingBag)
            or _is_norm(module)
            or name.rsplit(".", 1)[-1] in HEAD_NAMES
        ):
            excluded |= {id(p) for p in module.parameters(recurse=False)}
        for vector_name in getattr(module, VECTOR_PARAMS_ATTR, ()):
            excluded.add(id(module.get_parameter(vector_name)))
    # A tied head shares the embedding tensor, so its id is already excluded, and
    # named_parameters() lists a shared tensor only once.
    part = ParamPartition(embedding_ids=embedding_ids)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_map = param.ndim >= 2 and min(param.shape[-2:]) > 1 and id(param) not in excluded
        target = part.matrix if is_map else part.other
        target.append((name, param))
    return part


def require_knobs(optim_cfg: object, rules: Mapping[str, bool]) -> None:
    """Raise ConfigError naming the first ``optim.<key>`` whose rule is False."""
    for key, ok in rules.items():
        if not ok:
            raise ConfigError(f"optim.{key}: invalid value {getattr(optim_cfg, key)!r}")


def embedding_ids(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)}


def trainable_named(model: nn.Module) -> NamedParams:
    # named_parameters() lists a shared (tied) tensor once.
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def adamw_groups(
    named: NamedParams, weight_decay: float, embedding_ids: set[int]
) -> list[dict[str, Any]]:
    """[decayed, undecayed] AdamW groups: decay >=2-D non-embedding weights only (never
    norms, biases or the tied embedding/head: decaying it shrinks the logits)."""
    decayed = [p for _, p in named if p.ndim >= 2 and id(p) not in embedding_ids]
    kept = [p for _, p in named if not (p.ndim >= 2 and id(p) not in embedding_ids)]
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": kept, "weight_decay": 0.0},
    ]


class HybridOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, driven as one.

    ``param_groups`` is the concatenation of the parts' group dicts (the same
    objects), so a scheduler that rescales ``group["lr"]`` rescales every part,
    each from its own base lr. ``state_dict()`` nests the parts' state dicts by
    name (plain tensors, numbers and strings: loadable with ``weights_only=True``).
    """

    def __init__(self, parts: Mapping[str, torch.optim.Optimizer]) -> None:
        if not parts:
            raise ValueError("HybridOptimizer needs at least one optimizer")
        self.parts = dict(parts)
        groups = [g for opt in self.parts.values() for g in opt.param_groups]
        # Optimizer.__init__ appends these very dicts (it only normalises "params").
        super().__init__(groups, defaults={})
        self._built = True
        self.state = ChainMap(*(opt.state for opt in self.parts.values()))  # type: ignore[assignment]

    def _sync_groups(self) -> None:
        # load_state_dict gives each part fresh group dicts; point at the new ones.
        self.param_groups = [g for opt in self.parts.values() for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.parts.values():
            opt.step()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Optimizer.__init__ calls this for the parts' groups; later calls would add a
        # group that no part steps, so they are refused.
        if getattr(self, "_built", False):
            raise NotImplementedError(
                "HybridOptimizer: add the group to one of its parts (optimizer.parts[name])"
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": {name: opt.state_dict() for name, opt in self.parts.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("parts")
        if not isinstance(saved, dict) or set(saved) != set(self.parts):
            found = sorted(saved) if isinstance(saved, dict) else None
            raise ValueError(
                f"HybridOptimizer state_dict: expected parts {sorted(self.parts)}, found {found}"
            )
        for name, opt in self.parts.items():
            opt.load_state_dict(saved[name])
        self._sync_groups()

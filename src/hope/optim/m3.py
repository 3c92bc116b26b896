"""M3, Multi-scale Momentum Muon (NL-arXiv Alg. 1; MECHANISMS §6), and its AdamW hybrid.

Per parameter theta (a >=2-D matrix), with g = grad + wd * theta (coupled decay):

    every step:     M1 += beta1 g;  V += beta2 g^2  (literal: no decay)
                    O1 = NS_T(M1)
                    theta -= lr (O1 + alpha O2) / (sqrt(V) + eps)
    every f steps:  M2 += beta3 (sum of the last f gradients);  O2 = NS_T(M2)
                    (after the update, so the new O2 is used from the next step)

NS_T is the cubic Newton–Schulz of :mod:`hope.optim.newton_schulz`. Since V
never decays it only grows; ``ema_v=True`` offers the Adam-style alternative
V <- beta2 V + (1 - beta2) g^2, read with Adam's bias correction 1 / (1 - beta2^k).
Note NS_T is scale-free, so beta1 and beta3 only matter through NS's eps.

The step counter is a Python int in each param group (``group["step"]``): the
"every f steps" test is host-side arithmetic, not a device read, so a step has
no host-device sync; being in the group, it travels with ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hope.config import OptimConfig
from hope.optim.groups import (
    HybridOptimizer,
    adamw_groups,
    partition_params,
    require_knobs,
)
from hope.optim.newton_schulz import newton_schulz_cubic


def _check_hyperparameters(values: dict[str, Any]) -> None:
    rules = {
        "lr": values["lr"] >= 0.0,
        "beta1": values["beta1"] >= 0.0,
        "beta2": 0.0 <= values["beta2"] < 1.0 if values["ema_v"] else values["beta2"] > 0.0,
        "beta3": values["beta3"] >= 0.0,
        "eps": values["eps"] > 0.0,
        "weight_decay": values["weight_decay"] >= 0.0,
        "slow_every": isinstance(values["slow_every"], int) and values["slow_every"] >= 1,
        "ns_steps": isinstance(values["ns_steps"], int) and values["ns_steps"] >= 0,
    }
    for key, ok in rules.items():
        if not ok:
            raise ValueError(f"M3: invalid {key}={values[key]!r}")


class M3(torch.optim.Optimizer):
    """M3 for >=2-D parameters (each reshaped to (shape[0], -1) for Newton–Schulz)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.95,
        beta3: float = 0.9,
        alpha: float = 1.0,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        slow_every: int = 50,
        ns_steps: int = 3,
        ema_v: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            beta3=beta3,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            slow_every=slow_every,
            ns_steps=ns_steps,
            ema_v=ema_v,
            step=0,
        )
        _check_hyperparameters(defaults)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_hyperparameters(group)
            for param in group["params"]:
                if param.ndim < 2:
                    raise ValueError(
                        f"M3 acts on >=2-D parameters; got shape {tuple(param.shape)} "
                        "(give 1-D params to AdamW, see hope.optim.groups)"
                    )

    def _param_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[param]
        if not state:
            for key in ("m1", "v", "m2", "o2", "grad_sum"):
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["step"] += 1
            slow_due = group["step"] % group["slow_every"] == 0  # Python ints: no sync
            for param in group["params"]:
                if param.grad is not None:
                    self._update_param(param, group, slow_due)
        return loss

    def _update_param(self, param: torch.Tensor, group: dict[str, Any], slow_due: bool) -> None:
        state = self._param_state(param)
        grad = param.grad
        assert grad is not None
        if group["weight_decay"] != 0.0:
            grad = grad.add(param, alpha=group["weight_decay"])  # coupled decay
        beta2 = group["beta2"]
        state["m1"].add_(grad, alpha=group["beta1"])
        state["grad_sum"].add_(grad)
        if group["ema_v"]:
            state["v"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            second_moment = state["v"] / (1.0 - beta2 ** group["step"])
        else:
            state["v"].addcmul_(grad, grad, value=beta2)
            second_moment = state["v"]
        fast = newton_schulz_cubic(state["m1"], group["ns_steps"])  # O1
        direction = fast.add(state["o2"], alpha=group["alpha"])  # O1 + alpha O2
        denom = second_moment.sqrt().add_(group["eps"])
        param.addcdiv_(direction, denom, value=-group["lr"])
        if slow_due:
            # The slow memory folds in the last f gradients; its new O2 acts from
            # the next step on (MECHANISMS §6).
            state["m2"].add_(state["grad_sum"], alpha=group["beta3"])
            state["grad_sum"].zero_()
            state["o2"].copy_(newton_schulz_cubic(state["m2"], group["ns_steps"]))


def build_m3_hybrid(model: nn.Module, optim_cfg: OptimConfig) -> HybridOptimizer:
    """One optimizer: parts ``"m3"`` (>=2-D hidden matrices) and ``"adamw"`` (the rest)."""
    require_knobs(
        optim_cfg,
        {
            "m3_lr": optim_cfg.m3_lr >= 0.0,
            "m3_weight_decay": optim_cfg.m3_weight_decay >= 0.0,
            "m3_beta3": optim_cfg.m3_beta3 >= 0.0,
            "m3_slow_every": optim_cfg.m3_slow_every >= 1,
            "m3_ns_steps": optim_cfg.m3_ns_steps >= 0,
            "beta2": 0.0 < optim_cfg.beta2 < 1.0,
        },
    )
    part = partition_params(model)
    parts: dict[str, torch.optim.Optimizer] = {}
    if part.matrix:
        parts["m3"] = M3(
            [p for _, p in part.matrix],
            lr=optim_cfg.m3_lr,
            beta1=optim_cfg.beta1,
            beta2=optim_cfg.beta2,
            beta3=optim_cfg.m3_beta3,
            alpha=optim_cfg.m3_alpha,
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.m3_weight_decay,
            slow_every=optim_cfg.m3_slow_every,
            ns_steps=optim_cfg.m3_ns_steps,
            ema_v=optim_cfg.m3_ema_v,
        )
    groups = adamw_groups(part.other, optim_cfg.weight_decay, part.embedding_ids)
    if groups:
        parts["adamw"] = torch.optim.AdamW(
            groups,
            lr=optim_cfg.lr,
            betas=(optim_cfg.beta1, optim_cfg.beta2),
            eps=optim_cfg.eps,
            fused=True,
        )
    if not parts:
        raise ValueError("build_m3_hybrid: the model has no trainable parameters")
    return HybridOptimizer(parts)

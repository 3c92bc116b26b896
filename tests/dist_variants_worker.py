"""Worker of tests/test_distributed_variants.py, run under torchrun with 2 gloo ranks
(``HOPE_DIST_DEVICE=cuda``: 2 GPUs over NCCL, as scripts/gpu_check.sh runs it).

For every variant and both parallel modes: 3 float64 training steps, each rank on its
half of the batch, then the whole parameters gathered; rank 0 trains the same model
on the whole batch in one process and writes the largest differences to argv[1].
Under FSDP it also records the FSDP units and the most blocks ever holding whole
(gathered) parameters at once, probed before every block submodule's forward."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import hope
from hope.memory.residual_mlp import MemoryInit
from hope.model.zoo import VARIANTS
from hope.optim.outer import build_optimizer
from hope.train import distributed as d
from hope.train import state_dicts
from hope.train.schedule import build_scheduler
from hope.train.step import train_step

OVERRIDES = ["model.dim=16", "model.n_layers=2", "model.n_heads=2", "tokenizer.vocab_size=64",
             "model.cms_periods=[4,8]", "model.smt_chunk=2", "model.smt_mem_chunk=4",
             "model.titans_chunk=4", "model.titans_window=8", "data.seq_len=16",
             "train.batch_size=4", "optim.warmup_steps=1", "optim.lr=0.01"]  # fmt: skip
STEPS = 3
DEVICE = (
    torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("HOPE_DIST_DEVICE") == "cuda"
    else torch.device("cpu")
)


def batches(cfg: hope.Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        seq = torch.randint(0, 64, (cfg.train.batch_size, cfg.data.seq_len + 1), generator=gen)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def gathered_probe(model: nn.Module) -> list[int]:
    """[most blocks gathered at once]: counted before every block submodule's forward."""
    blocks = list(model.blocks)  # type: ignore[arg-type]
    peak = [0]

    def probe(*_: object) -> None:
        whole = sum(not isinstance(next(b.parameters()), DTensor) for b in blocks)
        peak[0] = max(peak[0], whole)

    for block in blocks:
        for sub in block.modules():
            if sub is not block:
                sub.register_forward_pre_hook(probe)
    return peak


def units(model: nn.Module) -> dict[str, int]:
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    blocks = [b for b in model.blocks if isinstance(b, FSDPModule)]  # type: ignore[attr-defined]
    return {"units": len(fsdp), "block_units": len(blocks)}


def train(
    cfg: hope.Config, env: d.DistEnv, parallel: str
) -> tuple[dict, list[float], dict[str, int]]:
    torch.manual_seed(0)
    model = hope.build_model(cfg.model).double().to(DEVICE)
    wrapped = d.wrap(model, env, DEVICE, parallel)
    peak = gathered_probe(model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, STEPS)
    rows = env.rows(cfg.train.batch_size)
    losses = []
    for x, y in batches(cfg):
        x, y = x.to(DEVICE), y.to(DEVICE)
        loss = train_step(model, optimizer, scheduler, x[rows], y[rows], 1.0, None, ddp=wrapped)
        losses.append(float(d.all_reduce_sum(loss.detach().clone(), env)) / env.world_size)
    shape = {**units(model), "peak_gathered_blocks": peak[0]}
    params, _ = state_dicts.gather(model, optimizer, by_name=parallel == "fsdp")
    return params, losses, shape


def dtype_probe(model: nn.Module, inits: list[nn.Module], seen: dict[str, set[str]]) -> None:
    """Before every block submodule's forward: the dtypes of its own gathered parameters
    (``seen["gathered"]``) and of the gathered memory inits' (``seen["inits"]``)."""

    def probe(module: nn.Module, _: object) -> None:
        own = module.parameters(recurse=False)
        seen["gathered"].update(str(p.dtype) for p in own if not isinstance(p, DTensor))
        for init in inits:
            seen["inits"].update(
                str(p.dtype) for p in init.parameters() if not isinstance(p, DTensor)
            )

    for block in model.blocks:  # type: ignore[attr-defined]
        for sub in block.modules():
            if not any(sub is i or any(sub is m for m in i.modules()) for i in inits):
                sub.register_forward_pre_hook(probe)


def bf16_blocks(env: d.DistEnv) -> dict[str, dict]:
    """train.fsdp_param_dtype=bf16 against fp32 parameters, both under bf16 autocast on
    FSDP2: the losses, and the dtypes of what is gathered (blocks, memory inits) and of
    the sharded parameters and gradients the optimizer sees."""
    report = {}
    for variant in ("transformer", "hope_attention", "hope", "titans_mac"):
        cfg = hope.load_config(None, [*OVERRIDES, f"model.variant={variant}"])
        runs = {}
        for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            torch.manual_seed(0)
            model = hope.build_model(cfg.model).to(DEVICE)
            wrapped = d.wrap(model, env, DEVICE, "fsdp", dtype)
            seen: dict[str, set[str]] = {"gathered": set(), "inits": set()}
            inits = [m for m in model.modules() if isinstance(m, MemoryInit)]
            dtype_probe(model, inits, seen)
            optimizer = build_optimizer(model, cfg.optim)
            scheduler = build_scheduler(optimizer, cfg.optim, STEPS)
            rows, losses = env.rows(cfg.train.batch_size), []
            for x, y in batches(cfg):
                x, y = x.to(DEVICE), y.to(DEVICE)
                loss = train_step(
                    model, optimizer, scheduler, x[rows], y[rows], 1.0, torch.bfloat16,
                    ddp=wrapped,
                )  # fmt: skip
                losses.append(float(d.all_reduce_sum(loss.detach().clone(), env)) / 2)
            runs[name] = {
                "losses": losses,
                **{key: sorted(dtypes) for key, dtypes in seen.items()},
                "sharded": sorted({str(p.dtype) for p in model.parameters()}),
                "grads": sorted(
                    {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
                ),
            }
        report[variant] = runs
    return report


def main() -> None:
    rank = int(os.environ["RANK"])
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    env = d.DistEnv(rank, dist.get_world_size(), int(os.environ["LOCAL_RANK"]))
    # Every variant under both modes; hope and titans_mac also with checkpointed blocks
    # under FSDP (the backward's rerun of a block gathers its shard again).
    if sys.argv[2:] == ["bf16"]:
        report = bf16_blocks(env)
        if env.is_main:
            with open(sys.argv[1], "w") as handle:
                json.dump(report, handle)
        dist.destroy_process_group()
        return
    runs = [(v, p, "") for v in VARIANTS for p in ("ddp", "fsdp")]
    runs += [(v, "fsdp", "+ckpt") for v in ("hope", "titans_mac")]
    runs += [("hope", "fsdp", "+exact_online")]
    singles: dict[str, tuple[dict, list[float], dict[str, int]]] = {}
    report = {}
    for variant, parallel, tag in runs:
        extra = {
            "": [], "+ckpt": ["model.checkpoint_blocks=true"],
            "+exact_online": ["model.cms_mode=exact_online"],
        }[tag]  # fmt: skip
        cfg = hope.load_config(None, [*OVERRIDES, f"model.variant={variant}", *extra])
        key = variant + (tag if tag == "+exact_online" else "")
        if env.is_main and key not in singles:
            singles[key] = train(cfg, d.DistEnv(), "ddp")
        params, losses, shape = train(cfg, env, parallel)
        if env.is_main:
            ref_params, ref_losses, _ = singles[key]
            report[f"{variant}/{parallel}{tag}"] = {
                **(shape if parallel == "fsdp" else {}),
                "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                "params": max(
                    float((params[k].double() - v.double()).abs().max())
                    for k, v in ref_params.items()
                ),
            }
    if env.is_main:
        with open(sys.argv[1], "w") as handle:
            json.dump(report, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The memory planner (hope.train.plan): saved-activation bytes are counted exactly on a
module whose saved tensors are known, the linear fit and the plan are the arithmetic
they claim, and the command plans the tiny preset (bad input: one line, exit 2)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from hope.config import load_config
from hope.model.zoo import build_model
from hope.train.plan import (
    GIB,
    MARGIN,
    STATE_BYTES_PER_PARAM,
    Activations,
    Fit,
    _fit,
    gathered_bytes,
    main,
    make_plan,
    measure,
    saved_bytes,
)


class _Known(nn.Module):
    """Embedding (saves its indices), a bias-free linear (saves its input; the weight
    is a parameter, not counted) and a square (saves its input)."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin = nn.Linear(dim, dim, bias=False)

    def training_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(tokens)).pow(2).mean()


def test_saved_bytes_counts_each_saved_storage_once_without_parameters() -> None:
    batch, length, dim = 3, 7, 6
    tokens = torch.randint(0, 11, (batch, length + 1))
    got = saved_bytes(_Known(dim=dim), tokens, None)
    indices = batch * (length + 1) * 8  # the view's whole int64 storage
    assert got == indices + 2 * batch * length * dim * 4  # emb output and linear output


def test_fit_is_exact_on_a_line_and_plan_picks_the_largest_fitting_divisor() -> None:
    fit = _fit([100, 300], [1100.0, 3100.0])
    assert (fit.fixed, fit.per_token) == (100.0, 10.0) and fit(1000) == 10100.0
    cfg = load_config(None, ["preset=tiny", "train.batch_size=16"])
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    row = 0.25 * GIB / cfg.model.n_layers  # per layer at any length: 0.25 GiB per row
    acts = Activations(Fit(row, 0.0), Fit(0.0, 0.0), 256, 0.01)
    state = STATE_BYTES_PER_PARAM * params
    memory = (MARGIN * (state + 4 * 0.25 * GIB) + 1) / GIB  # 4 rows fit, 8 do not
    plan = make_plan(cfg, acts, memory, gpus=2, fsdp=False)
    assert (plan.micro_batch, plan.grad_accum) == (4, 2)  # 8 rows per GPU, divisors 1,2,4,8
    assert plan.peak_gib == pytest.approx(MARGIN * (state + GIB) / GIB)
    sharded = make_plan(cfg, acts, memory, gpus=2, fsdp=True)
    assert sharded.state_gib == pytest.approx(plan.state_gib / 2)
    gathered = gathered_bytes(build_model(cfg.model)) / GIB
    assert plan.gathered_gib == 0 and sharded.gathered_gib == pytest.approx(gathered)
    rows = sharded.micro_batch * 0.25  # type: ignore[operator]
    assert sharded.peak_gib == pytest.approx(MARGIN * (sharded.state_gib + gathered + rows))
    assert make_plan(cfg, acts, 0.1, gpus=2, fsdp=False).micro_batch is None


def test_checkpointed_blocks_keep_their_inputs_and_rerun_one_block() -> None:
    """model.checkpoint_blocks: what a layer keeps is far less than its activations, and
    the plan adds one block's whole activations (the rerun) once, whatever the depth."""
    lengths = (16, 32, 64)
    plain_cfg = load_config(None, ["preset=tiny"])
    ckpt_cfg = load_config(None, ["preset=tiny", "model.checkpoint_blocks=true"])
    plain, ckpt = measure(plain_cfg, lengths, None), measure(ckpt_cfg, lengths, None)
    assert plain.recompute is None and ckpt.recompute is not None
    assert ckpt.layer(512) < 0.2 * plain.layer(512)
    assert ckpt.recompute(512) == pytest.approx(plain.layer(512))
    for depth in (2, 12):
        assert ckpt.per_row(512, depth) == pytest.approx(
            ckpt.shell(512) + depth * ckpt.layer(512) + plain.layer(512)
        )
    assert ckpt.per_row(512, 12) < 0.3 * plain.per_row(512, 12)


def test_command_plans_tiny_and_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "tiny", "--gpu-mem-gb", "1", "--gpus", "2", "--lengths", "16,32,64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "micro_batch_size 8, gradient accumulation 1" in out and "check at T=64" in out
    assert main([*argv, "--gpus", "3"]) == 2
    assert "--gpus=3 must divide train.batch_size=16" in capsys.readouterr().err
    assert main([*argv[:6], "--lengths", "64,32,16"]) == 2
    assert "three increasing lengths" in capsys.readouterr().err
    assert main(["--preset", "huge"]) == 2
    assert "huge" in capsys.readouterr().err


def test_the_readme_plan_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs/SCALING.md").read_text()
    command = next(
        line for line in readme.splitlines() if line.startswith("python -m hope.train.plan")
    )
    assert main(shlex.split(command)[3:]) == 0
    assert "tiny (hope," in capsys.readouterr().out


def _sizes(model: nn.Module) -> tuple[int, int, int]:
    """(all parameters, one block's without its memory inits, the memory inits)."""
    inits = sum(
        p.numel()
        for m in model.modules()
        if type(m).__name__ in ("MemoryInit", "DeepMemoryInit")
        for p in m.parameters()
    )
    block = sum(p.numel() for p in model.blocks[0].parameters())  # type: ignore[index]
    layers = len(model.blocks)  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters()), block - inits // layers, inits


@pytest.mark.parametrize(
    "variant, mode, expected",
    [
        # (weights and gradients of the root and inits) + the running and next block's
        ("transformer", "teach_pass", lambda r, b: 8 * (r + 2 * b)),
        ("titans_mac", "teach_pass", lambda r, b: 8 * (r + 2 * b)),
        ("hope", "static", lambda r, b: 8 * (r + 2 * b)),  # training: a plain forward
        ("hope", "teach_pass", lambda r, b: 8 * r + 4 * 6 * b),  # pass A: 6 blocks' weights
        ("hope", "exact_online", lambda r, b: 8 * (r + 6 * b)),  # one unit, whole model
    ],
)
def test_gathered_bytes_count_the_units_held_whole_at_once(
    variant: str, mode: str, expected: Callable[[int, int], int]
) -> None:
    cfg = load_config(
        None, ["preset=tiny", "model.n_layers=6", f"model.variant={variant}",
               f"model.cms_mode={mode}"],
    )  # fmt: skip
    model = build_model(cfg.model)
    total, block, _ = _sizes(model)
    kept = total - 6 * block  # embedding/head, final norm, memory inits
    assert gathered_bytes(model) == expected(kept, block)


def test_command_plans_under_the_configured_memory_backend(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.memory_backend`` is what the plan measures under (``compile`` as
    ``torch``, and it says so), and the process's default backend is put back. The
    fused operators save what their own backwards read: on the tiny preset without SMT
    checkpointing about a third of what autograd through the PyTorch ops keeps."""
    from hope.memory.ops import dispatch
    from hope.train import plan

    argv = ["--preset", "tiny", "--gpu-mem-gb", "1", "--gpus", "2", "--lengths", "16,32,64",
            "--set", "model.smt_checkpoint_chunks=0"]  # fmt: skip
    measured_under: list[str] = []

    def recording(*args: object) -> Activations:
        measured_under.append(dispatch.resolve_backend(None))
        return measure(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(plan, "measure", recording)
    headers = {}
    for backend in ("torch", "fused", "compile"):
        assert main([*argv, "--set", f"train.memory_backend={backend}"]) == 0
        headers[backend] = capsys.readouterr().out.split("):")[0]
    assert measured_under == ["torch", "fused", "torch"]
    assert headers["torch"].endswith("memory backend torch")
    assert headers["fused"].endswith("memory backend fused")
    assert headers["compile"].endswith("memory backend torch for compile")
    assert dispatch.resolve_backend(None) == "torch"
    cfg = load_config(None, ["preset=tiny", "model.smt_checkpoint_chunks=0"])
    rows = {}
    for backend in ("torch", "fused"):
        dispatch.set_default_backend(backend)
        try:
            rows[backend] = measure(cfg, (16, 32, 64), None).per_row(128, 2)
        finally:
            dispatch.set_default_backend("torch")
    assert 0.2 * rows["torch"] < rows["fused"] < 0.5 * rows["torch"]

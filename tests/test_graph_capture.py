"""A training step a CUDA graph can capture (hope.train.graphed, train.cuda_graph).

On a CPU: every variant's forward and backward on the meta device read no host tensor
(what a capture cannot hold), the audit finds and names one that does; two consecutive
training steps of every variant dispatch the same ops with the same arguments (what a
replay repeats), which a rate passed as a number breaks; and the replayable optimizer
(capturable AdamW, learning rate in a device tensor filled by the schedule) trains like
the plain one, also across a state round trip.
On CUDA: a captured and replayed run equals the eager run step for step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import hope
from conftest import TINY_SHAPE, TINY_VOCAB
from hope.bench.run import check_bench_config
from hope.config import OptimConfig, TrainConfig
from hope.data.shards import ShardedTokens
from hope.errors import ConfigError, StageError
from hope.memory.ops.dispatch import resolve_backend, set_default_backend
from hope.model.lm import LanguageModel
from hope.model.zoo import VARIANTS, build_model
from hope.optim.outer import build_optimizer
from hope.train.device import setup_runtime, upload
from hope.train.graphed import WARMUP_STEPS, CapturedStep, HostTensorAudit, prepare_optimizer
from hope.train.loop import run_training
from hope.train.schedule import build_scheduler, current_lr
from hope.train.step import train_step

META = torch.device("meta")
CPU = torch.device("cpu")
SMALL = [*TINY_SHAPE, "model.titans_window=8"]  # default inner rates, float32


@pytest.fixture
def backend() -> Iterator[None]:
    before = resolve_backend(None)
    yield
    set_default_backend(before)


def small_model(*extra: str, device: torch.device | None = None) -> LanguageModel:
    cfg = hope.load_config(None, [*SMALL, *extra])
    torch.manual_seed(0)
    with device or torch.device("cpu"):
        return build_model(cfg.model)


def audited_step(model: LanguageModel, tokens: Tensor) -> list[str]:
    """One warm-up forward/backward, then one under the audit (as CapturedStep does)."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model.training_loss(tokens[:, :-1], tokens[:, 1:]).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    step()
    with HostTensorAudit(tokens.device) as audit:
        step()
    return audit.found


@pytest.mark.parametrize("memory_backend", ["torch", "fused"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_training_step_reads_no_host_tensor(
    variant: str, memory_backend: str, backend: None
) -> None:
    """Forward, backward and clipping of every variant on the meta device: no op takes
    or makes a host tensor (the CMS dual form's coefficient table, for one, is uploaded
    once and cloned on the device afterwards)."""
    set_default_backend(memory_backend)
    model = small_model(f"model.variant={variant}", device=META)
    tokens = torch.zeros(2, 17, dtype=torch.long, device=META)
    assert audited_step(model, tokens) == []


@pytest.mark.parametrize(
    "extra",
    [
        ("model.surprise_threshold=0.5",),  # gated CMS writes: the per-sample device form
        ("model.cms_mode=exact_online", "model.cms_rule=momentum", "model.cms_momentum=0.9"),
        ("model.smt_momentum=0.9", "model.smt_precondition=false"),
        ("model.smt_chunk=4", "model.smt_read_chunk=2"),  # frozen-base reads
        ("model.checkpoint_blocks=true", "model.smt_checkpoint_chunks=1"),
        ("model.variant=titans_mac", "model.titans_checkpoint_chunks=1"),
        ("model.variant=titans_lmm", "model.titans_depth=3"),
    ],
)
def test_options_read_no_host_tensor(extra: tuple[str, ...]) -> None:
    """Other mechanisms and recomputation: still no host tensor in a step."""
    model = small_model("model.variant=hope", *extra, device=META)
    tokens = torch.zeros(2, 17, dtype=torch.long, device=META)
    assert audited_step(model, tokens) == []


def test_recomputation_stashes_no_rng_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointed blocks and chunk loops keep no RNG state to replay (no op draws
    random numbers): reading the CUDA generator's state cannot be captured."""

    def refuse() -> Tensor:
        raise AssertionError("a checkpoint stashed the RNG state")

    monkeypatch.setattr(torch, "get_rng_state", refuse)
    for extra in (
        ("model.variant=hope", "model.checkpoint_blocks=true", "model.smt_checkpoint_chunks=1"),
        ("model.variant=titans_mac", "model.titans_checkpoint_chunks=1"),
    ):
        model = small_model(*extra)
        tokens = torch.randint(0, TINY_VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
        model.training_loss(tokens[:, :-1], tokens[:, 1:]).backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


class Uploads(nn.Module):
    """Adds a host constant to its input inside forward: an upload per step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        bias = torch.tensor([1.0, 2.0, 3.0]).to(x.device)  # the hazard
        return (x * self.weight + bias).sum()


def test_the_audit_names_a_host_upload_and_its_line() -> None:
    module = Uploads().to(META)
    with HostTensorAudit(META) as audit:
        module(torch.zeros(2, 3, device=META)).backward()
    ops = [found.split(" at ")[0] for found in audit.found]
    assert ops == ["aten.lift_fresh.default", "aten._to_copy.default"]  # made, then uploaded
    assert all("test_graph_capture.py:" in found for found in audit.found)
    with pytest.raises(StageError, match=r"train.cuda_graph.*_to_copy.*test_graph_capture"):
        audit.check("train.cuda_graph")
    clean = HostTensorAudit(META)
    clean.check("nothing seen")  # no error
    on_cpu = HostTensorAudit(CPU)  # on the CPU nothing is a host tensor: trace only
    with on_cpu:
        Uploads()(torch.zeros(2, 3))
    assert on_cpu.found == [] and len(on_cpu.trace) > 3


def test_the_audit_lets_fused_attention_keep_its_dropout_seed_on_the_host() -> None:
    """CUDA's fused attention returns its dropout seed and offset as host tensors and
    its backward takes them back; a capture does not read them, so the audit passes
    them (the H200 run refused every attention step before). Any other op with a host
    tensor is still named."""
    q = torch.zeros(1, 2, 8, 16, device=META)
    seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    with HostTensorAudit(META) as audit:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True)
        torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            out, q, q, q, None, out, lse, seed, offset, 0.0, (True, True, True, False)
        )
    assert audit.found == []
    with HostTensorAudit(META) as audit:
        mask = torch.zeros(8, 8)  # a host mask is still a host read, in attention too
        torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, mask, False)
    assert [found.split(" at ")[0] for found in audit.found][-1].startswith(
        "aten._scaled_dot_product_efficient_attention"
    )
    with HostTensorAudit(META) as audit:
        q * torch.tensor(2.0)  # a host number the capture would freeze
    assert [found.split(" at ")[0] for found in audit.found][-1] == "aten.mul.Tensor"


def step_traces(variant: str, replayable: bool) -> str | None:
    """Where the third training step's op trace departs from the second's (None: the
    same ops with the same arguments, so a replay of one is the other)."""
    model = small_model(f"model.variant={variant}")
    cfg = OptimConfig(lr=0.01, warmup_steps=5)  # the rate changes every step
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, 10)
    if replayable:
        prepare_optimizer(optimizer, CPU)
    gen = torch.Generator().manual_seed(5)
    audit = None
    for i in range(3):
        tokens = torch.randint(0, TINY_VOCAB, (2, 17), generator=gen)
        audit = HostTensorAudit(CPU, audit)
        with audit if i else contextlib.nullcontext():
            train_step(model, optimizer, None, tokens[:, :-1], tokens[:, 1:], 1.0)
        scheduler.step()
    assert audit is not None and len(audit.trace) > 100
    return audit.departure()


@pytest.mark.parametrize("memory_backend", ["torch", "fused"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_consecutive_training_steps_dispatch_the_same_ops(
    variant: str, memory_backend: str, backend: None
) -> None:
    """Forward, backward, clipping and the prepared AdamW step of every variant: two
    consecutive steps (other batches, other learning rates) dispatch the same ops with
    the same shapes and arguments, so a captured step replays any later one."""
    set_default_backend(memory_backend)
    assert step_traces(variant, replayable=True) is None


def test_a_rate_passed_as_a_number_changes_the_trace() -> None:
    """The control: with the plain optimizer the learning rate reaches the fused AdamW
    kernel as a number, which a captured graph would freeze."""
    departs = step_traces("transformer", replayable=False)
    assert departs is not None and "_fused_adamw" in departs


def train_steps(replayable: bool, steps: int, reload_at: int | None = None) -> list[Tensor]:
    """Losses of ``steps`` AdamW steps of a small hope model with warmup and decay; the
    replayable optimizer is prepared (and prepared again after a state round trip at
    step ``reload_at``) and its schedule is stepped outside the step, as the trainer
    does under train.cuda_graph."""
    model = small_model("model.variant=hope")
    cfg = OptimConfig(lr=0.01, warmup_steps=3)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, steps)
    if replayable:
        prepare_optimizer(optimizer, torch.device("cpu"))
    tokens = torch.randint(
        0, TINY_VOCAB, (steps, 2, 17), generator=torch.Generator().manual_seed(3)
    )
    losses = []
    for i in range(steps):
        if replayable and i == reload_at:
            state = optimizer.state_dict()
            optimizer = build_optimizer(model, cfg)  # plain, like a fresh process
            optimizer.load_state_dict(state)
            prepare_optimizer(optimizer, torch.device("cpu"))
            scheduler.optimizer = optimizer
        lr = current_lr(scheduler)
        group_lr = optimizer.param_groups[0]["lr"]
        assert lr == pytest.approx(float(group_lr), rel=1e-6)
        if replayable:
            assert isinstance(group_lr, Tensor) and optimizer.param_groups[0]["capturable"]
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        losses.append(train_step(model, optimizer, None, x, y, 1.0))
        scheduler.step()
    return losses + [torch.cat([p.detach().flatten() for p in model.parameters()])]


def test_the_replayable_optimizer_trains_like_the_plain_one() -> None:
    """Capturable AdamW with device learning-rate tensors that the schedule fills: the
    losses and weights of the plain optimizer through warmup and decay, also after a
    state round trip (a resume: the loaded group brings its saved lr and flags until
    it is prepared again). The lr tensor is float32 (what the fused kernels read), so
    the weights differ by the rounding of the rate: about one float32 ulp."""
    plain = train_steps(False, 6)
    replayable = train_steps(True, 6)
    torch.testing.assert_close(replayable, plain, rtol=2e-6, atol=2e-7)
    assert not torch.equal(replayable[-1], plain[-1])  # the rounding does show
    torch.testing.assert_close(train_steps(True, 6, reload_at=4), replayable, rtol=0, atol=0)


def test_graph_mode_is_refused_where_it_cannot_run() -> None:
    model = small_model("model.variant=transformer")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        CapturedStep(lambda x, y: x.sum(), build_optimizer(model, OptimConfig()), CPU)
    muon = build_optimizer(model, OptimConfig(name="muon"))
    with pytest.raises(ConfigError, match="fused AdamW"):
        prepare_optimizer(muon, torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.cuda_graph=true replays.*optim.name=muon"):
        hope.load_config(None, ["train.cuda_graph=true", "optim.name=muon"])
    with pytest.raises(ConfigError, match="train.nproc_per_node=2"):
        hope.load_config(None, ["train.cuda_graph=true", "train.nproc_per_node=2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("variant", ["transformer", "hope", "titans_mac"])
def test_a_captured_run_equals_the_eager_run(variant: str, backend: None) -> None:
    """Eight steps: eager, and through CapturedStep (three eager warm-up steps, capture,
    five replays) with the schedule stepped outside, deterministic kernels: the same
    losses and weights; the replays make no host sync."""
    device = torch.device("cuda")
    runs = []
    for captured in (False, True):
        setup_runtime(TrainConfig(deterministic=True, precision="fp32"), device)
        model = small_model(f"model.variant={variant}").to(device)
        cfg = OptimConfig(lr=0.01, warmup_steps=3)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, cfg, 8)

        def step(x: Tensor, y: Tensor, model: LanguageModel = model, opt=optimizer) -> Tensor:
            return train_step(model, opt, None, x, y, 1.0)

        run = CapturedStep(step, optimizer, device) if captured else step
        if not captured:
            prepare_optimizer(optimizer, device)  # the same rate tensor, eagerly
        gen = torch.Generator().manual_seed(3)
        losses = []
        for i in range(8):
            tokens = torch.randint(0, TINY_VOCAB, (2, 17), generator=gen).to(device)
            if captured and i > WARMUP_STEPS:  # replays (the capture itself synchronizes)
                torch.cuda.set_sync_debug_mode("error")
            try:
                losses.append(run(tokens[:, :-1], tokens[:, 1:]))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            scheduler.step()
        runs.append([*losses, torch.cat([p.detach().flatten() for p in model.parameters()])])
    torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-6, atol=1e-7)


def tiny_run(tmp: Path, *extra: str) -> dict[str, Any]:
    """A 12-step training run of a small hope model on a learnable token stream."""
    cfg = hope.load_config(
        None,
        [
            *SMALL, "model.variant=hope", "data.seq_len=16", "train.batch_size=4",
            "train.steps=12", "train.log_every=4", "train.val_every=6",
            "train.checkpoint_every=4", "train.val_batches=2", "train.wandb_mode=disabled",
            "optim.warmup_steps=3", *extra,
        ],
    )  # fmt: skip
    order = np.random.default_rng(0).permutation(TINY_VOCAB).astype(np.uint16)
    stream = np.tile(order, 40)
    train, val = ShardedTokens([stream]), ShardedTokens([stream[:300]])
    return run_training(cfg, train, val, tmp / "ckpt", tmp / "reports")


def test_the_trainer_refuses_graph_mode_off_cuda_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.cuda_graph=true needs a CUDA device"):
        tiny_run(tmp_path, "train.cuda_graph=true", "train.device=cpu")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "reports").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_captured_training_run_equals_the_eager_run(tmp_path: Path) -> None:
    """The trainer under train.cuda_graph: the eager run's losses; then a resume from its
    step-8 checkpoint (new optimizer tensors: three warm-up steps, capture again) ends
    the same."""
    eager = tiny_run(tmp_path / "eager", "train.device=cuda")
    graphed = tiny_run(tmp_path / "graphed", "train.device=cuda", "train.cuda_graph=true")
    for key in ("train_loss", "val_subset_loss"):
        assert graphed[key] == pytest.approx(eager[key], rel=1e-5)
    for path in sorted((tmp_path / "graphed" / "ckpt").glob("step_0000012*")):
        path.unlink()  # the last checkpoint gone: resume from step 8
    (tmp_path / "graphed" / "reports" / "train.json").unlink()
    resumed = tiny_run(tmp_path / "graphed", "train.device=cuda", "train.cuda_graph=true")
    assert resumed["val_subset_loss"] == pytest.approx(graphed["val_subset_loss"], rel=1e-6)


def test_the_bench_refuses_graph_mode_off_cuda_and_a_timed_capture() -> None:
    cfg = hope.load_config(None, ["bench.cuda_graph=true", "bench.device=cpu"])
    with pytest.raises(ConfigError, match="bench.cuda_graph=true needs a CUDA device"):
        check_bench_config(cfg.bench)
    if torch.cuda.is_available():
        cfg = hope.load_config(None, ["bench.cuda_graph=true", "bench.device=cuda"])
        with pytest.raises(ConfigError, match="bench.warmup=2 must exceed the 3"):
            check_bench_config(cfg.bench)


def test_a_batch_stays_as_it_is_on_the_cpu() -> None:
    batch = torch.arange(6).view(2, 3)
    assert upload(batch, CPU) is batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_a_batch_reaches_the_device_from_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training loop's upload on CUDA goes through pinned memory (a pageable copy
    may wait for the stream: a hidden sync per step)."""
    batch = torch.arange(6).view(2, 3)
    pinned: list[bool] = []
    pin = torch.Tensor.pin_memory

    def spy(self: Tensor, *args: Any) -> Tensor:
        out = pin(self, *args)
        pinned.append(out.is_pinned())
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", spy)
    got = upload(batch, torch.device("cuda"))
    assert pinned == [True] and torch.equal(got.cpu(), batch)

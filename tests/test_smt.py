"""Self-modifying Titans: chunked == token loop, streaming, batch, causality, gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import assert_states_close
from hope.memory.conv import CausalDepthwiseConv
from hope.memory.fast_state import restore_state
from hope.memory.residual_mlp import mlp_apply
from hope.memory.smt import SelfModifyingTitans
from hope.memory.smt_state import SMTState
from hope.model.config import ModelConfig

DT = torch.float64
T = 13  # odd: partial C_o and C_m chunks at the end


def _cfg(**overrides) -> ModelConfig:
    # A large eta_scale and low retention make every write visible at float64.
    base = dict(
        dim=8,
        n_heads=2,
        smt_expansion=2,
        smt_chunk=3,
        smt_mem_chunk=6,
        smt_eta_scale=0.05,
        smt_retention_init=0.9,
        smt_momentum=0.5,
        smt_conv_window=3,
    )
    return ModelConfig(**(base | overrides))


def _module(seed: int = 0, **overrides) -> SelfModifyingTitans:
    torch.manual_seed(seed)
    return SelfModifyingTitans(_cfg(**overrides).smt_config()).to(DT)


def _x(batch: int = 2, seq: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, seq, 8, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _state_tensors(state: SMTState) -> dict[str, torch.Tensor]:
    out = {
        f"{n}.{f.name}": getattr(m, f.name)
        for n, m in state.memories.items()
        for f in dataclasses.fields(m)
    }
    if state.conv_tail is not None:
        out["conv_tail"] = state.conv_tail
    for buffer in ("partial", "mem_pending"):
        pending = getattr(state, buffer)
        out |= {f"{buffer}.{f.name}": getattr(pending, f.name) for f in dataclasses.fields(pending)}
    return out


def _param_grads(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor | None]:
    names, params = zip(*module.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return dict(zip(names, grads, strict=True))


def _loss(y: torch.Tensor, state: SMTState) -> torch.Tensor:
    # Include the final state so gradients through the last writes are checked too.
    return y.pow(2).sum() + sum(t.pow(2).sum() for t in _state_tensors(state).values())


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"smt_objective": "dot", "smt_precondition": False, "smt_momentum": 0.0},
        {"smt_adaptive_q": True, "smt_chunk": 1, "smt_mem_chunk": 4},
        {"smt_chunk": 4, "smt_mem_chunk": 4, "smt_conv_window": 0},
        # One stacked group (every memory, scalar ones padded) with the fused read.
        {"smt_adaptive_q": True, "smt_chunk": 3, "smt_mem_chunk": 3, "smt_objective": "dot"},
    ],
)
def test_chunked_equals_token_loop_outputs_states_and_grads(overrides):
    module, x = _module(**overrides), _x()
    y_fast, s_fast = module(x, backend="torch")
    y_naive, s_naive = module(x, backend="naive")
    torch.testing.assert_close(y_fast, y_naive, rtol=0, atol=1e-10)
    assert_states_close(s_fast, s_naive, atol=1e-10)
    g_fast = _param_grads(module, _loss(y_fast, s_fast))
    g_naive = _param_grads(module, _loss(y_naive, s_naive))
    for name, g in g_fast.items():
        assert g is not None and g_naive[name] is not None, name
        torch.testing.assert_close(g, g_naive[name], rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize(
    "splits",
    [[6, 6, 1], [4, 1, 2, 5, 1], [1] * T],  # on the C_m grid, off every grid, token by token
)
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"smt_chunk": 3, "smt_mem_chunk": 3},
        {"smt_adaptive_q": True, "smt_checkpoint_chunks": 1},
    ],
)
def test_streaming_equals_one_call(splits, overrides):
    module, x = _module(**overrides), _x()
    y_one, s_one = module(x)
    state, parts = module.init_state(2), []
    for piece in x.split(splits, dim=1):
        y, state = module(piece, state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), y_one, rtol=0, atol=1e-12)
    assert_states_close(state, s_one, atol=1e-12)
    c_o, c_m = module.cfg.chunk, module.cfg.mem_chunk
    assert s_one.partial.length == T % c_o and s_one.chunks_done == T // c_o
    assert s_one.mem_pending.length == (T - T % c_o) % c_m


def test_reset_makes_the_pending_tokens_of_the_reset_sample_write_nothing():
    module, x = _module(), _x()
    _, state = module(x[:, :5])  # C_o = 3, C_m = 6: 2 partial tokens, 3 awaiting M_mem
    reset = restore_state(state, module.init_state(2), torch.tensor([True, False]))
    for buffer in ("partial", "mem_pending"):
        got, old = getattr(reset, buffer), getattr(state, buffer)
        assert torch.equal(got.k[1], old.k[1]) and got.k[0].abs().max() == 0
        assert torch.equal(got.alpha[0], torch.ones_like(got.alpha[0]))
    # The reset sample now writes only its new tokens: from the fresh state, as a
    # fresh context does, and reads the initial memories until its chunks complete.
    y, after = module(x[:, 5:7], reset)
    y_fresh, _ = module(x[:1, 5:6])
    torch.testing.assert_close(y[:1, :1], y_fresh, rtol=0, atol=1e-12)
    init = module.init_state(1)
    assert (after.memories["k"].w1[:1] - init.memories["k"].w1).abs().max() > 1e-6


def test_batch_equals_single_runs():
    module, x = _module(), _x(batch=3)
    y, state = module(x)
    for b in range(3):
        y_b, s_b = module(x[b : b + 1])
        torch.testing.assert_close(y[b : b + 1], y_b, rtol=0, atol=1e-12)
        assert_states_close(state.select(slice(b, b + 1)), s_b, atol=1e-12)


@pytest.mark.parametrize("t", [0, 5, 7, 12])
def test_causal_perturbing_later_tokens_keeps_earlier_outputs(t):
    module, x = _module(), _x()
    y, _ = module(x)
    x2 = x.clone()
    x2[:, t:] += torch.randn_like(x2[:, t:])
    y2, _ = module(x2)
    torch.testing.assert_close(y2[:, :t], y[:, :t], rtol=0, atol=1e-13)
    assert (y2[:, t] - y[:, t]).abs().max() > 1e-6


def test_forward_never_changes_parameters_and_writes_change_state():
    module, x = _module(), _x()
    before = {n: p.detach().clone() for n, p in module.state_dict().items()}
    init = module.init_state(2)
    _, state = module(x, init)
    for n, p in module.state_dict().items():
        assert torch.equal(p, before[n]), n
    for name, mem in state.memories.items():
        assert (mem.w1 - init.memories[name].w1).abs().max() > 1e-6, name
        # per-sample states diverge (different inputs per sample)
        assert (mem.w2[0] - mem.w2[1]).abs().max() > 1e-6, name


def test_full_write_grad_reaches_every_parameter():
    module = _module(write_grad="full")
    y, _ = module(_x())
    grads = _param_grads(module, y.pow(2).sum())
    assert {n.split(".")[1] for n in grads if n.startswith("inits.")} == {
        "k",
        "v",
        "eta",
        "alpha",
        "mem",
    }
    for name, g in grads.items():
        assert g is not None and g.abs().max() > 0, name


def test_stopgrad_leaves_write_only_parameters_without_gradient():
    """With every write detached, M_k/M_v/M_eta/M_alpha and b_alpha feed only
    writes, so they get exactly no gradient; M_mem, W_q, conv, W_o still learn
    through the reads (M_mem's initial state via the first C_m chunk)."""
    module = _module(write_grad="stopgrad")
    y, _ = module(_x())
    grads = _param_grads(module, y.pow(2).sum())
    dead = {
        n for n in grads if n.split(".")[:2] in (["inits", m] for m in ("k", "v", "eta", "alpha"))
    }
    dead.add("alpha_bias")
    assert len(dead) == 9
    for name, g in grads.items():
        if name in dead:
            assert g is None or not g.any(), name
        else:
            assert g is not None and g.abs().max() > 0, name


def test_truncated_write_grad_windows():
    """T=13, C_o=3 -> 5 chunks. A window of 5 detaches only after the last chunk
    (== full). A window of 3 cuts gradient paths, yet M_k's initial state still
    reaches the chunk-2 read through the M_mem write at the end of chunk 1. A
    window of 1 detaches M_mem right after that write, so M_k gets none."""
    x = _x()
    grads = {}
    for mode, window in [("full", 4), ("truncated", 5), ("truncated", 3), ("truncated", 1)]:
        module = _module(write_grad=mode, write_grad_window=window)
        y, _ = module(x)
        grads[(mode, window)] = _param_grads(module, y.pow(2).sum())
    full = grads[("full", 4)]
    for name, g in full.items():
        torch.testing.assert_close(grads[("truncated", 5)][name], g, rtol=0, atol=0, msg=name)
    mid, short = grads[("truncated", 3)]["inits.k.w2"], grads[("truncated", 1)]["inits.k.w2"]
    assert mid is not None and mid.abs().max() > 0
    assert (mid - full["inits.k.w2"]).abs().max() > 1e-8
    assert short is None or not short.any()


@pytest.mark.parametrize(
    ("span", "overrides"),
    [
        (1, {}),  # C_m = 2 C_o: M_mem's pending chunks cross every segment boundary
        (2, {}),  # segments of 2 chunks end mid C_m chunk and on it
        (4, {"smt_chunk": 4, "smt_mem_chunk": 4}),  # one stacked group, fused read
        (2, {"write_grad": "truncated", "write_grad_window": 3}),  # cuts inside segments
    ],
)
def test_checkpointed_chunk_loop_equals_the_plain_one(span, overrides):
    """Activation checkpointing recomputes segments in backward: same outputs, final
    state, and gradients for every parameter and the input."""
    plain = _module(**overrides)
    ckpt = _module(smt_checkpoint_chunks=span, **overrides)
    ckpt.load_state_dict(plain.state_dict())
    x = _x()
    _assert_same_run(_run_with_grads(ckpt, x), _run_with_grads(plain, x))


Run = tuple[torch.Tensor, SMTState, dict[str, torch.Tensor | None]]


def _run_with_grads(
    module: SelfModifyingTitans, x: torch.Tensor, backend: str | None = None
) -> Run:
    """Output, final state, and the gradients of ``_loss`` for every parameter and x."""
    x = x.clone().requires_grad_(True)
    y, state = module(x, backend=backend)
    names, params = zip(*module.named_parameters(), strict=True)
    grads = torch.autograd.grad(_loss(y, state), (*params, x), allow_unused=True)
    return y, state, dict(zip((*names, "input"), grads, strict=True))


def _assert_same_run(got: Run, ref: Run, atol: float = 1e-12) -> None:
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=atol)
    assert_states_close(got[1], ref[1], atol=atol)
    for name, g in ref[2].items():
        assert g is not None and got[2][name] is not None, name
        torch.testing.assert_close(got[2][name], g, rtol=0, atol=atol, msg=name)


def _saved_bytes(module: SelfModifyingTitans, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during a forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = module(x)
    y.sum().backward()  # the recomputation runs (and is checked) in backward
    return sum(storages.values())


def test_checkpointed_chunk_loop_saves_far_fewer_activations():
    """48 tokens in 16 C_o chunks: with segments of 4 chunks the forward saves no
    chunk-step activations (measured 13 KB vs 1.8 MB). The segments' boundary states,
    which the checkpoint keeps as its inputs, are outside this count."""
    x = _x(seq=48)
    plain = _saved_bytes(_module(), x)
    ckpt = _saved_bytes(_module(smt_checkpoint_chunks=4), x)
    assert ckpt < 0.1 * plain, (ckpt, plain)


@pytest.mark.usefixtures("compile_without_codegen")
def test_compiled_chunk_step_equals_eager():
    """backend="compile" runs the chunk step's generation and writes through
    torch.compile: same outputs, final state and gradients (C_m > C_o with pending
    chunks and a partial last chunk)."""
    module, x = _module(), _x()
    _assert_same_run(_run_with_grads(module, x, "compile"), _run_with_grads(module, x, "torch"))


@pytest.mark.usefixtures("compile_without_codegen")
def test_compiled_stacked_group_in_checkpointed_segments_equals_eager():
    """The compiled path with one stacked group (C_o = C_m: the read rides on M_mem's
    write) inside checkpointed segments."""
    module = _module(smt_chunk=4, smt_mem_chunk=4, smt_checkpoint_chunks=2)
    x = _x()
    _assert_same_run(_run_with_grads(module, x, "compile"), _run_with_grads(module, x, "torch"))


def test_chunk_at_least_sequence_reads_the_initial_memory_and_keeps_every_token_pending():
    module = _module(smt_chunk=16, smt_mem_chunk=16)
    x = _x()
    y, state = module(x)
    init = module.init_state(2)
    xc, _ = module.conv(x, init.conv_tail)
    heads = xc.reshape(2, T, 2, 4).transpose(1, 2)
    q = module._generate(init.memories, heads).q
    mem0 = init.memories["mem"]
    y_ref = module.w_o(mlp_apply(mem0.w1, mem0.w2, q, True).transpose(1, 2).reshape(2, T, 8))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-13)
    assert state.partial.length == T and state.chunks_done == 0
    for name, mem in state.memories.items():
        assert torch.equal(mem.w1, init.memories[name].w1), name
    _, completed = module(_x(seq=16 - T, seed=3), state)  # completes the chunk: one write
    assert completed.partial.length == 0 and completed.chunks_done == 1
    assert (completed.memories["mem"].w1 - mem0.w1).abs().max() > 1e-6


def test_fixed_q_has_no_query_memory_and_adaptive_q_writes_it():
    assert "q" not in _module().init_state(1).memories
    module = _module(smt_adaptive_q=True)
    init = module.init_state(2)
    _, state = module(_x(), init)
    assert (state.memories["q"].w2 - init.memories["q"].w2).abs().max() > 1e-6


def test_conv_is_causal_and_streams_with_tail():
    torch.manual_seed(3)
    conv = CausalDepthwiseConv(5, 4).to(DT)
    x = torch.randn(2, 11, 5, dtype=DT)
    y, tail = conv(x, conv.init_tail(2))
    y1, t1 = conv(x[:, :4], conv.init_tail(2))
    y2, t2 = conv(x[:, 4:], t1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=0, atol=1e-14)
    torch.testing.assert_close(t2, tail, rtol=0, atol=0)
    manual = sum(
        conv.weight[:, j] * torch.nn.functional.pad(x, (0, 0, 3 - j, 0))[:, :11] for j in range(4)
    )
    torch.testing.assert_close(y, manual, rtol=0, atol=1e-14)


def _norm_ratios(retention: float, eta_scale: float) -> dict[str, tuple[float, float]]:
    """||W1||, ||W2|| of every memory after 2,048 tokens of noise, over their init."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=16,
        n_heads=2,
        smt_expansion=1,
        smt_chunk=64,
        smt_mem_chunk=256,
        smt_retention_init=retention,
        smt_eta_scale=eta_scale,
    )
    module = SelfModifyingTitans(cfg.smt_config())
    init = module.init_state(1)
    with torch.no_grad():
        _, state = module(torch.randn(1, 2048, 16), init)
    return {
        n: (
            (m.w1.norm() / init.memories[n].w1.norm()).item(),
            (m.w2.norm() / init.memories[n].w2.norm()).item(),
        )
        for n, m in state.memories.items()
    }


def test_retention_at_init_over_2048_tokens():
    """Eq. 88 decays W toward 0 by alpha ~ r per token. At init every W1 stays within
    2x of its init (MECHANISMS §7 "init retention"): no norm grows. W2 also passes
    through the rank-1 preconditioner (alpha I - eta k k^T), which erases it along
    every written key: at the default eta scale (1, eq. 83) 2,048 tokens of noise
    erase it (the memory then reads as its residual skip plus what the writes put
    back), so §7's bound holds for W2 only with a small eta (1e-3: W2 tracks r^2048)."""
    default = ModelConfig()
    for name, (w1, w2) in _norm_ratios(default.smt_retention_init, default.smt_eta_scale).items():
        assert 0.5 < w1 < 2.0, (name, w1)  # MECHANISMS §7 "init retention"
        assert w2 < 0.01, (name, w2)  # erased along the written keys
    predicted = default.smt_retention_init**2048
    for name, (_, w2) in _norm_ratios(default.smt_retention_init, 1e-3).items():
        assert predicted / 2 < w2 < predicted * 2, (name, w2)
    for name, (w1, _) in _norm_ratios(0.995, default.smt_eta_scale).items():
        assert w1 < 1e-3, (name, w1)  # r^2048 = 3.5e-5: retention too low collapses W1


def test_bad_chunk_config_names_the_key():
    with pytest.raises(ValueError, match="smt_checkpoint_chunks=-1 must be >= 0"):
        SelfModifyingTitans(_cfg(smt_checkpoint_chunks=-1).smt_config())
    with pytest.raises(
        ValueError, match="smt_mem_chunk=10 must be a multiple of model.smt_chunk=4"
    ):
        SelfModifyingTitans(_cfg(smt_chunk=4, smt_mem_chunk=10).smt_config())

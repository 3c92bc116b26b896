"""Titans neural memory: chunked == token loop, streaming, batch, causality, gradients."""

from __future__ import annotations

import pytest
import torch

from hope.memory.residual_mlp import inner_loss
from hope.memory.titans_memory import NeuralMemory, NeuralMemoryState
from hope.model.config import ModelConfig

DT = torch.float64
T = 19  # odd: a partial final chunk


def _module(seed: int = 0, **overrides) -> NeuralMemory:
    torch.manual_seed(seed)
    cfg = ModelConfig(**(dict(dim=8, n_heads=2, smt_expansion=2, titans_chunk=4) | overrides))
    return NeuralMemory(cfg).to(DT)


def _x(batch: int = 2, seq: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, seq, 8, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _tensors(state: NeuralMemoryState) -> dict[str, torch.Tensor]:
    m = state.memory
    out = {"w1": m.w1, "w2": m.w2, "s1": m.m1, "s2": m.m2}
    if state.conv_tail is not None:
        out["tail"] = state.conv_tail
    return out


def _assert_states_close(a: NeuralMemoryState, b: NeuralMemoryState, atol: float) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and a.chunks_done == b.chunks_done
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], rtol=0, atol=atol, msg=name)


def _param_grads(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor | None]:
    names, params = zip(*module.named_parameters(), strict=True)
    return dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True), strict=True))


@pytest.mark.parametrize("overrides", [{}, {"titans_chunk": 1}, {"smt_conv_window": 0}])
def test_chunked_equals_token_loop_outputs_states_and_grads(overrides):
    module, x = _module(**overrides), _x()
    y_fast, s_fast = module(x, backend="torch")
    y_naive, s_naive = module(x, backend="naive")
    torch.testing.assert_close(y_fast, y_naive, rtol=0, atol=1e-10)
    _assert_states_close(s_fast, s_naive, atol=1e-10)

    def loss(y, s):
        return y.pow(2).sum() + sum(t.pow(2).sum() for t in _tensors(s).values())

    g_fast = _param_grads(module, loss(y_fast, s_fast))
    g_naive = _param_grads(module, loss(y_naive, s_naive))
    for name, g in g_fast.items():
        assert g is not None and g.abs().max() > 0, name
        torch.testing.assert_close(g, g_naive[name], rtol=0, atol=1e-10, msg=name)


def test_batch_equals_single_runs_and_streaming_equals_one_call():
    module, x = _module(), _x(batch=3)
    y, state = module(x)
    for b in range(3):
        y_b, s_b = module(x[b : b + 1])
        torch.testing.assert_close(y[b : b + 1], y_b, rtol=0, atol=1e-12)
        _assert_states_close(state.select(slice(b, b + 1)), s_b, atol=1e-12)
    chained, parts = module.init_state(3), []
    for lo, hi in [(0, 8), (8, 12), (12, T)]:
        y_part, chained = module(x[:, lo:hi], chained)
        parts.append(y_part)
    torch.testing.assert_close(torch.cat(parts, 1), y, rtol=0, atol=1e-12)
    _assert_states_close(chained, state, atol=1e-12)


@pytest.mark.parametrize("t", [3, 4, 10])
def test_causal_perturbing_later_tokens_keeps_earlier_outputs(t):
    module, x = _module(), _x()
    y, _ = module(x)
    x2 = x.clone()
    x2[:, t:] += torch.randn_like(x2[:, t:])
    y2, _ = module(x2)
    torch.testing.assert_close(y2[:, :t], y[:, :t], rtol=0, atol=1e-13)
    assert (y2[:, t] - y[:, t]).abs().max() > 1e-6


def test_writes_lower_memory_loss_and_never_touch_parameters():
    """Sign: after one chunk's write the memory fits its own (k, v) pairs better."""
    module, x = _module(titans_chunk=T), _x()
    with torch.no_grad():  # a small step theta ~ 1e-3: the first-order regime
        module.gates.bias[:2] = -7.0
    before = {n: p.detach().clone() for n, p in module.state_dict().items()}
    init = module.init_state(2)
    _, state = module(x, init)
    (q, k, v), _ = module._project(x, init.conv_tail)
    loss0 = inner_loss(init.memory.w1, init.memory.w2, k, v, "l2", True).sum(-1)
    loss1 = inner_loss(state.memory.w1, state.memory.w2, k, v, "l2", True).sum(-1)
    assert bool((loss1 < loss0).all()), (loss0, loss1)
    for n, p in module.state_dict().items():
        assert torch.equal(p, before[n]), n


def test_stopgrad_cuts_write_gradients():
    """With every write detached, the gates feed only writes, so they get no
    gradient; the meta init still learns through the first chunk's reads."""
    module = _module(write_grad="stopgrad")
    y, _ = module(_x())
    grads = _param_grads(module, y.pow(2).sum())
    for name in ("gates.weight", "gates.bias"):
        assert grads[name] is None or not grads[name].any(), name
    for name in ("init.w1", "init.w2", "w_o.weight"):
        assert grads[name] is not None and grads[name].abs().max() > 0, name

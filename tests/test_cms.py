"""CMS levels and chain (NL eqs. 30-31; MECHANISMS §2, §7, §8.3), float64, tiny sizes."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import F64
from conftest import rand64 as rand
from hope.memory.cms import CMSLevel
from hope.memory.cms_chain import CMS, split_hidden
from hope.memory.fast_state import restore_state
from hope.memory.ops.cms_online import naive_online_chain, naive_online_level
from hope.memory.ops.cms_scan import chunk_grad_sums
from hope.model.config import ModelConfig
from hope.optim.inner import (
    DeepMomentumRule,
    DGDRule,
    GDRule,
    InnerRule,
    MomentumRule,
    OrthoMomentumRule,
    PrecondMomentumRule,
)

DIM, HIDDEN = 5, 7


def make_level(period: int = 3, rule: InnerRule | None = None, **kw: object) -> CMSLevel:
    torch.manual_seed(0)
    rule = GDRule(0.2) if rule is None else rule
    return CMSLevel(DIM, HIDDEN, period, rule, init_std=0.4, **kw).to(F64)  # type: ignore[arg-type]


RULES = {
    "gd": lambda: GDRule(0.2),
    "gd_retention": lambda: GDRule(0.2, retention=0.9),
    "momentum": lambda: MomentumRule(0.1, retention=0.95, beta=0.8),
    "dgd_erase": lambda: DGDRule(0.1, erase=0.02, retention=0.97, beta=0.5),
    "orthogonal": lambda: OrthoMomentumRule(0.05, beta=0.7),
    "precond": lambda: PrecondMomentumRule(0.2, retention=0.95, beta=0.6, damping=0.5),
    "deep": lambda: DeepMomentumRule(0.3, retention=0.95, beta=0.6, width=3),
}


def test_grad_factors_equal_autograd_of_dot_objective() -> None:
    level = make_level()
    a, teach = rand(2, 4, DIM), rand(2, 4, DIM, seed=2)
    g_in, g_out, _ = chunk_grad_sums(a, teach, level.w_in, level.w_out)
    per_sample = []
    for b in range(2):  # Σ_t ⟨MLP(a_t), δ_t⟩ per sample, plain autograd
        objective = (level(a[b : b + 1]) * teach[b : b + 1]).sum()
        per_sample.append(torch.autograd.grad(objective, [level.w_in, level.w_out]))
    torch.testing.assert_close(g_in, torch.stack([g[0] for g in per_sample]), rtol=0, atol=1e-12)
    torch.testing.assert_close(g_out, torch.stack([g[1] for g in per_sample]), rtol=0, atol=1e-12)


def _run_both(level: CMSLevel, prefix: int, length: int) -> dict[str, list]:
    """teach_forward and the oracle from the same state (with ``prefix`` tokens pending)."""
    state = level.init_state(2, dtype=F64)
    if prefix:  # streaming: a first call leaves a partial chunk pending
        state = level.write(rand(2, prefix, DIM, seed=7), rand(2, prefix, DIM, seed=8), state)
    teach, weight = rand(2, length, DIM, seed=3), rand(2, length, DIM, seed=4)
    results: dict[str, list] = {}
    for name, fn in (("teach", level.teach_forward), ("online", None)):
        x = rand(2, length, DIM, seed=5).requires_grad_(True)
        if fn is None:
            y, new = naive_online_level(level, x, teach, state)
        else:
            y, new = fn(x, teach, state)
        grads = torch.autograd.grad((y * weight).sum(), [x, level.w_in, level.w_out])
        results[name] = [y, new.delta_in, new.delta_out, *grads, new.pending_inputs]
        results[name + "_state"] = [new]
    return results


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize(("prefix", "length"), [(0, 13), (2, 11), (1, 11)])
def test_teach_pass_equals_exact_online(rule: str, prefix: int, length: int) -> None:
    level = make_level(period=3, rule=RULES[rule]())
    res = _run_both(level, prefix, length)
    for fast, slow in zip(res["teach"], res["online"], strict=True):
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10)
    new = res["teach_state"][0]
    assert new.delta_in.abs().max() > 1e-3  # updates really happened
    assert new.boundaries == (prefix + length) // 3
    assert new.pending == (prefix + length) % 3


@pytest.mark.parametrize("layout", ["chain", "independent"])
def test_chain_teach_equals_online_and_gradients(layout: str) -> None:
    torch.manual_seed(0)
    rule = MomentumRule(0.1, beta=0.5)
    cms = CMS(DIM, [4, 3, 3], [2, 4, 8], rule, init_std=0.4, layout=layout).to(F64)  # type: ignore[arg-type]
    teaches = [rand(2, 13, DIM, seed=10 + i) for i in range(3)]
    weight = rand(2, 13, DIM, seed=20)
    outs = []
    for fn in (cms.teach_forward, None):
        x = rand(2, 13, DIM, seed=21).requires_grad_(True)
        state = cms.init_state(2, dtype=F64)
        if fn is None:
            y, new = naive_online_chain(cms, x, teaches, state)
        else:
            y, new = fn(x, teaches, state)
        grads = torch.autograd.grad((y * weight).sum(), [x, *cms.parameters()])
        outs.append([y, *grads, *(s.delta_in for s in new), *(s.delta_out for s in new)])
        assert [s.boundaries for s in new] == [6, 3, 1]
        assert min(s.delta_out.abs().max() for s in new) > 1e-4  # every level wrote
    for fast, slow in zip(*outs, strict=True):
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-10)


def test_cadence_counts_and_split_calls_equal_one_call() -> None:
    level = make_level(period=4)
    x, teach = rand(1, 19, DIM), rand(1, 19, DIM, seed=2)
    _, whole = level.teach_forward(x, teach, level.init_state(1, dtype=F64))
    assert (whole.boundaries, whole.pending) == (19 // 4, 19 % 4)
    state, outs = level.init_state(1, dtype=F64), []
    for start, stop in ((0, 3), (3, 5), (5, 14), (14, 19)):  # splits cut chunks anywhere
        y, state = level.teach_forward(x[:, start:stop], teach[:, start:stop], state)
        outs.append(y)
    y_whole, _ = level.teach_forward(x, teach, level.init_state(1, dtype=F64))
    torch.testing.assert_close(torch.cat(outs, 1), y_whole, rtol=0, atol=1e-12)
    assert (state.boundaries, state.pending) == (whole.boundaries, whole.pending)
    for name in ("delta_in", "delta_out", "pending_inputs", "pending_teach"):
        torch.testing.assert_close(getattr(state, name), getattr(whole, name), rtol=0, atol=1e-12)


def test_slow_level_fires_under_segmented_calls_and_keeps_partial_chunks_pending() -> None:
    level = make_level(period=8)
    state = level.init_state(1, dtype=F64)
    for seg in range(3):  # three 5-token segments: 15 tokens → one boundary at 8
        state = level.write(rand(1, 5, DIM, seed=seg), rand(1, 5, DIM, seed=9 + seg), state)
    assert (state.boundaries, state.pending) == (1, 7)
    assert state.delta_in.abs().max() > 0
    before = state.delta_in.clone()
    partial = level.write(rand(1, 1, DIM), rand(1, 1, DIM, seed=4), state)
    assert (partial.boundaries, partial.pending) == (2, 0)  # 7 + 1 = 8 exactly: a boundary
    kept = level.write(rand(1, 3, DIM), rand(1, 3, DIM, seed=4), partial)
    assert (kept.boundaries, kept.pending) == (2, 3)  # a partial chunk writes nothing yet
    torch.testing.assert_close(kept.delta_in, partial.delta_in, rtol=0, atol=0)
    completed = level.write(rand(1, 6, DIM), rand(1, 6, DIM, seed=5), kept)
    assert (completed.boundaries, completed.pending) == (3, 1)  # 3 + 6 = 9: one more
    assert (completed.delta_in - kept.delta_in).abs().max() > 0
    assert (before - state.delta_in).abs().max() == 0


def test_zero_teach_gives_no_update() -> None:
    level = make_level(period=2, rule=DGDRule(0.3, erase=0.0, beta=0.5))
    state = level.init_state(2, dtype=F64)
    _, new = level.teach_forward(rand(2, 9, DIM), torch.zeros(2, 9, DIM, dtype=F64), state)
    assert new.boundaries == 4
    assert new.delta_in.abs().max() == 0 and new.delta_out.abs().max() == 0


def test_zero_delta_forward_is_meta_forward_and_meta_untouched() -> None:
    level = make_level(period=2)
    meta = copy.deepcopy(level.state_dict())
    x = rand(2, 7, DIM)
    torch.testing.assert_close(level(x, level.init_state(2, dtype=F64)), level(x), rtol=0, atol=0)
    y, state = level.teach_forward(x, rand(2, 7, DIM, seed=3), level.init_state(2, dtype=F64))
    y.sum().backward()
    for key, value in level.state_dict().items():
        torch.testing.assert_close(value, meta[key], rtol=0, atol=0)
    assert level.w_in.grad is not None and level.w_in.grad.abs().max() > 0
    assert level.w_out.grad is not None and level.w_out.grad.abs().max() > 0
    assert not state.delta_in.requires_grad  # Δ written under stop-grad
    # A fresh state reproduces the meta outputs; a written state differs.
    assert (level(x, state) - level(x)).abs().max() > 1e-6


def test_batch_equals_single_runs() -> None:
    level = make_level(period=3, rule=MomentumRule(0.2, beta=0.6), surprise_threshold=1.5)
    x, teach = rand(3, 10, DIM), 0.8 * rand(3, 10, DIM, seed=2)
    y, state = level.teach_forward(x, teach, level.init_state(3, dtype=F64))
    for b in range(3):
        yb, sb = level.teach_forward(x[b : b + 1], teach[b : b + 1], level.init_state(1, dtype=F64))
        torch.testing.assert_close(y[b : b + 1], yb, rtol=0, atol=1e-12)
        for name in ("delta_in", "delta_out", "mom_in", "mom_out", "updates"):
            torch.testing.assert_close(
                getattr(state, name)[b], getattr(sb, name)[0], rtol=0, atol=1e-12
            )
    assert state.updates.min() < state.updates.max()  # the gate really differed per sample


@pytest.mark.parametrize("what", ["teach", "inputs"])
def test_causal_at_chunk_granularity(what: str) -> None:
    level, chunk, m = make_level(period=3), 3, 2  # perturb from the first token of chunk m+1
    x, teach = rand(1, 14, DIM), rand(1, 14, DIM, seed=2)
    y, _ = level.teach_forward(x, teach, level.init_state(1, dtype=F64))
    x2, teach2 = x.clone(), teach.clone()
    target = teach2 if what == "teach" else x2
    target[:, (m + 1) * chunk :] += rand(1, 14 - (m + 1) * chunk, DIM, seed=9)
    y2, _ = level.teach_forward(x2, teach2, level.init_state(1, dtype=F64))
    torch.testing.assert_close(y2[:, : (m + 1) * chunk], y[:, : (m + 1) * chunk], rtol=0, atol=0)
    if what == "inputs":  # the write of chunk m+1 changes chunk m+2 onwards
        assert (y2[:, (m + 2) * chunk :] - y[:, (m + 2) * chunk :]).abs().max() > 1e-6


@pytest.mark.parametrize("rule", ["gd", "momentum", "dgd_erase"])
def test_sign_one_update_lowers_loss_on_same_tokens(rule: str) -> None:
    level = make_level(period=6, rule=RULES[rule]())
    level.rule.lr = 1e-3
    x, target = rand(2, 6, DIM), rand(2, 6, DIM, seed=2)
    y0 = level(x)
    teach = y0 - target  # δ = ∂L/∂y of L = ½||y − target||²
    state = level.write(x, teach.detach(), level.init_state(2, dtype=F64))
    assert state.boundaries == 1
    loss0 = 0.5 * (y0 - target).pow(2).sum(dim=(1, 2))
    loss1 = 0.5 * (level(x, state) - target).pow(2).sum(dim=(1, 2))
    assert (loss1 < loss0 - 1e-6).all(), (loss0, loss1)


def test_chain_config() -> None:
    cfg = ModelConfig(dim=8, mlp_ratio=4.0, cms_periods=[2, 4, 7])
    with pytest.raises(ValueError, match="cms_periods"):
        CMS.from_config(cfg.cms_config())
    cfg.cms_periods = [2, 4, 8]
    cms = CMS.from_config(cfg.cms_config()).to(F64)
    assert [lvl.hidden for lvl in cms.levels] == [11, 11, 10] == split_hidden(32, 3)
    state = cms.init_state(1, dtype=F64)
    x = rand(1, 9, 8)
    y, new = cms.teach_forward(x, [rand(1, 9, 8, seed=i) for i in range(3)], state)
    assert [s.boundaries for s in new] == [4, 2, 1]
    assert (y - cms.read(x)[0]).abs().max() > 0  # the writes of chunks 1.. are read


def test_reset_is_per_sample() -> None:
    cms = CMS(DIM, [3, 3], [2, 4], GDRule(0.2), init_std=0.4).to(F64)
    x = rand(2, 9, DIM)
    _, state = cms.teach_forward(
        x, [rand(2, 9, DIM, seed=i) for i in range(2)], cms.init_state(2, dtype=F64)
    )
    reset = restore_state(state, cms.init_state(2, dtype=F64), torch.tensor([True, False]))
    for old, new in zip(state, reset, strict=True):
        assert new.delta_in[0].abs().max() == 0 and new.pending_teach[0].abs().max() == 0
        torch.testing.assert_close(new.delta_in[1], old.delta_in[1], rtol=0, atol=0)
        assert new.pending == old.pending


def test_independent_layout_reads_the_block_input_in_every_level() -> None:
    """layout=independent: y = x + Σ_ℓ MLP_ℓ(N_ℓ(x)), each level on the block input."""
    torch.manual_seed(0)
    cms = CMS(DIM, [4, 3], [2, 4], GDRule(0.1), init_std=0.4, layout="independent").to(F64)
    x = rand(2, 6, DIM, seed=30)
    want = x + sum(level(norm(x)) for norm, level in zip(cms.norms, cms.levels, strict=True))
    torch.testing.assert_close(cms.read(x)[0], want, rtol=0, atol=1e-14)
    chain = CMS(DIM, [4, 3], [2, 4], GDRule(0.1), init_std=0.4).to(F64)
    chain.load_state_dict(cms.state_dict())
    assert (chain.read(x)[0] - want).abs().max() > 1e-3  # the layouts really differ
    with pytest.raises(ValueError, match="layout"):
        CMS(DIM, [4], [2], GDRule(0.1), layout="nested")  # type: ignore[arg-type]

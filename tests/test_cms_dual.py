"""The dual CMS read (hope.memory.ops.cms_dual) equals the materialised per-chunk read:
outputs, meta-gradients and written state, float64 (MECHANISMS §8.3b "dual form")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.utils.flop_counter

from conftest import F64
from conftest import rand64 as rand
from hope.bench.measure import LaunchCounter
from hope.memory.cms import CMSLevel
from hope.memory.cms_state import LevelState, fresh_zeros, is_known_zero
from hope.memory.fast_state import tensor_leaves
from hope.memory.ops.cms_dual import (
    _device_table,
    _ungated_table,
    level_coefficients,
    linear_coefficients,
)
from hope.optim.inner import DGDRule, GDRule, InnerRule, MomentumRule
from hope.train.graphed import HostTensorAudit

DIM, HIDDEN = 5, 7

LINEAR_RULES = {
    "gd": lambda: GDRule(0.2),
    "gd_retention": lambda: GDRule(0.2, retention=0.9),
    "momentum": lambda: MomentumRule(0.1, retention=0.95, beta=0.8),
}


Run = tuple[torch.Tensor, tuple[torch.Tensor, ...], LevelState]


def level_pair(period: int, rule: InnerRule, **kw: Any) -> tuple[CMSLevel, CMSLevel]:
    levels = []
    for form in ("dual", "materialized"):
        torch.manual_seed(0)
        level = CMSLevel(DIM, HIDDEN, period, rule, init_std=0.4, read_form=form, **kw)
        levels.append(level.to(F64))
    return levels[0], levels[1]


def run(level: CMSLevel, x: torch.Tensor, teach: torch.Tensor, prefix: int, **kw: Any) -> Run:
    """Two calls: ``prefix`` tokens (carried Δ, momentum, pending buffer), then x."""
    state = level.init_state(2, dtype=F64)
    if prefix:
        _, state = level.teach_forward(
            rand(2, prefix, DIM, seed=7), rand(2, prefix, DIM, seed=8), state
        )
    x = x.clone().requires_grad_(True)
    y, new_state = level.teach_forward(x, teach, state, **kw)
    probe = rand(*y.shape, seed=9)
    grads = torch.autograd.grad((y * probe).sum(), [x, level.w_in, level.w_out])
    return y, grads, new_state


def assert_same(a: Run, b: Run) -> None:
    y, grads, state = a
    y_ref, grads_ref, state_ref = b
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert state.pending == state_ref.pending and state.boundaries == state_ref.boundaries
    leaves, leaves_ref = tensor_leaves(state), tensor_leaves(state_ref)
    assert len(leaves) == len(leaves_ref)
    for leaf, leaf_ref in zip(leaves, leaves_ref, strict=True):
        torch.testing.assert_close(leaf, leaf_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("prefix", (0, 2))
@pytest.mark.parametrize("period", (1, 3))
@pytest.mark.parametrize("rule", sorted(LINEAR_RULES))
def test_dual_read_equals_materialised_read(rule: str, period: int, prefix: int) -> None:
    dual, ref = level_pair(period, LINEAR_RULES[rule]())
    x, teach = rand(2, 13, DIM), rand(2, 13, DIM, seed=2)
    out = run(dual, x, teach, prefix % period)
    assert_same(out, run(ref, x, teach, prefix % period))
    # The writes are visible: the read differs from the θ0 MLP after the first chunk.
    assert (out[0] - dual(x)).abs().max() > 1e-3


def unmarked(state: LevelState) -> LevelState:
    """The same zeros as ``state``'s, as copies that carry no fresh mark."""

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    return replace(
        state,
        delta_in=state.delta_in.clone(),
        delta_out=state.delta_out.clone(),
        mom_in=copy(state.mom_in),
        mom_out=copy(state.mom_out),
    )


@pytest.mark.parametrize("rule", sorted(LINEAR_RULES))
def test_a_fresh_state_leaves_out_its_zero_delta_terms(rule: str) -> None:
    """A fresh state's Δ and m are marked zeros, so pass A's read and the dual read
    leave out their matmuls: same outputs, gradients and written state as reading the
    same zeros unmarked, in fewer launches."""
    level, _ = level_pair(3, LINEAR_RULES[rule]())
    x, teach = rand(2, 12, DIM), rand(2, 12, DIM, seed=2)
    fresh = level.init_state(2, dtype=F64)
    plain = unmarked(fresh)
    assert fresh.carries_nothing() and not plain.carries_nothing()
    runs, launches = [], []
    for state in (fresh, plain):
        xg = x.clone().requires_grad_(True)
        counter = LaunchCounter()
        with counter:
            y, written = level.teach_forward(xg, teach, state)
            read_a = level(xg, state)  # pass A: θ0 + Δ
        probe = rand(*y.shape, seed=9)
        grads = torch.autograd.grad(((y + read_a) * probe).sum(), [xg, level.w_in, level.w_out])
        runs.append((y + read_a, grads, written))
        launches.append(counter.count)
    assert_same(runs[0], runs[1])
    assert launches[0] < launches[1]
    assert not runs[0][2].carries_nothing()  # written: the next call reads its Δ


def test_known_zero_marks_do_not_survive_a_write() -> None:
    zeros = fresh_zeros(2, 3, device=torch.device("cpu"), dtype=F64)
    assert is_known_zero(zeros) and is_known_zero(None)
    assert not is_known_zero(zeros.clone()) and not is_known_zero(zeros.detach())
    assert not is_known_zero(torch.zeros(2, 3, dtype=F64))  # zeros, but not marked
    zeros[0].add_(1.0)  # in place, through a view
    assert not is_known_zero(zeros)


@pytest.mark.parametrize("prefix", (0, 2))
@pytest.mark.parametrize("rule", sorted(LINEAR_RULES))
def test_blocked_dual_read_equals_one_call(rule: str, prefix: int) -> None:
    """read_block: a 20-token call read in blocks of 6 (whole periods of 3, the first
    short by the pending tokens) equals the one-call dual read and the materialised
    read (outputs, gradients, written state), with surprise gates; each block scores
    only its own written tokens, so the blocked read launches more but multiplies
    fewer [T, F] elements."""
    runs = []
    for form, block in (("dual", 6), ("dual", 0), ("materialized", 6)):
        torch.manual_seed(0)
        level = CMSLevel(DIM, HIDDEN, 3, LINEAR_RULES[rule](), init_std=0.4, read_form=form,
                         read_block=block, surprise_threshold=1.2).to(F64)  # fmt: skip
        assert level._read_blocks(20, prefix) == (
            [slice(0, 6 - prefix), *(slice(a, min(a + 6, 20)) for a in range(6 - prefix, 20, 6))]
            if form == "dual" and block
            else [slice(0, 20)]
        )
        teach = rand(2, 20, DIM, seed=2)
        teach[0, 4:7] *= 0.01  # a closed gate
        runs.append(run(level, rand(2, 20, DIM), teach, prefix))
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])


def test_blocked_dual_read_multiplies_less() -> None:
    flops = []
    for block in (0, 6):
        torch.manual_seed(0)
        level = CMSLevel(DIM, HIDDEN, 3, GDRule(0.2), read_form="dual", read_block=block).to(F64)
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            run(level, rand(2, 48, DIM), rand(2, 48, DIM, seed=2), 0)
        flops.append(counter.get_total_flops())
    assert flops[1] < 0.6 * flops[0]


def test_dual_read_with_surprise_gates_and_a_pending_chunk() -> None:
    dual, ref = level_pair(3, MomentumRule(0.1, retention=0.9, beta=0.5), surprise_threshold=1.2)
    x, teach = rand(2, 11, DIM), rand(2, 11, DIM, seed=2)
    teach[0, 3:6] *= 0.01  # one closed gate in sample 0
    out = run(dual, x, teach, 1)
    assert_same(out, run(ref, x, teach, 1))
    assert out[2].pending == (1 + 11) % 3
    assert out[2].updates[0] < out[2].updates[1]  # the gate did close for sample 0


def test_auto_read_form_follows_rule_and_size() -> None:
    auto = CMSLevel(DIM, HIDDEN, 1, GDRule(0.1))
    layout = auto._layout(rand(1, 4, DIM), rand(1, 4, DIM), auto.init_state(1, dtype=F64),
                          None, None)  # fmt: skip
    assert auto.uses_dual_read(layout)  # L·F = 16 <= n·h·d = 140
    long = auto._layout(rand(1, 40, DIM), rand(1, 40, DIM), auto.init_state(1, dtype=F64),
                        None, None)  # fmt: skip
    assert not auto.uses_dual_read(long)  # 1600 > 1400
    erase = CMSLevel(DIM, HIDDEN, 1, DGDRule(0.1, erase=0.01))
    assert not erase.uses_dual_read(layout)
    with pytest.raises(ValueError, match="linear inner rule"):
        CMSLevel(DIM, HIDDEN, 1, DGDRule(0.1, erase=0.01), read_form="dual")


def _stepped_coefficients(
    rule: InnerRule, gates: torch.Tensor | None, n_fire: int, n_rows: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The twin of ``linear_coefficients``: the rule stepped n_fire times on one-hot
    gradients over the sources [Δ_0, m_0, G_1..G_F], gated per sample."""
    sources = 2 + n_fire
    delta = torch.zeros(batch, sources, dtype=F64)
    delta[:, 0] = 1.0
    momentum = None
    if rule.uses_momentum:
        momentum = torch.zeros(batch, sources, dtype=F64)
        momentum[:, 1] = 1.0
    rows = [delta]
    for j in range(n_fire):
        grad = torch.zeros(batch, sources, dtype=F64)
        grad[:, 2 + j] = 1.0
        gate = None if gates is None else gates[:, j]
        delta, momentum = rule.step(delta, momentum, grad, gate=gate)
        rows.append(delta)
    return torch.stack(rows[:n_rows], dim=1), delta, momentum


@pytest.mark.parametrize("rule", sorted(LINEAR_RULES))
@pytest.mark.parametrize(("n_fire", "n_rows"), [(0, 1), (1, 2), (5, 3), (13, 14)])
@pytest.mark.parametrize("gated", (False, True))
def test_closed_form_coefficients_equal_the_stepped_rule(
    rule: str, n_fire: int, n_rows: int, gated: bool
) -> None:
    """The closed form (powers of the rule's step, indexed by open-gate counts) equals
    stepping the rule update by update, gates closed for some samples and updates."""
    inner = LINEAR_RULES[rule]()
    gen = torch.Generator().manual_seed(n_fire)
    gates = torch.rand(3, n_fire, generator=gen) < 0.6 if gated else None
    like = torch.zeros(1, dtype=F64)
    got = linear_coefficients(inner, gates, n_fire, n_rows, 3, like)
    want = _stepped_coefficients(inner, gates, n_fire, n_rows, 3)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-14)
    if want[2] is None:
        assert got[2] is None
    else:
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-14)
    if gated and n_fire > 1:
        assert gates is not None and not bool(gates.all())  # some update was gated off


@pytest.mark.parametrize("rule", sorted(LINEAR_RULES))
@pytest.mark.parametrize("dtype", (torch.float32, F64))
def test_ungated_coefficients_come_from_one_host_table(rule: str, dtype: torch.dtype) -> None:
    """Without gates the coefficients are one sample's cached table, uploaded once and
    cloned per call, expanded over the batch: exactly the closed form's values, in the
    caller's dtype, and never the cached tensor itself (writing a result leaves the next
    call intact). The first call's host computation and upload are invisible to dispatch
    modes, so a launch count does not depend on whether the cache was warm; a warm call
    reads no host tensor (what a CUDA graph capture needs)."""
    inner = LINEAR_RULES[rule]()
    like = torch.zeros(1, dtype=dtype)
    want = linear_coefficients(inner, None, 9, 7, 3, like)
    _ungated_table.cache_clear()
    _device_table.cache_clear()
    for _ in range(3):  # cold, then twice from the cache
        with LaunchCounter() as counter:
            got = level_coefficients(inner, None, 9, 7, 3, like)
        assert counter.count == 1  # the clone of the device table; nothing per update or level
        for g, w in zip(got, want, strict=True):
            if w is None:
                assert g is None
                continue
            assert g is not None and g.dtype == dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert got[1]._base is not None  # a view of the one copied buffer
        got[1]._base.fill_(7.0)  # the next call must not see this
    meta = torch.zeros(1, dtype=dtype, device="meta")  # a device without a CUDA
    for _ in range(2):  # cold, then warm: no host tensor enters a device op
        with HostTensorAudit(meta.device) as audit:
            level_coefficients(inner, None, 9, 7, 3, meta)
        assert audit.found == []
    gates = torch.ones(3, 9, dtype=torch.bool)
    with LaunchCounter() as counter:
        gated = level_coefficients(inner, gates, 9, 7, 3, like)
    assert counter.count > 10  # gated: the per-sample form on the device
    torch.testing.assert_close(gated[0], want[0], rtol=0, atol=0)


@pytest.mark.parametrize("rule", sorted(LINEAR_RULES))
def test_linear_step_is_the_rules_own_update(rule: str) -> None:
    """(A, b) of ``linear_step`` reproduce ``rule.step`` on random states and gradients."""
    inner = LINEAR_RULES[rule]()
    step, drive = inner.linear_step()
    delta, grad = rand(4, 3, seed=1), rand(4, 3, seed=2)
    momentum = rand(4, 3, seed=3) if inner.uses_momentum else None
    state = [delta] if momentum is None else [delta, momentum]
    got = inner.step(delta, momentum, grad)
    for i, row in enumerate(step):
        want = sum(a * s for a, s in zip(row, state, strict=True)) + drive[i] * grad
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-15)
    assert len(step) == len(drive) == (2 if inner.uses_momentum else 1)
    with pytest.raises(NotImplementedError, match="not a linear rule"):
        DGDRule(0.1, erase=0.5).linear_step()

"""Streaming, batch and causality invariants of every variant and CMS mode, in one harness.

For each (variant, cms_mode), float64, the tiny mechanism shape of ``conftest.tiny_lm``
(CMS periods 4/8, SMT chunks 2/4, Titans chunk 4; T = 13, so every grid ends partial),
and HOPE's frozen-base reads (SMT write chunks 4, read every 2 tokens):

- read path (``forward``): one call == calls chained at any split == token by token,
  in logits and in the final state (titans_mac: at its segment boundaries only);
- teach path (``forward_teach``): ``exact_online``, ``static`` and the variants without
  a CMS: one call == calls chained on the C1 piece grid; ``teach_pass``: C1-token calls
  == one ``exact_online`` call (its definition, MECHANISMS §8.3b);
- a batch == its samples run alone (logits and states), on both paths;
- causality: tokens after t and targets from t on never change logits up to t;
- no forward changes a parameter or buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from conftest import TINY_VOCAB, assert_states_close, rand_tokens, select_samples, tiny_lm
from hope.model.lm import LanguageModel, LMState

T = 13
FROZEN = "/frozen"  # a mode suffix: model.smt_read_chunk inside write chunks (smt_frozen)
FROZEN_KNOBS = ("model.smt_chunk=4", "model.smt_mem_chunk=4", "model.smt_read_chunk=2")
C1 = 4  # the finest CMS period of tiny_lm: the teach path's piece grid
CASES = [
    ("transformer", None),
    *((v, m) for v in ("hope_attention", "hope") for m in ("teach_pass", "exact_online", "static")),
    # HOPE's throughput mode: M_mem read every 2 tokens inside 4-token write chunks
    *(("hope", f"{m}{FROZEN}") for m in ("teach_pass", "exact_online")),
    ("titans_lmm", None),
    ("titans_mal", None),
    ("titans_mag", None),
    ("titans_mac", None),
]
IDS = [f"{v}-{m}" if m else v for v, m in CASES]
ANY_SPLITS = ([3, 5, 1, 4], [1] * T)
SEGMENT_SPLITS = ([4, 8, 1], [4, 4, 4, 1])  # titans_mac continues only at segment bounds
PIECE_SPLITS = ([4, 8, 1], [8, 5])


def mode_knobs(mode: str | None) -> tuple[str, ...]:
    """The overrides of a case's mode: its cms_mode, and the frozen-read knobs."""
    if mode is None:
        return ()
    cms_mode, frozen, _ = mode.partition(FROZEN)
    return (f"model.cms_mode={cms_mode}", *(FROZEN_KNOBS if frozen else ()))


def _model(variant: str, mode: str | None) -> LanguageModel:
    return tiny_lm(variant, *mode_knobs(mode))


def _data(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return rand_tokens(batch, T, seed=1), rand_tokens(batch, T, seed=2)


Run = Callable[[torch.Tensor, torch.Tensor, LMState | None], tuple[torch.Tensor, LMState]]


def _paths(model: LanguageModel) -> dict[str, Run]:
    return {
        "read": lambda x, _y, state: model(x, state),
        "teach": lambda x, y, state: model.forward_teach(x, y, state),
    }


def _chained(run: Run, x: torch.Tensor, y: torch.Tensor, splits: list[int], state: LMState):
    logits = []
    for xs, ys in zip(x.split(splits, dim=1), y.split(splits, dim=1), strict=True):
        out, state = run(xs, ys, state)
        logits.append(out)
    return torch.cat(logits, dim=1), state


@pytest.mark.parametrize(("variant", "mode"), CASES, ids=IDS)
def test_read_path_streams_at_any_split(variant: str, mode: str | None) -> None:
    model = _model(variant, mode)
    x, y = _data()
    run = _paths(model)["read"]
    whole, whole_state = run(x, y, None)
    for splits in SEGMENT_SPLITS if variant == "titans_mac" else ANY_SPLITS:
        logits, state = _chained(run, x, y, splits, model.init_state(2))
        torch.testing.assert_close(logits, whole, rtol=0, atol=1e-10, msg=str(splits))
        assert_states_close(state, whole_state, atol=1e-10)


def test_titans_mac_refuses_a_split_inside_a_segment() -> None:
    model = _model("titans_mac", None)
    x, y = _data()
    with pytest.raises(ValueError, match="multiples of model.titans_chunk"):
        _chained(_paths(model)["read"], x, y, [3, 10], model.init_state(2))


@pytest.mark.parametrize(("variant", "mode"), CASES, ids=IDS)
def test_teach_path_streams_on_the_piece_grid(variant: str, mode: str | None) -> None:
    model = _model(variant, mode)
    x, y = _data()
    run = _paths(model)["teach"]
    if mode is not None and mode.startswith("teach_pass"):  # C1-token calls: the oracle
        oracle = _model(variant, mode.replace("teach_pass", "exact_online"))
        oracle.load_state_dict(model.state_dict())
        whole, whole_state = oracle.forward_teach(x, y)
        cases: tuple[list[int], ...] = ([C1, C1, C1, 1],)
    else:
        whole, whole_state = run(x, y, None)
        cases = PIECE_SPLITS
    for splits in cases:
        logits, state = _chained(run, x, y, splits, model.init_state(2))
        torch.testing.assert_close(logits, whole, rtol=1e-12, atol=1e-10, msg=str(splits))
        assert_states_close(state, whole_state, atol=1e-10)


@pytest.mark.parametrize("path", ["read", "teach"])
@pytest.mark.parametrize(("variant", "mode"), CASES, ids=IDS)
def test_a_batch_equals_its_samples_run_alone(variant: str, mode: str | None, path: str) -> None:
    model = _model(variant, mode)
    x, y = rand_tokens(3, T, seed=1), rand_tokens(3, T, seed=2)
    run = _paths(model)[path]
    batched, state = run(x, y, None)
    for b in range(3):
        alone, alone_state = run(x[b : b + 1], y[b : b + 1], None)
        torch.testing.assert_close(batched[b : b + 1], alone, rtol=0, atol=1e-12)
        assert_states_close(select_samples(state, slice(b, b + 1)), alone_state, atol=1e-12)


@pytest.mark.parametrize("path", ["read", "teach"])
@pytest.mark.parametrize(("variant", "mode"), CASES, ids=IDS)
def test_later_tokens_and_targets_never_change_earlier_logits(
    variant: str, mode: str | None, path: str
) -> None:
    model = _model(variant, mode)
    x, y = _data()
    run = _paths(model)[path]
    logits, _ = run(x, y, None)
    for t in (0, 3, 6, 11):  # piece/chunk starts, ends and insides
        x2, y2 = x.clone(), y.clone()
        x2[:, t + 1 :] = (x2[:, t + 1 :] + 5) % TINY_VOCAB
        y2[:, t:] = (y2[:, t:] + 7) % TINY_VOCAB
        perturbed, _ = run(x2, y2, None)
        torch.testing.assert_close(perturbed[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-12)
        assert (perturbed[:, t + 1 :] - logits[:, t + 1 :]).abs().max() > 1e-6  # not vacuous


@pytest.mark.parametrize(("variant", "mode"), CASES, ids=IDS)
def test_no_forward_changes_a_parameter_or_buffer(variant: str, mode: str | None) -> None:
    model = _model(variant, mode)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    x, y = _data()
    for train in (True, False):  # static CMS levels write only in eval mode
        model.train(train)
        _, state = model(x[:, :8])  # then continue at a segment boundary (titans_mac)
        model(x, state)
        _, state = model.forward_teach(x[:, :8], y[:, :8])
        model.forward_teach(x, y, state)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name

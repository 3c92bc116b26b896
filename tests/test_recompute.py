"""Checkpointing a function of nested states (``hope.memory.recompute``): every tensor
the arguments hold is saved as an input, where saved-tensor hooks (the memory
planner's ledger) see it, and values and gradients equal the plain call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from hope.config import load_config
from hope.memory.fast_state import tensor_leaves
from hope.memory.recompute import checkpointed, with_leaves
from hope.train.plan import measure, saved_bytes


@dataclass
class _State:
    weight: torch.Tensor  # [D, D], made in the forward: not a parameter
    scale: list[torch.Tensor]
    steps: int


def _fn(x: torch.Tensor, state: _State) -> torch.Tensor:
    return (x @ state.weight * state.scale[0]).sin().sum() * state.steps


class _Holder(torch.nn.Module):
    """A loss whose checkpointed part reads a state made from a parameter."""

    def __init__(self, wrap: str, dim: int = 16) -> None:
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(dim, dim, dtype=torch.float64))
        self.wrap = wrap

    def training_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = tokens.to(torch.float64).unsqueeze(-1).expand(*tokens.shape, self.base.shape[0])
        state = _State(self.base * 2.0, [self.base.sum().reshape(1)], 3)
        if self.wrap == "checkpointed":
            return checkpointed(_fn, x, state)
        if self.wrap == "torch":
            return checkpoint(_fn, x, state, use_reentrant=False)  # type: ignore[no-any-return]
        return _fn(x, state)


def test_leaves_round_trip_through_the_nesting() -> None:
    state = _State(torch.ones(2, 2), [torch.zeros(3)], 4)
    leaves = tensor_leaves((torch.full((1,), 5.0), state, "name"))
    assert [tuple(t.shape) for t in leaves] == [(1,), (2, 2), (3,)]
    rebuilt = with_leaves((None, state), [torch.full((2, 2), 7.0), torch.full((3,), 8.0)])
    assert rebuilt[1].weight[0, 0] == 7.0 and rebuilt[1].scale[0][0] == 8.0
    assert rebuilt[1].steps == 4 and state.weight[0, 0] == 1.0


def test_tensors_a_state_holds_are_saved_where_hooks_count_them() -> None:
    """Plain non-reentrant checkpointing keeps the dataclass's tensors by reference:
    the ledger misses the [D, D] weight. ``checkpointed`` saves it (and the [1] scale)."""
    tokens = torch.randint(0, 5, (2, 9))
    held = {wrap: saved_bytes(_Holder(wrap), tokens, None) for wrap in ("torch", "checkpointed")}
    assert held["checkpointed"] - held["torch"] == 16 * 16 * 8 + 8


def test_checkpointed_values_and_gradients_equal_the_plain_call() -> None:
    tokens = torch.randint(0, 5, (2, 9))
    grads, losses = {}, {}
    for wrap in ("plain", "checkpointed"):
        torch.manual_seed(0)
        model = _Holder(wrap)
        loss = model.training_loss(tokens, tokens)
        (grads[wrap],) = torch.autograd.grad(loss, [model.base])
        losses[wrap] = loss.detach()
    assert torch.equal(losses["plain"], losses["checkpointed"])
    torch.testing.assert_close(grads["plain"], grads["checkpointed"], rtol=1e-12, atol=1e-12)


def test_planner_counts_the_checkpointed_smt_carries() -> None:
    """Tiny preset, T = 128, 2 layers: with the SMT checkpointed every 2 chunks the
    plan holds each segment's carry (the stack of fast weights), which a ledger blind
    to it put at 6.4 MB per row; it is 11.4 MB, still a third of the 33.3 MB kept
    without checkpointing."""
    rows = {}
    for chunks in (0, 2):
        cfg = load_config(None, ["preset=tiny", f"model.smt_checkpoint_chunks={chunks}"])
        rows[chunks] = measure(cfg, (32, 64, 128), None).per_row(128, 2) / 2**20
    assert 10.5 < rows[2] < 12.5 and 32 < rows[0] < 35

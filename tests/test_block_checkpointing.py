"""model.checkpoint_blocks: every variant and CMS mode trains the same (float64 loss
and gradients) while keeping only each block's inputs for backward."""

from __future__ import annotations

import pytest
import torch

from conftest import rand_tokens, tiny_lm
from hope.memory.ops import dispatch
from hope.train.plan import saved_bytes
from test_streaming import CASES, IDS, T, mode_knobs


def _loss_and_grads(variant: str, mode: str | None, on: bool):
    extra = mode_knobs(mode)
    model = tiny_lm(variant, *extra, "model.n_layers=3", f"model.checkpoint_blocks={on}")
    model.train()
    tokens = rand_tokens(2, T + 1, seed=1)
    kept = saved_bytes(model, tokens, amp=None)
    loss = model.training_loss(tokens[:, :-1], tokens[:, 1:])
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss, dict(zip(names, grads, strict=True)), kept


@pytest.mark.parametrize(("variant", "mode"), CASES, ids=IDS)
def test_checkpointed_blocks_train_the_same_with_fewer_saved_activations(
    variant: str, mode: str | None
) -> None:
    loss, grads, plain = _loss_and_grads(variant, mode, on=False)
    loss_c, grads_c, kept = _loss_and_grads(variant, mode, on=True)
    torch.testing.assert_close(loss_c, loss, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        if grad is None:
            assert grads_c[name] is None, name
            continue
        torch.testing.assert_close(grads_c[name], grad, rtol=0, atol=1e-12, msg=name)
    if mode is not None and mode.startswith("exact_online"):  # its piece loop is not
        assert kept == plain
    else:
        print(f"{variant}-{mode}: saved {kept} of {plain} bytes")
        assert kept < 0.6 * plain, (kept, plain)


def test_fused_mac_checkpointed_blocks_train_the_same() -> None:
    """Under ``fused`` MAC's segments share their parameters through one autograd node
    whose backward reads its saved norm weights (``loop_shared``); block checkpointing
    recomputes that forward in backward and must give the same loss and gradients."""
    dispatch.set_default_backend("fused")
    try:
        loss, grads, _ = _loss_and_grads("titans_mac", None, on=False)
        loss_c, grads_c, _ = _loss_and_grads("titans_mac", None, on=True)
    finally:
        dispatch.set_default_backend("torch")
    torch.testing.assert_close(loss_c, loss, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        assert grad is not None and grads_c[name] is not None, name
        torch.testing.assert_close(grads_c[name], grad, rtol=0, atol=1e-12, msg=name)

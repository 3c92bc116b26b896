"""Titans variants (LMM, MAL, MAG, MAC): causality, batch, streaming, gradients, MAC/SWA masks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hope
from hope.bench.measure import count_host_syncs
from hope.memory.fast_state import tensor_leaves
from hope.memory.ops import dispatch
from hope.model.attention import CausalSelfAttention
from hope.model.lm import LanguageModel
from hope.model.sliding_attention import PersistentAttention, sliding_window_mask
from hope.model.titans import TitansMACBlock, TitansState
from hope.optim.outer import build_optimizer
from hope.train.step import train_step

VOCAB = 64
VARIANTS = ["titans_lmm", "titans_mal", "titans_mag", "titans_mac"]
WITH_ATTENTION = ["titans_mal", "titans_mag", "titans_mac"]
DT = torch.float64


def tiny_model(variant: str, seed: int = 0, *overrides: str) -> LanguageModel:
    cfg = hope.load_config(
        None,
        [
            f"model.variant={variant}",
            "model.dim=16",
            "model.n_layers=2",
            "model.n_heads=2",
            f"tokenizer.vocab_size={VOCAB}",
            "model.titans_chunk=4",
            "model.titans_persistent=2",
            "model.titans_window=6",
            *overrides,
        ],
    )
    torch.manual_seed(seed)
    return hope.build_model(cfg.model)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


def state_tensors(state: TitansState) -> dict[str, torch.Tensor]:
    mem = state.memory
    out = {f"memory{i}": t for i, t in enumerate(tensor_leaves(mem.memory))}
    if mem.conv_tail is not None:
        out["conv_tail"] = mem.conv_tail
    out |= {f"pending{i}": t for i, t in enumerate(mem.pending.parts())}
    if state.cache is not None:
        out["k"], out["v"] = state.cache.k, state.cache.v
    return out


def assert_states_close(a: TitansState, b: TitansState, atol: float) -> None:
    ta, tb = state_tensors(a), state_tensors(b)
    assert ta.keys() == tb.keys() and a.memory.chunks_done == b.memory.chunks_done
    for name in ta:
        torch.testing.assert_close(ta[name], tb[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize(
    ("variant", "depth"),
    [("titans_mac", 1), ("titans_lmm", 4)],  # depth 2: test_streaming.py
)
def test_perturbing_later_tokens_leaves_earlier_logits_unchanged(variant: str, depth: int) -> None:
    model = tiny_model(variant, 0, f"model.titans_depth={depth}").to(DT)
    x = tokens(2, 13)
    logits, _ = model(x)
    for t in (0, 2, 5, 11):  # inside / at the end of a segment, and in the partial one
        perturbed = x.clone()
        perturbed[:, t + 1 :] = (perturbed[:, t + 1 :] + 7) % VOCAB
        logits_p, _ = model(perturbed)
        torch.testing.assert_close(logits_p[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-12)
        assert (logits_p[:, t + 1 :] - logits[:, t + 1 :]).abs().amax(-1).min() > 1e-6


# Default depth at every split: test_streaming.py. Here: token by token at chunk 1 (the
# plain twin of the chunked one-call forward) and memories of depth L_M = 1 and 3.
STREAM_CASES = [(v, [1] * 13, ("model.titans_chunk=1",)) for v in VARIANTS] + [
    ("titans_lmm", [3, 6, 1, 3], ("model.titans_depth=1",)),
    ("titans_mac", [4, 4, 4, 1], ("model.titans_depth=3",)),
]


@pytest.mark.parametrize(("variant", "splits", "overrides"), STREAM_CASES)
def test_streaming_equals_one_call(
    variant: str, splits: list[int], overrides: tuple[str, ...]
) -> None:
    model = tiny_model(variant, 0, *overrides).to(DT)
    x = tokens(2, 13)
    full_logits, full_state = model(x)
    state, pieces, start = model.init_state(2), [], 0
    for size in splits:
        piece, state = model(x[:, start : start + size], state)
        pieces.append(piece)
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_logits, rtol=0, atol=1e-10)
    assert state.pos == full_state.pos == 13
    for streamed, whole in zip(state.blocks, full_state.blocks, strict=True):
        assert_states_close(streamed, whole, atol=1e-10)


@pytest.mark.parametrize("variant", ["titans_mag", "titans_mac"])
def test_streaming_gradients_equal_one_call_gradients(variant: str) -> None:
    model = tiny_model(variant).to(DT)
    x, y = tokens(2, 13), tokens(2, 13, seed=2)

    def grads(splits: list[int]) -> list[torch.Tensor]:
        model.zero_grad()
        state, pieces, start = model.init_state(2), [], 0
        for size in splits:
            piece, state = model(x[:, start : start + size], state)
            pieces.append(piece)
            start += size
        logits = torch.cat(pieces, dim=1)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for streamed, whole in zip(grads([8, 4, 1]), grads([13]), strict=True):
        torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-12)


def test_mac_rejects_a_split_inside_a_segment() -> None:
    model = tiny_model("titans_mac")
    _, state = model(tokens(1, 6))
    with pytest.raises(ValueError, match="multiples of model.titans_chunk=4"):
        model(tokens(1, 3), state)


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_backward_never_change_parameters(variant: str) -> None:
    model = tiny_model(variant)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = tokens(2, 13)
    _, state = model(x[:, :8])
    model(x[:, 8:], state)
    model.training_loss(x, x).backward()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize(
    ("variant", "depth"), [(v, 2) for v in VARIANTS] + [("titans_lmm", 1), ("titans_mac", 3)]
)
def test_every_parameter_gets_a_nonzero_gradient(variant: str, depth: int) -> None:
    # The memory gates (theta, eta, alpha) and W_K, W_V act only through the
    # writes, so this also checks that outer gradients flow through them.
    model = tiny_model(variant, 0, f"model.titans_depth={depth}").to(DT)
    n_init = len([n for n, _ in model.named_parameters() if "memory.init." in n])
    assert n_init == 2 * depth  # two layers, each with its W_1..W_L
    x = tokens(2, 13)
    model.training_loss(x, tokens(2, 13, seed=3)).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_overfitting_one_batch_lowers_the_loss(variant: str) -> None:
    model = tiny_model(variant)
    x, y = tokens(2, 16), tokens(2, 16, seed=4)
    first = model.training_loss(x, y).item()
    uniform = torch.log(torch.tensor(float(VOCAB))).item()
    assert first > uniform  # the default shell starts by predicting the token it reads
    optimizer = build_optimizer(model, hope.load_config(None, ["optim.lr=0.01"]).optim)
    for _ in range(30):
        optimizer.zero_grad()
        model.training_loss(x, y).backward()
        optimizer.step()
    assert model.training_loss(x, y).item() < 0.5 * uniform


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_step_makes_no_host_syncs(variant: str) -> None:
    model = tiny_model(variant)
    cfg = hope.load_config(None, ["optim.lr=0.01"])
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    x, y = tokens(2, 13), tokens(2, 13, seed=5)
    train_step(model, optimizer, scheduler, x, y, grad_clip=1.0)  # creates optimizer state
    before = [p.detach().clone() for p in model.parameters()]
    with count_host_syncs() as calls:
        loss = train_step(model, optimizer, scheduler, x, y, grad_clip=1.0)
        assert calls == []
        loss.item()
        assert calls == ["item"]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_mac_retrieval_reads_the_memory_from_before_its_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("titans_mac").to(DT)
    block: Any = model.blocks[0]
    assert isinstance(block, TitansMACBlock)
    reads: list[torch.Tensor] = []
    original = block.retrieve

    def recording(queries: torch.Tensor, fast: Any, w_o: Any = None) -> torch.Tensor:
        reads.append(original(queries, fast, w_o))
        return reads[-1]

    monkeypatch.setattr(block, "retrieve", recording)
    x = tokens(2, 12)
    model(x)
    h = list(reads)  # one [B, 4, d] per segment
    # h_1 equals M*_0(q(seg_1)) with M_0 the memory after segment 0 alone.
    _, after_first = model(x[:, :4])
    seg_1 = block.norm(model.embed(x[:, 4:8]))
    expected = original(block.retrieval_queries(seg_1), after_first.blocks[0].memory.memory)
    torch.testing.assert_close(h[1], expected, rtol=0, atol=1e-12)
    # Perturbing segment 1's last token: its own query changes, but the other
    # reads of segment 1 do not (no read of segment 1's own write); segment 2's do.
    reads.clear()
    perturbed = x.clone()
    perturbed[:, 7] = (perturbed[:, 7] + 5) % VOCAB
    model(perturbed)
    torch.testing.assert_close(reads[0], h[0], rtol=0, atol=0)
    torch.testing.assert_close(reads[1][:, :3], h[1][:, :3], rtol=0, atol=0)
    assert (reads[1][:, 3] - h[1][:, 3]).abs().max() > 1e-6
    assert (reads[2] - h[2]).abs().amax(-1).min() > 1e-9


@pytest.mark.parametrize("variant", WITH_ATTENTION)
def test_persistent_tokens_are_visible_to_every_query(variant: str) -> None:
    model = tiny_model(variant).to(DT)
    x = tokens(2, 13)
    logits, _ = model(x)
    with torch.no_grad():
        model.blocks[1].attn.persistent.add_(0.5)  # type: ignore[union-attr, operator]
    shifted, _ = model(x)
    # Every position, the first one included, depends on P through the last block.
    assert (shifted - logits).abs().amax(-1).min() > 1e-6


def swa(window: int, n_persistent: int = 2, qk_norm: bool = False) -> PersistentAttention:
    torch.manual_seed(0)
    module = PersistentAttention(16, 2, n_persistent, window, qk_norm=qk_norm).to(DT)
    for p in module.parameters():  # a non-trivial (non-identity norm) setting
        torch.nn.init.normal_(p, std=0.3)
    return module


def test_sliding_window_mask_values() -> None:
    mask = sliding_window_mask(past=2, length=3, window=3, device=torch.device("cpu"))
    expected = torch.tensor(
        [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )  # keys at -2, -1, 0, 1, 2 for queries 0, 1, 2
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_swa_without_persistent_tokens_and_a_long_window_is_causal_attention(
    qk_norm: bool,
) -> None:
    module = swa(window=64, n_persistent=0, qk_norm=qk_norm)
    reference = CausalSelfAttention(16, 2, qk_norm=qk_norm).to(DT)
    reference.load_state_dict(module.state_dict())
    x = torch.randn(2, 13, 16, dtype=DT, generator=torch.Generator().manual_seed(2))
    x.requires_grad_(True)
    y, _ = module(x, None, 3)
    y_ref, _ = reference(x, None, 3)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(y.pow(3).sum(), [x, *module.parameters()])
    grads_ref = torch.autograd.grad(y_ref.pow(3).sum(), [x, *reference.parameters()])
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


def test_swa_gives_zero_weight_to_keys_older_than_the_window() -> None:
    module = swa(window=6)
    x = torch.randn(1, 19, 16, dtype=DT, generator=torch.Generator().manual_seed(3))
    y, _ = module(x, None, 0)
    j = 4
    perturbed = x.clone()
    perturbed[:, j] += 1.0
    y_p, _ = module(perturbed, None, 0)
    torch.testing.assert_close(y_p[:, :j], y[:, :j], rtol=0, atol=0)  # causal
    assert (y_p[:, j : j + 6] - y[:, j : j + 6]).abs().amax(-1).min() > 1e-6  # in the window
    torch.testing.assert_close(y_p[:, j + 6 :], y[:, j + 6 :], rtol=0, atol=0)  # aged out


def test_swa_streaming_with_any_split_equals_one_call_and_bounds_the_cache() -> None:
    module = swa(window=6)
    x = torch.randn(2, 19, 16, dtype=DT, generator=torch.Generator().manual_seed(4))
    y, full_cache = module(x, None, 0)
    cache, pieces, start = module.init_state(2, x.device, DT), [], 0
    for size in [5, 1, 3, 10]:
        piece, cache = module(x[:, start : start + size], cache, start)
        assert cache.k.shape[2] == min(5, start + size)
        pieces.append(piece)
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), y, rtol=0, atol=1e-12)
    torch.testing.assert_close(cache.k, full_cache.k, rtol=0, atol=1e-12)


def test_mac_attention_sees_memory_tokens_causally_and_persistent_tokens_always() -> None:
    module = swa(window=6)
    gen = torch.Generator().manual_seed(5)
    h, x = (torch.randn(1, 4, 16, dtype=DT, generator=gen) for _ in range(2))

    def attend(h: torch.Tensor) -> torch.Tensor:  # one segment of 4 tokens at position 8
        return module.attend_segment(module.segment_context(x, 8, 4).segment(0), h)

    y = attend(h)
    # The memory tokens' k/v-only projection is the fused projection's k and v rows.
    rotary = module.rotary(8, 4, x)
    _, _, k_full, v_full = module._heads(h, rotary)
    k_h, v_h = module._key_value_heads(h, rotary)
    torch.testing.assert_close((k_h, v_h), (k_full, v_full), rtol=0, atol=1e-15)
    for j in range(4):
        h_p = h.clone()
        h_p[:, j] += 1.0
        y_p = attend(h_p)
        torch.testing.assert_close(y_p[:, :j], y[:, :j], rtol=0, atol=0)
        assert (y_p[:, j:] - y[:, j:]).abs().amax(-1).min() > 1e-6
    assert module.persistent is not None
    with torch.no_grad():
        module.persistent.add_(0.5)
    y_p = attend(h)
    assert (y_p - y).abs().amax(-1).min() > 1e-6


def test_memory_gate_biases_survive_the_model_init() -> None:
    model = tiny_model("titans_mag")
    block: Any = model.blocks[0]
    gates = torch.sigmoid(block.memory.gates.bias.detach())
    # theta at half its cap max_step(C) (see NeuralMemory.forward), eta, alpha
    expected = torch.tensor([0.5, 0.9, 0.005]).repeat_interleave(2)
    torch.testing.assert_close(gates, expected, rtol=1e-5, atol=1e-7)


def test_titans_variants_are_registered() -> None:
    assert set(VARIANTS) <= set(hope.VARIANTS)


def default_shape_model(variant: str) -> LanguageModel:
    """The tiny preset's shape: dim 128, 4 heads, chunk 16, vocab 4096 (fp32)."""
    cfg = hope.load_config(
        None,
        [f"model.variant={variant}", "tokenizer.vocab_size=4096"],
    )
    assert (cfg.model.dim, cfg.model.n_heads, cfg.model.n_layers) == (128, 4, 2)
    assert cfg.model.titans_chunk == 16
    torch.manual_seed(0)
    return hope.build_model(cfg.model)


@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_stays_bounded_over_512_tokens_at_the_default_shape(variant: str) -> None:
    """Regression: with theta ~ 0.05 unnormalised, titans_mac's fast weights grew
    1 -> 5 -> 202 -> 6e5 -> inf per 16-token segment (NaN logits from token 80)
    and titans_mag's second layer followed (NaN from token 96). Measured after
    the fix: peak norm / initial norm <= 1.3 for every variant and layer."""
    model = default_shape_model(variant)
    x = torch.randint(0, 4096, (2, 512), generator=torch.Generator().manual_seed(1))
    state = model.init_state(2)
    blocks: list[Any] = list(model.blocks)
    inits = [block.memory.init for block in blocks]
    initial = [torch.cat([m.w1.flatten(), m.w2.flatten()]).norm() for m in inits]
    with torch.no_grad():
        for start in range(0, 512, 128):
            logits, state = model(x[:, start : start + 128], state)
            assert torch.isfinite(logits).all(), start
            for layer, block_state in enumerate(state.blocks):
                fast = block_state.memory.memory
                norms = torch.cat([fast.w1.flatten(1), fast.w2.flatten(1)], dim=1).norm(dim=1)
                assert (norms < 3.0 * initial[layer]).all(), (start, layer, norms)


@pytest.mark.parametrize("variant", ["titans_mac", "titans_mag"])
def test_mac_and_mag_train_at_the_default_shape(variant: str) -> None:
    model = default_shape_model(variant)
    optimizer = build_optimizer(model, hope.load_config(None, ["optim.lr=0.003"]).optim)
    x = torch.randint(0, 4096, (2, 129), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = model.training_loss(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    curve = torch.stack(losses)
    assert torch.isfinite(curve).all(), curve
    assert (curve[1:] < curve[:-1]).all(), curve  # AdamW on one batch: strictly decreasing
    assert curve[-1] < curve[0] - 0.5, curve


@pytest.mark.usefixtures("compile_without_codegen")
def test_compiled_mac_segments_equal_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory backend "compile": each MAC segment's retrieval and attention are one
    compiled graph (the memory's chunk step another); same logits, state and gradients
    as eager, a partial last segment included (10 tokens, segments of 4)."""
    compiled_fns: list[Any] = []
    traced = dispatch._compiled
    monkeypatch.setattr(dispatch, "_compiled", lambda fn: compiled_fns.append(fn) or traced(fn))
    model = tiny_model("titans_mac").to(DT)
    x = tokens(2, 10)
    runs = {}
    for backend in ("torch", "compile"):
        monkeypatch.setattr(dispatch, "_default_backend", backend)
        logits, state = model(x)
        grads = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
        runs[backend] = (logits, state.blocks[1], grads)
    assert TitansMACBlock._mix in compiled_fns
    (y_t, s_t, g_t), (y_c, s_c, g_c) = runs["torch"], runs["compile"]
    torch.testing.assert_close(y_c, y_t, rtol=0, atol=1e-12)
    assert_states_close(s_c, s_t, atol=1e-12)
    for name, got, want in zip(dict(model.named_parameters()), g_c, g_t, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=name)

"""Scan form of a CMS level's chunk writes (NL eqs. 30-31; MECHANISMS §2, §8.3b).

The deltas in force during each chunk of a call, chunk by chunk: Δ_0 is the carried
state, Δ_{j+1} = rule(Δ_j, G_j) with G_j the chunk's summed gradient of
Σ_t ⟨MLP(a_t), δ_t⟩ at the chunk-start weights θ0 + Δ_j, in rank-1 form
(``chunk_grad_sums``). Twins: the dual form (``cms_dual``, linear rules: the same reads
without materialising Δ_n) and the online oracle (``cms_online``, token chunk by token
chunk through the level's read and write).
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn.functional as F
from torch import Tensor

from hope.layers import gelu_backward
from hope.memory.cms_state import ChunkLayout, LevelState
from hope.optim.inner import InnerRule


def chunk_grad_sums(
    inputs: Tensor, teach: Tensor, w_in: Tensor, w_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunk-summed gradients of Σ_t ⟨MLP(a_t), δ_t⟩ as rank-1 sums over t.

    inputs a, teach δ [..., C, d]; w_in [..., h, d]; w_out [..., d, h] (leading dims
    broadcast, so θ0 alone or per-sample θ0 + Δ both work).
    Returns G_in [..., h, d], G_out [..., d, h], hidden h [..., C, h] (the W_out inputs).
    """
    pre = inputs @ w_in.transpose(-1, -2)  # z [..., C, h]
    hidden = F.gelu(pre)
    g_out = teach.transpose(-1, -2) @ hidden  # Σ_t δ_t h_tᵀ  [..., d, h]
    back = gelu_backward(teach @ w_out, pre)  # W_outᵀδ_t ⊙ gelu′(z_t)  [..., C, h]
    g_in = back.transpose(-1, -2) @ inputs  # [..., h, d]
    return g_in, g_out, hidden


def scan_chunk_deltas(
    w_in: Tensor, w_out: Tensor, rule: InnerRule, layout: ChunkLayout, state: LevelState
) -> tuple[list[Tensor], list[Tensor], LevelState]:
    """Exclusive scan over the ``layout.n_fire`` written chunks: the deltas
    [Δ_0, ..., Δ_n] of W_in [B, h, d] and W_out [B, d, h], and the state after the last.
    ``w_in``/``w_out`` are θ0 as constants (the gradient is taken at θ0 + Δ_j)."""
    inputs_c, teach_c, gates = layout.inputs, layout.teach, layout.gates
    d_in, d_out, m_in, m_out = state.delta_in, state.delta_out, state.mom_in, state.mom_out
    deltas_in, deltas_out = [d_in], [d_out]
    for j in range(layout.n_fire):
        # The gradient at the chunk-start weights (NL eq. 31), [B, ., .].
        cur_in, cur_out = w_in + d_in, w_out + d_out
        g_in, g_out, hidden = chunk_grad_sums(inputs_c[:, j], teach_c[:, j], cur_in, cur_out)
        gate = None if gates is None else gates[:, j]
        d_in, m_in = rule.step(d_in, m_in, g_in, inputs_c[:, j], cur_in, gate)
        d_out, m_out = rule.step(d_out, m_out, g_out, hidden, cur_out, gate)
        deltas_in.append(d_in)
        deltas_out.append(d_out)
    final = replace(state, delta_in=d_in, delta_out=d_out, mom_in=m_in, mom_out=m_out)
    return deltas_in, deltas_out, final

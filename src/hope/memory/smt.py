"""Self-modifying Titans (SMT; NL-arXiv §8, eqs. ~83-94; MECHANISMS §3).

x [B, T, d] -> causal depthwise conv -> heads x~ [B, H, T, d_h]. Six residual
MLP memories M_k, M_v, M_q, M_eta, M_alpha, M_mem (M_q only with
``smt_adaptive_q``) are per-sample fast state; their initial states are meta
parameters. Per chunk of C_o tokens, with the chunk-start states:

  k = norm(M_k(x~)), v = norm(M_v(x~)), q = norm(x~ W_q)   (eq. 83; adaptive: M_q)
  eta = s_eta softplus(M_eta(x~)), alpha = sigmoid(M_alpha(x~) + b_alpha)
  o = M_mem(q)                                         (eq. 94; read before write)
  v_hat_m = M_m(v); DGD write of every memory m          (eqs. 84, 88)

M_mem is written every C_m tokens (a multiple of C_o) from its own C_m-chunk
start state; the others every C_o tokens. Streaming: the tokens of a partial C_o
chunk are generated and read at once (with their chunk's start states) and kept
pending, as are the C_o chunks since M_mem's last write; a later call completes
and writes them. So chained calls equal one call at any split, token by token
included, in outputs and in states.

Throughput mode (``smt_read_chunk`` = R < C_o = C_m): ``memory/smt_frozen.py``.

Outer gradients (``write_grad``): ``full`` keeps every write in the graph, so
all initial states, W_q, the conv, b_alpha and W_o are meta-learned (Ti-style);
``truncated`` detaches every memory after each ``write_grad_window``-th C_o
chunk; ``stopgrad`` detaches every write (Ref parity): then M_k, M_v, M_eta,
M_alpha and b_alpha feed only writes and get no gradient, and M_mem's initial
state gets gradient only from the reads of the first C_m chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.memory.chunk_loop import LoopPolicy, chunk_sizes, run_chunks
from hope.memory.config import SMTConfig
from hope.memory.conv import CausalDepthwiseConv
from hope.memory.ops.dispatch import dgd_write, resolve_backend, unit_rows
from hope.memory.ops.stacking import repeat_heads
from hope.memory.pieces import PieceGrid
from hope.memory.residual_mlp import (
    FastWeights,
    MemoryInit,
    Residual,
    chunk_pass,
    mlp_apply,
    stacked_apply,
)
from hope.memory.smt_frozen import frozen_segment, segment_reads
from hope.memory.smt_fused import fused_chunk_step, fused_walk, span_views, write_pending
from hope.memory.smt_state import (
    CallPlan,
    ChunkCarry,
    ChunkInputs,
    Generated,
    MemoryGroup,
    SMTState,
    bounded_eta,
    fused_group_write,
    generate_stacked,
    join_generated,
    stack_group,
    unstack_group,
)


class SelfModifyingTitans(nn.Module):
    def __init__(self, cfg: SMTConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.policy = LoopPolicy(cfg.write_grad, cfg.write_grad_window, cfg.checkpoint_chunks)
        self.n_heads, self.d_head = cfg.n_heads, cfg.dim // cfg.n_heads
        hidden = cfg.expansion * self.d_head
        self.conv = (
            CausalDepthwiseConv(cfg.dim, cfg.conv_window, cfg.init_std)
            if cfg.conv_window > 0
            else None
        )
        outs = {"k": self.d_head, "v": self.d_head}
        if cfg.adaptive_q:
            outs["q"] = self.d_head
        outs |= {"eta": 1, "alpha": 1, "mem": self.d_head}  # M_mem last (stacking order)
        self._outs = outs
        # 0/1 per memory and head (memory-major, in this order): which have the skip.
        flags = torch.tensor([float(d == self.d_head) for d in outs.values()])
        self.residual_scale: Tensor
        self.register_buffer(
            "residual_scale", flags.repeat_interleave(cfg.n_heads), persistent=False
        )
        self.inits = nn.ModuleDict(
            {
                n: MemoryInit(cfg.n_heads, self.d_head, hidden, d, cfg.init_std)
                for n, d in outs.items()
            }
        )
        # Fixed (non-adaptive) query map per head; M_q replaces it when adaptive.
        self.w_q = (
            None
            if cfg.adaptive_q
            else nn.Parameter(
                torch.randn(cfg.n_heads, self.d_head, self.d_head) / math.sqrt(self.d_head)
            )
        )
        # b_alpha makes sigmoid(.) ~ smt_retention_init at init (MECHANISMS §3 "Init").
        logit = math.log(cfg.retention_init / (1.0 - cfg.retention_init))
        self.alpha_bias = nn.Parameter(torch.full((cfg.n_heads,), logit))
        self.w_o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        nn.init.normal_(self.w_o.weight, std=cfg.init_std)

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> SMTState:
        mems = {n: cast(MemoryInit, init).init_state(batch_size) for n, init in self.inits.items()}
        tail = None if self.conv is None else self.conv.init_tail(batch_size)
        state = SMTState(mems, tail, self._no_tokens(batch_size), self._no_tokens(batch_size), 0)
        if device is not None and torch.device(device) != (here := self.alpha_bias.device):
            raise ValueError(f"init_state device {device} != module device {here}")
        return state

    def _no_tokens(self, batch_size: int) -> Generated:
        """An empty pending buffer (zero tokens). ``torch.zeros``, not ``new_zeros``: under
        per-block FSDP units the parameter is a sharded DTensor here."""
        dtype, device = self.alpha_bias.dtype, self.alpha_bias.device
        vec = torch.zeros(batch_size, self.n_heads, 0, self.d_head, dtype=dtype, device=device)
        gate = torch.zeros(batch_size, self.n_heads, 0, dtype=dtype, device=device)
        return Generated(vec, vec.clone(), vec.clone(), gate, gate.clone())

    def _group(self, names: tuple[str, ...]) -> MemoryGroup:
        outs = tuple(self._outs[n] for n in names)
        return MemoryGroup(names, tuple(d == self.d_head for d in outs), outs)

    def _plan(self, backend: str) -> tuple[MemoryGroup, ...]:
        """How the memories are stacked for one chunk step.

        The naive oracle keeps one group per memory (eq. 88 read literally). The
        fast path stacks every memory written every C_o tokens, scalar ones (eta,
        alpha) included, and M_mem too when C_m = C_o (it is then written at the
        same times from the same chunk): per chunk that is one MLP call for the
        generation, one for targets, factors and read, and one closed-form write.
        """
        if backend == "naive":
            return tuple(self._group((n,)) for n in self.inits)
        every_chunk = tuple(n for n in self.inits if n != "mem")
        if self.cfg.chunk == self.cfg.mem_chunk:
            return (self._group((*every_chunk, "mem")),)
        return (self._group(every_chunk), self._group(("mem",)))

    def _residual(self, group: MemoryGroup) -> Residual:
        """The members' residual flag: a bool when they agree, else a 0/1 scale over
        their stacked heads."""
        names, flags = group.names, group.residuals
        if all(flags) or not any(flags):
            return flags[0]
        order = tuple(self._outs)  # the buffer's order; mixed groups are runs of it
        first = order.index(names[0])
        if order[first : first + len(names)] != names:
            raise RuntimeError(f"stacked memories {names} are not a run of {order}")
        heads = slice(first * self.n_heads, (first + len(names)) * self.n_heads)
        return self.residual_scale[heads].view(1, -1, 1, 1)  # a view: no copy per chunk

    def _apply_members(
        self, fast: FastWeights, group: MemoryGroup, members: tuple[str, ...], z: Tensor
    ) -> dict[str, Tensor]:
        """M_m(z) for ``members`` of a stacked group; z [B, H, C, d_h].

        Every member is evaluated: slicing the stacked state to a subset makes bmm
        copy it, which costs more than the one spare member (M_mem during the
        generation): SMT fwd+bwd 4-6 % faster at the tiny and smoke shapes."""
        out = mlp_apply(fast.w1, fast.w2, repeat_heads(z, len(group.names)), self._residual(group))
        parts = dict(zip(group.names, out.split(self.n_heads, dim=1), strict=True))
        return {m: parts[m][..., : self._outs[m]] for m in members}

    def _generate(
        self,
        stacks: dict[str, FastWeights],
        xc: Tensor,
        plan: tuple[MemoryGroup, ...] | None = None,
        writes_need_grad: bool = True,
        backend: str | None = None,
        query: Tensor | None = None,
    ) -> Generated:
        """Eq. 83 with the chunk-start states. ``stacks`` maps each group's key to
        its stacked state; the default (per-memory) plan takes the memories dict.
        ``writes_need_grad=False``: k, v, eta, alpha feed only writes whose graph is
        not needed (pass A), so they are made without one; q keeps its graph.
        ``query``: xc W_q when the caller has it (fixed q)."""
        adaptive_q = self.w_q is None
        if query is None and self.w_q is not None:
            query = xc @ self.w_q
        gens = [g for g in plan or () if g.generators]
        if backend == "fused" and len(gens) == 1:  # one operator for M(x), one for the rest
            fast, residual = stacks[gens[0].key], self._residual(gens[0])
            spec = (query, self.alpha_bias, self.cfg.eta_scale, writes_need_grad or adaptive_q)
            return generate_stacked(fast, gens[0], residual, xc, *spec)
        with torch.set_grad_enabled(torch.is_grad_enabled() and (writes_need_grad or adaptive_q)):
            raw: dict[str, Tensor] = {}
            for group in plan or self._plan("naive"):
                if group.generators:
                    raw |= self._apply_members(stacks[group.key], group, group.generators, xc)
            k = unit_rows(raw["k"], backend)
            # v is only ever the input of the self-generated targets v_hat = M(v) (eq.
            # 84). Unnormalised, M_v(v) feeds back on itself: a write that raises M_v's
            # gain raises v and with it every target (targets 5 -> 228 -> 3e8 within
            # one 128-token context after ~100 outer steps of the tiny preset).
            # Normalising v like k (a deviation; docs/FAITHFULNESS.md) keeps the
            # targets' inputs on the unit sphere.
            v = unit_rows(raw["v"], backend)
            eta = self.cfg.eta_scale * F.softplus(raw["eta"].squeeze(-1))
            # The decay in the fast state's dtype whatever the parameters' (FSDP may
            # gather the block in bf16): log(alpha) and the C x C solve need it.
            work = next(iter(stacks.values())).w1.dtype
            alpha = torch.sigmoid(raw["alpha"].squeeze(-1).to(work) + self.alpha_bias[:, None])
        return Generated(k, v, unit_rows(raw["q"] if query is None else query, backend), eta, alpha)

    def _read(self, fast: FastWeights, group: MemoryGroup, q: Tensor, backend: str) -> Tensor:
        """o = M_mem(q) (eq. 94); M_mem is the last member of its group."""
        return stacked_apply(fast.w1, fast.w2, q, True, len(group.names) - 1, 1, backend == "fused")

    def _write(
        self,
        fast: FastWeights,
        group: MemoryGroup,
        gen: Generated,
        backend: str,
        read: bool = False,
    ) -> tuple[FastWeights, Tensor | None]:
        """DGD write (eq. 88) of every member of a group; they share k, v, eta, alpha.
        ``read``: also o = M_mem(q) from the same chunk-start state (read before write)."""
        n, residual, cfg = len(group.names), self._residual(group), self.cfg
        if backend == "fused" and cfg.precondition and not cfg.momentum:  # one operator
            new, reads = fused_group_write(fast, gen, residual, cfg.objective == "dot", read)
            return new, None if reads is None else reads[:, (n - 1) * self.n_heads :]
        # v_hat = M(v) with each member's chunk-start state (eq. 84): a constant of the
        # inner gradient (the factors treat it so) but in the outer graph, M_v's only
        # path to the loss. The curvature differs per member: each solves its own system.
        step = chunk_pass(
            fast.w1, fast.w2, gen.v, gen.k, gen.q if read else None, self.cfg.objective,
            residual, fused=backend == "fused", members=n,
        )  # fmt: skip
        new = dgd_write(
            fast, step.keys, step.target, bounded_eta(gen.eta, step.coupling, backend), gen.alpha,
            objective=self.cfg.objective, residual=residual,
            precondition=self.cfg.precondition, momentum=self.cfg.momentum,
            backend=backend, factors=step.factors,
        )  # fmt: skip
        if step.read is None:
            return new, None
        return new, step.read[:, (n - 1) * self.n_heads :]

    def _write_all(
        self, stacks: dict[str, FastWeights], loop: CallPlan, gen: Generated, keep: bool
    ) -> Tensor:
        """C_o = C_m: write every group (in place in ``stacks``) and return the chunk's
        read o = M_mem(q) at the chunk-start state. With the graph kept, the read rides
        on M_mem's write (one MLP call); else it is made apart, with its graph."""
        flush = loop.flush
        read = None if keep else self._read(stacks[flush.key], flush, gen.q, loop.backend)
        with torch.set_grad_enabled(torch.is_grad_enabled() and keep):
            for group in loop.plan:
                fused = keep and group is flush
                stacks[group.key], out = loop.write(
                    self, stacks[group.key], group, gen, loop.backend, fused
                )
                read = out if fused else read
        return cast(Tensor, read)

    def forward(
        self,
        x: Tensor,
        state: SMTState | None = None,
        backend: str | None = None,
        pieces: PieceGrid | None = None,
    ) -> tuple[Tensor, SMTState]:
        """x [B, T, d] -> (y [B, T, d], new state). Never mutates parameters.

        ``backend="naive"`` runs every write as a token loop (test oracle).
        ``pieces`` (teach pass A, MECHANISMS §8.3b): the same values, but no gradient
        path crosses a piece boundary. Within a chunk a token reaches no other token
        except through the conv (reads, targets and generation use the chunk-start
        states), so the conv reads other pieces detached and the memories are
        detached before a chunk whenever what they hold in graph began in an earlier
        piece. The state passed in must already be detached.
        """
        batch, seq, dim = x.shape
        if state is None:
            state = self.init_state(batch)
        backend = resolve_backend(backend)
        tail = state.conv_tail
        if self.conv is not None:
            assert tail is not None
            x, tail = self.conv(x, tail, pieces)
        heads = x.reshape(batch, seq, self.n_heads, self.d_head).transpose(1, 2)
        # x~ W_q for every token at once (a token's fixed query depends on it alone).
        queries = None if self.w_q is None else heads @ self.w_q
        plan, smt = self._plan(backend), SelfModifyingTitans
        steps = (smt._generate, smt._write, frozen_segment)
        loop = CallPlan.build(plan, backend, seq, pieces, steps)
        cfg = self.cfg
        if backend == "fused" and cfg.precondition and not (cfg.momentum or cfg.frozen):
            loop = replace(loop, step_bias=self.alpha_bias.expand(batch, self.n_heads))
        mem_pending = [state.mem_pending] if state.mem_pending.length else []
        partial = state.partial if state.partial.length else None
        carry = ChunkCarry(
            {g.key: stack_group(state.memories, g) for g in plan}, mem_pending,
            state.mem_pending.length, state.chunks_done, partial,
        )  # fmt: skip
        sizes = chunk_sizes(state.partial.length, seq, self.cfg.chunk)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        cuts = [heads.split(sizes, dim=2), [None] * len(sizes)]
        cuts[1] = cuts[1] if queries is None else list(queries.split(sizes, dim=2))
        chunks = list(zip(starts, zip(*cuts, strict=True), strict=True))

        def step(carry: ChunkCarry, start: int, xq: ChunkInputs) -> tuple[ChunkCarry, Tensor]:
            return self._chunk_step(carry, start, xq, loop)

        spans = span_views((heads, queries))

        def walk(
            carry: ChunkCarry,
            run: Sequence[tuple[int, ChunkInputs]],
            grid: PieceGrid | None,
            keep: bool,
        ) -> tuple[ChunkCarry, Tensor] | None:
            return fused_walk(self, carry, run, loop, spans, grid, keep)

        walks = walk if loop.step_bias is not None else None
        carry, reads = run_chunks(step, carry, chunks, self.policy, pieces, walks)
        out = torch.cat(reads, dim=2).transpose(1, 2).reshape(batch, seq, dim)
        mems: dict[str, FastWeights] = {}
        for group in plan:
            mems |= unstack_group(carry.stacks[group.key], group, self.n_heads)
        new_state = SMTState(
            {n: mems[n] for n in self.inits}, tail,
            carry.partial if carry.partial is not None else self._no_tokens(batch),
            join_generated(carry.pending) if carry.pending else self._no_tokens(batch),
            carry.chunks_done,
        )  # fmt: skip
        return self.w_o(out), new_state

    def _chunk_step(
        self, start_carry: ChunkCarry, start: int, xq: ChunkInputs, loop: CallPlan
    ) -> tuple[ChunkCarry, Tensor]:
        """One C_o chunk: generate (eq. 83), read (eq. 94), write (eq. 88). Returns the
        new carry (``start_carry`` is left as it was) and the read o [B, H, C_o, d_h].
        ``xq``: the chunk's x~ and x~ W_q (None with an adaptive query)."""
        xc, query = xq
        pieces, plan, flush, backend = loop.pieces, loop.plan, loop.flush, loop.backend
        carry = start_carry.copy()
        stop = start + xc.shape[2]
        # In pass A a write whose result is cut before anything reads it needs no
        # graph: only the read path (conv, q, M_mem at the cut state) carries δ.
        keep = pieces is None or (
            stop < loop.seq and pieces.piece_of(carry.live_from) == pieces.piece_of(stop)
        )
        stacks = carry.stacks
        if loop.step_bias is not None and carry.partial is None and stop - start == self.cfg.chunk:
            return fused_chunk_step(self, carry, xq, loop, loop.step_bias)  # one operator
        # Frozen reads take k, v, eta, alpha through M_mem's in-segment states.
        fresh = loop.generate(self, stacks, xc, plan, keep or self.cfg.frozen, backend, query)
        held = carry.partial
        gen = fresh if held is None else join_generated([held, fresh])
        at = (gen.length - fresh.length, start, carry.live_from)  # for frozen reads
        if gen.length < self.cfg.chunk:  # read now; written once a later call completes it
            carry.partial = gen
            if self.cfg.frozen:
                mem_stack = (stacks[flush.key], self._residual(flush))
                return carry, segment_reads(self.cfg, loop, mem_stack, gen, at)[0]
            return carry, self._read(stacks[flush.key], flush, fresh.q, backend)
        carry.partial = None
        if self.cfg.frozen:  # the chunk is a segment: M_mem read every R tokens inside it
            with torch.set_grad_enabled(torch.is_grad_enabled() and keep):
                for group in plan[:-1]:
                    stacks[group.key] = loop.write(self, stacks[group.key], group, gen, backend)[0]
            mem_stack = (stacks[flush.key], self._residual(flush))
            read, final = segment_reads(self.cfg, loop, mem_stack, gen, at, complete=True)
            assert final is not None
            stacks[flush.key] = final if keep else final.detach()
        elif self.cfg.chunk == self.cfg.mem_chunk:  # every group written every chunk
            read = self._write_all(stacks, loop, gen, keep)
            read = read if held is None else read[:, :, held.length :]
        else:
            read = self._read(stacks[flush.key], flush, fresh.q, backend)  # read before write
            with torch.set_grad_enabled(torch.is_grad_enabled() and keep):
                for group in plan:
                    if group is not flush:
                        stacks[group.key] = loop.write(
                            self, stacks[group.key], group, gen, backend
                        )[0]
                write_pending(self, carry, gen, loop)  # M_mem every C_m tokens
        carry.chunks_done += 1
        return carry, read

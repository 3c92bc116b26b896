"""A training step captured as one CUDA graph and replayed (``train.cuda_graph``).

Why: at the paper presets HOPE's and Titans' chunk recurrences launch tens of thousands
of small kernels per micro-batch (``reports/bench.json``, ``projection``): eagerly each
costs several microseconds of host time, replayed from a graph almost none (the
projection's ``graph`` figures; docs/PERFORMANCE.md).

How (PyTorch's whole-network capture, forward, backward, clipping and optimizer step):

- The first ``WARMUP_STEPS`` steps run eagerly on a side stream, so lazy state (the
  optimizer's moments, cached device tables, compiled and autotuned kernels) exists
  before capture. The last two run under ``HostTensorAudit``: an op that would read a
  host tensor inside the step (a pageable upload cannot be captured; a host tensor's
  value would be frozen into the graph), or two steps that dispatch different ops or
  arguments (a replay repeats one of them), stop the run naming the op and its source
  line, before capture instead of as a capture error or wrong numbers. The last one
  runs under CUDA's sync debug mode too: a host sync stops the run likewise.
- The next step is captured once on static input buffers and replayed for it and
  every later batch, copied into those buffers: the same kernels in the same order,
  so the same values as the eager step.
- What changes between steps stays outside the graph: each param group's learning
  rate lives in a device tensor that the scheduler fills after every step
  (``prepare_optimizer``), and the loss is cloned out of the graph's buffer.
- Whatever replaces the optimizer's or the model's tensors (a resume, a rewind) calls
  ``CapturedStep.reset``: the next steps warm up and capture again.

The step must be free of host syncs (the bench's and the tests' sync counts), of host
tensors and of per-step arguments (``HostTensorAudit``; tests/test_graph_capture.py
runs it for every variant, on the meta device and on the CPU, so a CPU catches what
would break a capture); world size 1, AdamW (fused and capturable: its step counters
live on the device).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from array import array
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hope.errors import ConfigError, StageError

WARMUP_STEPS = 3  # eager steps before capture (lazy state; the last two audited)

Step = Callable[[Tensor, Tensor], Tensor]

# Fused attention keeps its dropout RNG's seed and offset in host integer scalars
# (CUDA returns them on the CPU, the backward takes them back). Without dropout, as in
# every model here, no kernel reads them, so a capture holds nothing stale; any other
# host tensor of these ops (a mask, say) is still named. The audit refused every
# attention step on the H200 before this.
_PHILOX_HOST_OPS = {
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_backward,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
    torch.ops.aten._efficient_attention_forward,
    torch.ops.aten._efficient_attention_backward,
    torch.ops.aten._flash_attention_forward,
    torch.ops.aten._flash_attention_backward,
}


def _is_host_read(func: torch._ops.OpOverload, value: object) -> bool:
    """A host tensor that a captured op would read (fused attention's RNG seed and
    offset aside: ``_PHILOX_HOST_OPS``)."""
    if not isinstance(value, Tensor) or value.device.type != "cpu":
        return False
    rng_scalar = value.numel() <= 2 and not value.is_floating_point()
    return not (rng_scalar and func.overloadpacket in _PHILOX_HOST_OPS)


class HostTensorAudit(TorchDispatchMode):
    """Records what a CUDA graph of a step would get wrong, for every op dispatched
    while active (forward, and backward where the autograd engine runs on this thread):

    - ``found``: "op at file:line" for each op that takes or makes a host (CPU) tensor
      while the step runs on ``device`` (not the CPU; on the CPU nothing is a host
      tensor). Python scalars are not tensors here and are fine; a host tensor is
      not: copied in, it is an upload a capture cannot hold; computed on, it is work a
      replay would not redo. On the meta device a CPU checks a whole step without
      running it.
    - ``trace``: a hash of each op with its tensors' shapes, dtypes and devices and its
      other arguments. A replay repeats the captured step's trace; a step whose trace
      differs from ``before``'s (the audit of the step before: a learning rate passed
      as a number, a branch on a Python counter) would be replayed wrongly:
      ``departure`` says where, naming the first op that differs. Hashes, not the
      descriptions, are kept: a paper-scale step dispatches millions of ops."""

    def __init__(self, device: torch.device, before: HostTensorAudit | None = None) -> None:
        super().__init__()
        self.host_check = device.type != "cpu"
        self.found: list[str] = []
        self.trace = array("q")
        self.before = None if before is None else before.trace
        self.departs: str | None = None

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        described = ", ".join(map(_describe, pytree.tree_leaves((args, kwargs))))
        signature = f"{func}({described})"
        index = len(self.trace)
        self.trace.append(hash(signature))
        before = self.before
        if (
            before is not None
            and self.departs is None
            and before[index : index + 1] != self.trace[-1:]
        ):
            self.departs = (
                f"op {index}, {signature} at {_call_site()}, differs from the step before"
            )
        if self.host_check and any(
            _is_host_read(func, t) for t in pytree.tree_leaves((args, kwargs, out))
        ):
            self.found.append(f"{func} at {_call_site()}")
        return out

    def check(self, what: str) -> None:
        """Raise naming the first sites if any host tensor was seen."""
        if self.found:
            sites = "; ".join(dict.fromkeys(self.found))  # unique, in order
            raise StageError(
                f"{what}: the step reads host tensors, which a CUDA graph cannot capture "
                f"({len(self.found)} ops): {sites}. Move the tensor to the device once, "
                f"outside the step, or set {what}=false"
            )

    def departure(self) -> str | None:
        """Where this step's trace first departs from the step before's (after the
        step), or None: the same ops with the same arguments."""
        if self.departs is None and self.before is not None and self.before != self.trace:
            return f"{len(self.before)} ops became {len(self.trace)}"
        return self.departs


def _describe(leaf: Any) -> str:
    """A tensor's dtype, shape and device; a value's repr; an opaque object's type (the
    profiler's record handles: a new one per step, never an argument of a kernel)."""
    if isinstance(leaf, Tensor):
        return f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}@{leaf.device}"
    if leaf is None or isinstance(leaf, _VALUES):
        return repr(leaf)
    return type(leaf).__name__


_VALUES = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
           torch.memory_format)  # fmt: skip


def _call_site() -> str:
    """file:line of the innermost frame outside torch, the standard library and this
    module, or "backward" (the autograd engine runs the op with none on the stack)."""
    skip = (_TORCH_DIR, _STDLIB_DIR, __file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(skip):
            name = frame.filename.split("/src/")[-1].split("/tests/")[-1]
            return f"{name}:{frame.lineno}"
    return "backward"


_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(contextlib.__file__)


def prepare_optimizer(
    optimizer: torch.optim.Optimizer, device: torch.device, knob: str = "train.cuda_graph"
) -> None:
    """Make ``optimizer`` replayable: capturable, with each group's learning rate in a
    float32 tensor on ``device`` (the scheduler fills it in place, outside the graph;
    a float would be frozen into the captured kernel). Called after building and after
    every state load (a loaded group brings its saved lr and flags). float32, because
    the fused kernels read the rate so: the update differs from a double-precision rate
    by that rounding (about one float32 ulp of the weights over a few steps;
    tests/test_graph_capture.py)."""
    if not isinstance(optimizer, torch.optim.Adam) or not optimizer.defaults.get("fused"):
        raise ConfigError(
            f"{knob}=true needs the fused AdamW (optim.name=adamw), not "
            f"{type(optimizer).__name__}: its step keeps host-side state"
        )
    for group in optimizer.param_groups:
        lr = group["lr"]
        value = lr if isinstance(lr, Tensor) else torch.tensor(float(lr))
        group["lr"] = value.detach().to(device, torch.float32, copy=True)
        group["capturable"] = True


class CapturedStep:
    """``step(x, y) -> loss`` (one step of ``optimizer``, no scheduler step) warmed up,
    then captured as a CUDA graph and replayed; x, y [B, T] keep their shape and dtype
    for the whole run (the graph's input buffers). Prepares ``optimizer``
    (``prepare_optimizer``) now and at every ``reset``."""

    def __init__(
        self,
        step: Step,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        warmup: int = WARMUP_STEPS,
        knob: str = "train.cuda_graph",
    ) -> None:
        if device.type != "cuda":
            raise ConfigError(f"{knob}=true needs a CUDA device, not {device}")
        if warmup < 3:  # the optimizer's first step makes its state: compare 2 and 3
            raise ValueError(f"warmup={warmup}: at least three eager steps precede capture")
        self.step, self.optimizer, self.device = step, optimizer, device
        self.warmup, self.knob = warmup, knob
        prepare_optimizer(optimizer, device, knob)
        self.warmed = 0
        self.audits: list[HostTensorAudit] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[Tensor, Tensor] | None = None
        self.loss: Tensor | None = None

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        if self.graph is None and self.warmed < self.warmup:
            return self._eager(x, y)
        if self.graph is None or self.inputs is None or self.loss is None:
            self._capture(x, y)
        else:
            if (x.shape, y.shape) != (self.inputs[0].shape, self.inputs[1].shape):
                raise ValueError(
                    f"{self.knob}: the step was captured for batches of "
                    f"{tuple(self.inputs[0].shape)}, got {tuple(x.shape)}"
                )
            self.inputs[0].copy_(x)
            self.inputs[1].copy_(y)
        assert self.graph is not None and self.loss is not None
        self.graph.replay()
        return self.loss.clone()  # the graph's buffer is overwritten by the next replay

    def reset(self) -> None:
        """Forget the graph (its memory pool with it) and prepare the optimizer again:
        its state or the model's was loaded (new tensors, the saved lr and flags). The
        next steps warm up and capture again."""
        prepare_optimizer(self.optimizer, self.device, self.knob)
        self.graph, self.inputs, self.loss, self.warmed = None, None, None, 0
        self.audits = []

    def _eager(self, x: Tensor, y: Tensor) -> Tensor:
        """One warm-up step on a side stream; the last two are audited: no host tensor
        in either, and the same trace in both (so replaying it repeats the step)."""
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        audited = self.warmed >= self.warmup - 2
        before = self.audits[-1] if self.audits else None
        auditor = HostTensorAudit(self.device, before) if audited else None
        last = self.warmed == self.warmup - 1  # lazy set-up (autotuning, compiling) done
        with torch.cuda.stream(side), auditor or contextlib.nullcontext():
            loss = self._sync_free(x, y) if last else self.step(x, y)
        main.wait_stream(side)
        if auditor is not None:
            auditor.check(self.knob)
            departs = auditor.departure()
            if departs is not None:
                raise StageError(
                    f"{self.knob}: two consecutive steps dispatch different ops ({departs}); "
                    f"a replay would repeat the captured one. Pass what changes per step "
                    f"in a device tensor, or set {self.knob}=false"
                )
            self.audits = [auditor]
        self.warmed += 1
        return loss

    def _sync_free(self, x: Tensor, y: Tensor) -> Tensor:
        """The step under CUDA's sync debug mode: a host sync (a capture cannot wait for
        the host) stops the run naming it, instead of failing inside the capture."""
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self.step(x, y)
        except RuntimeError as err:
            if "synchroniz" not in str(err):
                raise
            raise StageError(
                f"{self.knob}: the step waits for the device ({err}); a CUDA graph cannot "
                f"capture that. Keep the value on the device, or set {self.knob}=false"
            ) from err
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    def _capture(self, x: Tensor, y: Tensor) -> None:
        inputs = (x.clone(), y.clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self.step(*inputs)
        self.graph, self.inputs, self.loss = graph, inputs, loss
        self.audits = []  # the traces are no longer needed

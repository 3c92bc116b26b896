"""Measuring one training step: wall time, peak memory, host-device syncs.

- Time: ``time.perf_counter`` around each whole step; on CUDA the device is
  synchronized at the timing boundaries only, outside the step.
- Memory: CUDA ``max_memory_allocated`` after a reset; on CPU the process's
  resident-set high-water mark. That mark is process-wide and only grows, so the
  bench runs each measurement in a fresh process; on Linux it is also reset
  (``/proc/self/clear_refs``) right before the model is built.
- Syncs: calls to the Tensor methods that copy a value to the host during one
  step, counted by patching them (the technique of tests/test_train_loop.py).
- Launches: the aten operators one step dispatches to a backend kernel (forward,
  backward, clipping, optimizer), counted with a ``TorchDispatchMode``: below
  autograd, so backward ops count; composite ops arrive already decomposed. View
  and metadata ops (no kernel: ``prim::`` ops, ``_unsafe_view``), bare allocations
  (``empty*``) and ops on empty tensors (a zero-token buffer: CUDA launches nothing
  for zero elements) do not count.
  In eager mode each counted op is one host-side launch (a foreach op is one
  launch over a list of tensors); it is the host cost a GPU step pays per call.
  Code inside ``torch.compile`` regions is not dispatched op by op (a dispatch mode
  even turns compilation off), so a compiled step on a CPU is counted from the
  profiler instead (``ProfiledLaunchCounter``): every kernel inductor generated
  (``cpp_fused_*``, named in the trace once ``enable_cpu_kernel_events`` is on before
  compiling), plus every outermost aten op that runs a kernel (extern calls such as
  ``mm`` from compiled code, and eager ops around the compiled regions). An op that
  decomposes above the backend (CompositeImplicitAutograd, no backend kernel) is
  looked through to the ops it runs, as the dispatch counter sees them. On an eager
  step both counters agree within 1%, the ops on empty tensors added to the dispatch
  count (the profiler sees no outputs; tests/test_bench.py; they differ where one
  name covers overloads that do and do not decompose, e.g. ``repeat_interleave``).
  On CUDA every backend is counted the same direct way instead
  (``CudaKernelCounter``): the kernels the profiler sees on the device during the
  step (generated Triton kernels, cuBLAS/cuDNN extern calls and eager kernels alike;
  memcpy/memset are not kernels).
"""

from __future__ import annotations

import contextlib
import functools
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import psutil
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hope.memory.ops.layouts import wrapper_launches

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
MB = 1024 * 1024


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Patch ``torch.Tensor`` sync methods; yields the list of method names called."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(name, original))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


_aten = torch.ops.aten
# Ops that allocate or describe tensors without running a kernel.
NO_KERNEL = frozenset(
    {
        _aten.empty,
        _aten.empty_strided,
        _aten.empty_like,
        _aten.detach,
        _aten.alias,
        _aten._unsafe_view,  # a view without autograd's view tracking (matmul's reshape)
        _aten.lift_fresh,
        _aten.sym_size,
        _aten.sym_stride,
        _aten.sym_numel,
        _aten.sym_storage_offset,
        _aten.is_same_size,
        _aten._has_compatible_shallow_copy_type,
    }
)


@functools.cache  # an op's answer never changes; counting asks per dispatched op
def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether dispatching ``func`` runs a backend kernel (not a view or metadata op;
    ``prim::`` ops such as ``prim.device`` only describe tensors, and an op that returns
    no tensor, such as ``promote_types``, computes on the host)."""
    if func.is_view or func.namespace == "prim" or func.overloadpacket in NO_KERNEL:
        return False
    return any("Tensor" in str(ret.type) for ret in func._schema.returns)


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel-launching ops dispatched while active (``count``): aten ops, and
    each fused ``hope::`` operator with the launches its CUDA wrapper makes besides
    its kernel: copies of strided arguments, fixed extra launches
    (``memory/ops/layouts.py``). An op whose outputs are all empty counts nothing
    (``writes_elements``); ``empty`` holds how many such launches were left out."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.empty = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's ``__torch_dispatch__`` so that Dynamo never traces it, a
        # wrapper called on every dispatched op, views included: a tenth of a counted
        # step's host time (hope at the pilot chunking, T = 1024: 4.7 -> 4.2 s, the same
        # count). Nothing counted here runs under torch.compile (a compiled step is
        # counted by ProfiledLaunchCounter).
        return False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_kernel(func):
            launches = 1 + wrapper_launches(func, args, kwargs)
            if writes_elements(out):
                self.count += launches
            else:
                self.empty += launches
        return out


def writes_elements(out: Any) -> bool:
    """Whether an op's result holds any element: an op whose outputs are all empty
    (a zero-token buffer, its clone or cat) returns before launching anything on CUDA
    (TensorIterator and the matmul/cat paths check numel first)."""
    if isinstance(out, torch.Tensor):  # most ops: no tree walk (counting is host-bound)
        return out.numel() > 0
    return any(
        leaf.numel() > 0 for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)
    )


def enable_cpu_kernel_events() -> None:
    """Name inductor's generated CPU kernels in profiler traces (``cpp_fused_*``
    events). Affects code generated afterwards, so call it before compiling."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True


_GENERATED_KERNEL = re.compile(r"(^|_)cpp_fused_")
_BACKEND_KEYS = (
    "CPU",
    "CUDA",
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
)


_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


@functools.cache
def _aten_event_kind(name: str) -> str:
    """'kernel', 'decomposes' (look at its children) or 'none' for a profiler event."""
    if _GENERATED_KERNEL.search(name):
        return "kernel"
    if not name.startswith("aten::"):
        return "none"
    packet = getattr(_aten, name.removeprefix("aten::"), None)
    if packet is None:
        return "none"
    overloads, backend_kernel = [], False
    # ``out=`` overloads may have kernels of their own where the functional op
    # decomposes (aten::linear); the trace names the packet only.
    names = packet.overloads()
    functional = [n for n in names if n != "out" and not n.endswith("_out")]
    for overload in functional or names:
        try:  # a listed overload may exist only in TorchScript (aten::to.prim_Device)
            op = getattr(packet, overload)
            has = [_has_kernel(op.name(), key) for key in _BACKEND_KEYS]
        except (AttributeError, RuntimeError):
            continue
        overloads.append(op)
        backend_kernel = backend_kernel or any(has)
    if not backend_kernel:
        return "decomposes"
    if not any(launches_kernel(op) for op in overloads):
        return "none"
    return "kernel"


def count_profiled_launches(events: Any) -> int:
    """Kernel launches among profiler CPU events (``ProfiledLaunchCounter``'s rule):
    generated kernels and kernel-running aten ops with no counted ancestor."""

    def counted(event: Any) -> bool:
        if _aten_event_kind(event.name) != "kernel":
            return False
        parent = event.cpu_parent
        while parent is not None:
            if _aten_event_kind(parent.name) == "kernel":
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for event in events if counted(event))


class _ProfilerCounter:
    """Counts events of a profiler run while active (``count``)."""

    def __init__(self) -> None:
        self.count = 0
        self._profile: Any = None

    def _activity(self) -> Any:
        raise NotImplementedError

    def _count(self, events: Any) -> int:
        raise NotImplementedError

    def __enter__(self) -> Self:
        from torch.profiler import profile

        self._profile = profile(activities=[self._activity()])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.__exit__(*exc)
        self.count = self._count(self._profile.events())


class ProfiledLaunchCounter(_ProfilerCounter):
    """Counts the kernel launches of a CPU step from the profiler: the rule for
    compiled regions, which a dispatch mode cannot see (module docstring)."""

    def _activity(self) -> Any:
        return torch.profiler.ProfilerActivity.CPU

    def _count(self, events: Any) -> int:
        return count_profiled_launches(events)


class CudaKernelCounter(_ProfilerCounter):
    """Counts the CUDA kernels launched while active, from the profiler's device-side
    events: what a compiled region really launches, per call."""

    def _activity(self) -> Any:
        return torch.profiler.ProfilerActivity.CUDA

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        super().__exit__(*exc)

    def _count(self, events: Any) -> int:
        return sum(
            1
            for event in events
            if event.device_type == torch.autograd.DeviceType.CUDA
            and not event.name.lower().startswith(("memcpy", "memset"))
        )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    step: Callable[[int], Any], warmup: int, steps: int, device: torch.device
) -> list[float]:
    """Run ``step(i)`` for i < warmup (untimed), then ``steps`` timed calls; seconds each."""
    for i in range(warmup):
        step(i)
    seconds: list[float] = []
    for i in range(warmup, warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step(i)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def current_rss_mb() -> float:
    return psutil.Process().memory_info().rss / MB


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """VmHWM from /proc/self/status, else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MB if sys.platform == "darwin" else peak * 1024 / MB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return peak_rss_mb()


def baseline_memory_mb(device: torch.device) -> float:
    """Memory in use before the model is built (CUDA allocated, or process RSS)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MB
    return current_rss_mb()

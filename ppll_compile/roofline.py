"""Roofline costs: every operator's FLOPs and bytes, and a device's calibrated rates, bandwidths and overhead.

An operator takes ``max(flops / rate, bytes / bandwidth) + overhead`` seconds on a device. Operators fall into
families that run at different fractions of the hardware's peak: ``matmul`` (matrix products), ``attention``
(fused attention), ``conv`` and ``conv_bwd`` (convolutions and their gradients) count FLOPs; ``norm`` (batch,
layer and group norm, which read their input more than once), ``math`` (transcendental activations and
softmax), ``pool``, ``memory`` (everything else: element-wise arithmetic, copies, reductions) and ``step`` (an
optimizer's update) are bound by the bytes they read and write. Each family's rate is measured by a short
micro-benchmark of a representative operator (about a second in all). A compute-family operator's efficiency
depends on its shape far more than a family rate can say (a convolution over 1x1 feature maps runs at a
fraction of one over 16x16), so each distinct shape a plan meets is also timed once on the device
(:func:`measure_calls`, milliseconds each) and that time replaces its roofline estimate.

Everything measured is cached under the user's cache directory, keyed by the device's name, its thread count
(CPU) and the torch version. ``PPLL_DEVICE_FIGURES=path.json`` pins the figures instead (reproducible plans on
any machine): a JSON object with the fields of :class:`DeviceFigures`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from .allocator import keep_freed_memory
from .errors import PlanError
from .flops import EXTRA_FORMULAS
from .optimizers import optimizer_spec

__all__ = ["Op", "OpLog", "DeviceFigures", "FAMILIES", "device_figures", "calibrate", "measure_calls", "cache_path",
           "seconds", "step_ops", "FIGURES_ENV", "CACHE_ENV"]

FIGURES_ENV = "PPLL_DEVICE_FIGURES"
"""Environment variable naming a JSON file of :class:`DeviceFigures` that every plan uses instead of calibrating."""
CACHE_ENV = "PPLL_CACHE_DIR"
"""Environment variable overriding the cache directory (default ``$XDG_CACHE_HOME/ppll-compile`` or
``~/.cache/ppll-compile``)."""

FAMILIES = ("matmul", "attention", "conv", "conv_bwd", "norm", "math", "pool", "memory", "step")
"""Operator families, each with its own calibrated rate: FLOP/s for the first four, bytes/s for the others
(``step``: an optimizer's update of parameters and state, streamed from memory)."""
_COMPUTE = FAMILIES[:4]
_REGISTRY = {**flop_registry, **{k: shape_wrapper(v) for k, v in EXTRA_FORMULAS.items()}}
_BY_NAME = {
    "conv": ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution"),
    "conv_bwd": ("convolution_backward",),
    "norm": ("native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
             "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "batch_norm_backward",
             "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
             "_fused_rms_norm", "_fused_rms_norm_backward"),
    "math": ("gelu", "gelu_backward", "silu", "silu_backward", "sigmoid", "sigmoid_backward", "tanh",
             "tanh_backward", "exp", "log", "erf", "pow", "rsqrt", "sqrt", "_softmax", "_softmax_backward_data",
             "_log_softmax", "_log_softmax_backward_data", "mish", "mish_backward", "hardswish",
             "hardswish_backward"),
    "pool": ("max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
             "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "max_pool3d_with_indices",
             "max_pool3d_with_indices_backward", "avg_pool3d", "avg_pool3d_backward", "_adaptive_avg_pool3d",
             "_adaptive_avg_pool3d_backward", "upsample_bilinear2d", "upsample_nearest2d",
             "upsample_bilinear2d_backward", "upsample_nearest2d_backward"),
}
_FAMILY = {name: family for family, names in _BY_NAME.items() for name in names}
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "_unsafe_view", "set_", "resize_", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
         "is_same_size", "_has_compatible_shallow_copy_type"}
"""Operators that run no kernel (allocations, metadata), beside views."""


@dataclass(frozen=True)
class Op:
    """One operator run: its family (one of :data:`FAMILIES`), dtype, FLOPs and bytes read plus written."""

    kind: str
    dtype: str
    flops: int
    bytes: int
    call: tuple[Any, ...] = ()
    """A compute family's operator as it was called: its name and every argument, a tensor as ``("T", shape,
    stride, dtype)``; what :func:`measure_calls` re-creates and times. Empty for memory-bound operators."""


def _is_view(func: Any) -> bool:
    """Whether an operator only makes a view (its output aliases an input and nothing is written): no kernel."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class OpLog(TorchDispatchMode):
    """Records an :class:`Op` for every operator that runs a kernel (views and allocations run none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in _FREE or _is_view(func):
            return out
        seen: dict[int, Tensor] = {}
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, Tensor):
                seen.setdefault(id(t), t)
        tensors = list(seen.values())
        formula = _REGISTRY.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        kind = _FAMILY.get(name) or ("attention" if "attention" in name else "matmul" if flops else "memory")
        floating = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        call = (str(func), _describe(args), _describe(kwargs)) if kind in _COMPUTE else ()
        self.ops.append(Op(kind, str(floating).removeprefix("torch."), flops, sum(_nbytes(t) for t in tensors), call))
        return out


def _describe(value: Any) -> Any:
    """Arguments as hashable plain data: a tensor as ``("T", shape, stride, dtype)``, sequences as tuples."""
    if isinstance(value, Tensor):
        return "T", tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride()), \
            str(value.dtype).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return "K", tuple(sorted((k, _describe(v)) for k, v in value.items()))
    if isinstance(value, (torch.device, torch.dtype, torch.layout, torch.memory_format)):
        return "D", str(value)
    return value


def _rebuild(value: Any, device: torch.device) -> Any:
    """Real tensors (random values) and arguments from :func:`_describe`'s description, on ``device``."""
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "T":
        _, shape, stride, dtype = value
        t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
        return t.normal_() if t.is_floating_point() else t.zero_()
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "K":
        return {k: _rebuild(v, device) for k, v in value[1]}
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "D":
        text = value[1]
        return getattr(torch, text.removeprefix("torch.")) if text.startswith("torch.") else torch.device(text)
    if isinstance(value, tuple):
        return [_rebuild(v, device) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class DeviceFigures:
    """What one device does per second, measured by :func:`calibrate`."""

    device: str
    """The device's name (a CPU's model name and thread count, a GPU's name)."""
    torch: str
    """The torch version measured with."""
    rates: dict[str, float] = field(default_factory=dict)
    """By ``family:dtype`` (``matmul:float32``, ``norm:float32``, ...): FLOP/s of a compute family, bytes/s of a
    memory-bound one."""
    calls: dict[str, float] = field(default_factory=dict)
    """Seconds of compute-family operators measured at their own shapes (see :func:`measure_calls`), by
    ``repr(op.call)``: a matrix product's or a convolution's rate depends on its shape."""
    overhead: float = 5e-6
    """Seconds every operator costs beyond its work (dispatch, launch)."""
    source: str = "measured"
    """Where the figures came from: ``measured``, ``cache`` or a pinned file's path."""

    def rate(self, family: str, dtype: str) -> float:
        """The rate of ``family`` at ``dtype`` (float32's when that dtype was not measured)."""
        return self.rates.get(f"{family}:{dtype}") or self.rates[f"{family}:float32"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record(self) -> dict[str, Any]:
        """The figures as a plan records them: the per-call seconds counted, not listed."""
        return {**{k: v for k, v in self.to_dict().items() if k != "calls"}, "timed_calls": len(self.calls)}

    def describe(self) -> str:
        """One line for a plan's notes."""
        timed = f", {len(self.calls)} operator shapes timed" if self.calls else ""
        source = f"pinned by {Path(self.source).name}" if self.source not in ("measured", "cache") else self.source
        return (f"costs are seconds on {self.device} (roofline, {source} figures: "
                f"{self.rate('matmul', 'float32') / 1e9:.0f} GFLOP/s matmul, "
                f"{self.rate('memory', 'float32') / 1e9:.0f} GB/s memory{timed})")


def seconds(ops: Iterable[Op], figures: DeviceFigures) -> float:
    """Seconds of ``ops`` on the device: per operator its time measured at its shape when the figures hold one,
    else ``max(flops / rate, bytes / bandwidth) + overhead`` with its family's rate (and the ``memory`` family's
    bandwidth for a compute family's bytes)."""
    total = 0.0
    for op in ops:
        measured = figures.calls.get(repr(op.call)) if op.call else None
        if measured is not None:
            total += measured
            continue
        if op.kind in _COMPUTE:
            work = max(op.flops / figures.rate(op.kind, op.dtype), op.bytes / figures.rate("memory", op.dtype))
        else:
            work = op.bytes / figures.rate(op.kind, op.dtype)
        total += work + figures.overhead
    return total


def step_ops(param_bytes: Sequence[int], optimizer: str, dtype: str = "float32") -> list[Op]:
    """One optimizer step over parameter tensors of ``param_bytes``, one :class:`Op` per tensor: it reads the
    parameter, its gradient and its state and writes the parameter and state (``sgd`` 3, ``momentum`` 5, ``adam``
    7 passes over the tensor)."""
    kind = optimizer_spec(optimizer)
    return [Op("step", dtype, 0, (kind.step_reads + kind.step_writes) * b) for b in param_bytes]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device, threads: int) -> str:
    """The cache key's device part: a GPU's name, or a CPU's model name with the threads a stage runs on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{_cpu_name()} x{threads} thread{'s' if threads > 1 else ''}"
    return device.type


def cache_path() -> Path:
    """The calibration cache file."""
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base) / "devices.json"
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ppll-compile" / "devices.json"


def _best(fn: Callable[[], Any], sync: Callable[[], None], runs: int = 5) -> float:
    """The fastest of ``runs`` timed calls (after one warm-up): the device's rate, undisturbed by other work."""
    fn()
    sync()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _benchmarks(device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """A representative training-step operator (forward and backward where it has one) per family, at ``dtype``."""
    def t(*shape: int, grad: bool = False) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    a, b = t(512, 512), t(512, 512)
    q, k, v = t(32, 4, 64, 48, grad=True), t(32, 4, 64, 48, grad=True), t(32, 4, 64, 48, grad=True)
    x, w = t(16, 128, 16, 16, grad=True), t(128, 128, 3, 3, grad=True)
    y = F.conv2d(x, w, padding=1)
    dy = torch.randn_like(y)
    h = t(32, 64, 32, 32, grad=True)  # 8 MiB in float32
    gamma, beta = t(64, grad=True), t(64, grad=True)

    def backward(out: Tensor, *inputs: Tensor) -> None:
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return {
        "matmul": lambda: a @ b,
        "attention": lambda: backward(F.scaled_dot_product_attention(q, k, v), q, k, v),
        "conv": lambda: F.conv2d(x.detach(), w.detach(), padding=1),
        "conv_bwd": lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True),
        "norm": lambda: backward(F.batch_norm(h, None, None, gamma, beta, training=True), h, gamma, beta),
        "math": lambda: backward(F.gelu(h), h),
        "pool": lambda: backward(F.max_pool2d(h, 3, 2, 1), h),
        "memory": lambda: h.detach() + h.detach(),
        "step": _sgd_step(device, dtype),
    }


def _sgd_step(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """A momentum SGD step over 32 MiB of float32 parameters (8 tensors), as a stage's optimizer runs it."""
    params = [torch.zeros(2 ** 20, device=device, dtype=dtype, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def step() -> list[Op]:
        opt.step()
        return step_ops([_nbytes(p) for p in params], "momentum", str(dtype).removeprefix("torch."))
    return step


def _rate(family: str, fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """``fn``'s rate in its family's unit: FLOP/s or bytes/s, from what :class:`OpLog` counts."""
    with OpLog() as log:
        returned = fn()
    ops = returned if family == "step" else [op for op in log.ops if op.kind == family]
    work = sum(op.flops if family in _COMPUTE else op.bytes for op in ops)
    return work / _best(fn, sync)


@contextlib.contextmanager
def _measuring(device: torch.device, threads: int) -> Iterator[Callable[[], None]]:
    """Measure on ``device`` as a stage runs: under the runtimes' allocator setting, a CPU at ``threads`` threads
    (restored afterwards); yields the device's synchronisation."""
    keep_freed_memory()
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    finally:
        torch.set_num_threads(before)


def calibrate(device: torch.device, threads: int = 1) -> DeviceFigures:
    """Measure ``device``'s figures (about a second): per family, the rate of a representative operator (FLOPs or
    bytes as :class:`OpLog` counts them, over the fastest of a few runs), float32, and on a GPU half precision too
    for the compute families; and a one-element add's time as the per-operator overhead. Under the runtimes'
    allocator setting, as :func:`measure_calls`."""
    rates: dict[str, float] = {}
    with _measuring(device, threads) as sync:
        for dtype in [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else []):
            name = str(dtype).removeprefix("torch.")
            for family, fn in _benchmarks(device, dtype).items():
                if dtype == torch.float32 or family in _COMPUTE:
                    rates[f"{family}:{name}"] = _rate(family, fn, sync)
        one = torch.ones(1, device=device)
        reps = 200
        overhead = _best(lambda: [one.add(one) for _ in range(reps)], sync) / reps
    return DeviceFigures(device=device_name(device, threads), torch=torch.__version__, rates=rates, overhead=overhead)


def _pinned(path: str) -> DeviceFigures:
    try:
        data = json.loads(Path(path).read_text())
        return DeviceFigures(**{**data, "source": path})
    except (OSError, ValueError, TypeError) as e:
        raise PlanError(f"{FIGURES_ENV}={path}: cannot read device figures ({e}); give a JSON object with the fields "
                        f"device, torch, rates (by 'family:float32' for every family of {', '.join(FAMILIES)}) and "
                        f"overhead (s), or unset {FIGURES_ENV} to calibrate") from None


def _operator(name: str) -> Any:
    """The ATen operator overload named ``aten.convolution.default`` (its ``str``)."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def measure_calls(calls: Iterable[tuple[Any, ...]], device: torch.device, threads: int = 1) -> dict[str, float]:
    """Seconds of every operator call (an :attr:`Op.call`) on ``device``, re-created on random tensors of its
    shapes: the fastest of three timed repeats after a warm-up, each repeat running it often enough to last a
    millisecond, on rotating copies of its arguments (at least 8 MiB of them, so that it does not read from a
    warm cache), under the runtimes' allocator setting (:func:`~ppll_compile.allocator.keep_freed_memory`, so that
    its outputs are not faulted in afresh), as in a training step. A call that cannot be re-created is left out
    (its roofline estimate stands)."""
    out: dict[str, float] = {}
    with _measuring(device, threads) as sync, torch.no_grad():
        for call in calls:
            try:
                func = _operator(call[0])
                made = [(_rebuild(call[1], device), _rebuild(call[2], device))]
                size = sum(_nbytes(t) for t in pytree.tree_leaves(made) if isinstance(t, Tensor))
                made += [(_rebuild(call[1], device), _rebuild(call[2], device))
                         for _ in range(min(15, (8 * 2 ** 20) // max(size, 1)))]
                t0 = time.perf_counter()
                func(*made[0][0], **made[0][1])
                sync()
                reps = max(len(made), min(100, int(1e-3 / max(time.perf_counter() - t0, 1e-7))))
                runs = [made[i % len(made)] for i in range(reps)]
                out[repr(call)] = _best(lambda: [func(*a, **k) for a, k in runs], sync, 3) / reps
            except Exception:  # noqa: BLE001  (an operator whose arguments random tensors cannot stand for)
                continue
    return out


def device_figures(device: torch.device, threads: int = 1, *, calls: Iterable[tuple[Any, ...]] = (),
                   refresh: bool = False) -> DeviceFigures:
    """The figures of ``device`` (a CPU at ``threads`` threads) with the seconds of ``calls`` (compute-family
    :attr:`Op.call` values): pinned by :data:`FIGURES_ENV`, else cached, else calibrated now; calls not cached
    yet are measured now (:func:`measure_calls`), and the cache is updated. ``refresh`` measures everything
    again."""
    pinned = os.environ.get(FIGURES_ENV)
    if pinned:
        return _pinned(pinned)
    key = f"{device_name(device, threads)} | torch {torch.__version__}"
    path = cache_path()
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        cache = {}
    figures = None
    if not refresh and isinstance(cache.get(key), dict):
        try:
            figures = DeviceFigures(**{**cache[key], "source": "cache"})
        except TypeError:
            pass  # written by another version: measure again
    changed = figures is None
    if figures is None:
        figures = calibrate(device, threads)
    missing = {repr(c): c for c in calls if c and repr(c) not in figures.calls}
    if missing:
        figures = dataclasses.replace(figures, calls={**figures.calls,
                                                      **measure_calls(missing.values(), device, threads)})
        changed = True
    if changed:
        cache[key] = {**figures.to_dict(), "source": "measured"}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: the figures hold for this process
    return figures

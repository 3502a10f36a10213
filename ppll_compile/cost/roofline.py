"""Roofline costs: the seconds of operators on a device, and the device's figures (:mod:`.figures`) they are priced
with: measured on this machine, cached, or pinned by a file.

An operator (an :class:`~ppll_compile.cost.oplog.Op`: its family, FLOPs and bytes) takes ``max(flops / rate, bytes /
bandwidth) + overhead`` seconds on a device. Operators fall into families that run at different fractions of the
hardware's peak: ``matmul`` (matrix products), ``attention`` (fused attention), ``conv`` and ``conv_bwd``
(convolutions and their gradients) count FLOPs; ``norm`` (batch, layer and group norm, which read their input
more than once), ``math`` (transcendental activations and softmax), ``pool``, ``memory`` (everything else:
element-wise arithmetic, copies, reductions) and ``step`` (an optimizer's update) are bound by the bytes they
read and write. Each family's rate is measured by a short micro-benchmark of a representative operator (about a
second in all, :func:`measure_device`). A compute-family operator's efficiency depends on its shape far more
than a family rate can say (a convolution over 1x1 feature maps runs at a fraction of one over 16x16), so each
distinct shape a plan meets is also timed once on the device (:func:`measure_calls`, milliseconds each) and that
time replaces its roofline estimate.

Measuring leaves the process as it was: random inputs come from a generator of its own (torch's global CPU
generator and the measured GPU's are restored too), the intra-op thread count and Python's warning filters are
restored, and the allocator is not touched. The runtimes train under :mod:`~ppll_compile.allocator`'s setting
(freed memory kept for the next step), which planning does not apply (glibc cannot read its settings back): an
operator whose output lies above glibc's mmap threshold may be measured with its output pages faulted in afresh,
a little slower than in a training step (glibc raises that threshold itself after the first free, so repeated
calls mostly reuse the heap; on the 2-core machine tried, per-shape times with and without the setting differed
by less than their run-to-run spread).

Everything measured is cached under the user's cache directory, keyed by the device's name, its thread count
(CPU) and the torch version, with the machine's load while measuring; a calibration on a busy machine (see
:data:`~.figures.BUSY_LOAD`) warns, and figures cached busy are measured again by the first plan or calibration
that finds the machine quiet (used with a warning until then). A cache that cannot be read (not a regular file, too
large, not JSON), or an entry that is not figures as a figures file holds them, is measured again with a warning.
:func:`ppll_compile.calibrate` (``ppll-plan --calibrate``, ``--recalibrate``) measures as a step of its own; a plan on
a device without cached figures measures them first.
``PPLL_DEVICE_FIGURES=path.json`` pins the figures instead (reproducible plans on any machine): a JSON object with
the fields of :class:`DeviceFigures` (and, ignored there, the link fields :data:`~.figures.FILE_EXTRAS` that
``hardware=FILE`` reads), read and checked as a ``hardware=FILE`` file is (:func:`~.figures.read_figures`). A
hardware preset's figures (:mod:`~ppll_compile.cost.hardware`) are priced the same way, from the vendor's figures:
their ``source`` begins with :data:`~.figures.PRESET_SOURCE` and nothing is timed on this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from ..errors import user_stacklevel
from .figures import (AGAIN, BUSY_ENV, REDO, DeviceFigures, FiguresProblem, busy_threshold, check_figures,
                      load_average, load_per_core, read_figures, read_object)
from .oplog import COMPUTE, FAMILIES, Op, OpLog, nbytes
from .optimizers import optimizer_spec

__all__ = ["DeviceFigures", "device_figures", "FIGURES_ENV", "CACHE_ENV", "BUSY_ENV"]

FIGURES_ENV = "PPLL_DEVICE_FIGURES"
"""Environment variable naming a JSON file of :class:`DeviceFigures` that every plan uses instead of calibrating."""
CACHE_ENV = "PPLL_CACHE_DIR"
"""Environment variable overriding the cache directory (default ``$XDG_CACHE_HOME/ppll-compile`` or
``~/.cache/ppll-compile``)."""


def _rebuild(value: Any, device: torch.device, generator: torch.Generator) -> Any:
    """Real tensors (random values drawn from ``generator``) and arguments from the description
    :attr:`Op.call` holds, on ``device``."""
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "T":
        _, shape, stride, dtype = value
        t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
        return t.normal_(generator=generator) if t.is_floating_point() else t.zero_()
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "K":
        return {k: _rebuild(v, device, generator) for k, v in value[1]}
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "D":
        text = value[1]
        return getattr(torch, text.removeprefix("torch.")) if text.startswith("torch.") else torch.device(text)
    if isinstance(value, tuple):
        return [_rebuild(v, device, generator) for v in value]
    return value


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
        if op.kind in COMPUTE:
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


def stage_threads(device: torch.device, stages: int) -> int:
    """Threads a stage computes on when ``stages`` stages share the machine: on a CPU, its share of the cores
    (``cores // stages``, as the runtimes give it); else 1."""
    return max(1, (os.cpu_count() or 1) // max(1, stages)) if device.type == "cpu" else 1


def cache_path() -> Path:
    """The calibration cache file."""
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base) / "devices.json"
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ppll-compile" / "devices.json"


Clock = Callable[[], float]
"""Seconds from an arbitrary start: :func:`time.perf_counter`, or a stand-in that tests control."""


def _best(fn: Callable[[], Any], sync: Callable[[], None], runs: int = 5, clock: Clock = time.perf_counter) -> float:
    """The fastest of ``runs`` timed calls (after one warm-up): the device's rate, undisturbed by other work."""
    fn()
    sync()
    times = []
    for _ in range(runs):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return min(times)


def _benchmarks(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> dict[str, Callable[[], Any]]:
    """A representative training-step operator (forward and backward where it has one) per family, at ``dtype``,
    on random tensors drawn from ``g``."""
    def t(*shape: int, grad: bool = False) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=g, requires_grad=grad)

    a, b = t(512, 512), t(512, 512)
    q, k, v = t(32, 4, 64, 48, grad=True), t(32, 4, 64, 48, grad=True), t(32, 4, 64, 48, grad=True)
    x, w = t(16, 128, 16, 16, grad=True), t(128, 128, 3, 3, grad=True)
    y = F.conv2d(x, w, padding=1)
    dy = t(*y.shape)
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
        "step": _sgd_step(device, dtype, g),
    }


def _sgd_step(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> Callable[[], Any]:
    """A momentum SGD step over 32 MiB of float32 parameters (8 tensors), as a stage's optimizer runs it."""
    params = [torch.zeros(2 ** 20, device=device, dtype=dtype, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=g)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def step() -> list[Op]:
        opt.step()
        return step_ops([nbytes(p) for p in params], "momentum", str(dtype).removeprefix("torch."))
    return step


def _rate(family: str, fn: Callable[[], Any], sync: Callable[[], None], clock: Clock) -> float:
    """``fn``'s rate in its family's unit: FLOP/s or bytes/s, from what :class:`OpLog` counts."""
    with OpLog() as log:
        returned = fn()
    ops = returned if family == "step" else [op for op in log.ops if op.kind == family]
    work = sum(op.flops if family in COMPUTE else op.bytes for op in ops)
    return work / _best(fn, sync, clock=clock)


@contextlib.contextmanager
def _isolated(device: torch.device, threads: int) -> Iterator[tuple[Callable[[], None], torch.Generator]]:
    """Measure on ``device`` as a stage runs (a CPU at ``threads`` threads) and leave the process as it was: torch's
    global CPU generator and the measured GPU's, the intra-op thread count and Python's warning filters are
    restored afterwards, and the allocator is not touched. Yields the device's synchronisation and a generator of
    its own (seeded, so that the inputs are the same every time) to draw the inputs from."""
    threads_before = torch.get_num_threads()
    gpus = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus), warnings.catch_warnings():
        if device.type == "cpu":
            torch.set_num_threads(threads)
        try:
            sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
            yield sync, torch.Generator(device=device).manual_seed(0)
        finally:
            torch.set_num_threads(threads_before)


def measure_device(device: torch.device, threads: int = 1, *, clock: Clock = time.perf_counter) -> DeviceFigures:
    """Measure ``device``'s figures (about a second): per family, the rate of a representative operator (FLOPs or
    bytes as :class:`OpLog` counts them, over the fastest of a few runs timed by ``clock``), float32, and on a GPU
    half precision too for the compute families; a one-element add's time as the per-operator overhead; and the
    machine's load before and after. Leaves the process as it was (see the module's text)."""
    rates: dict[str, float] = {}
    before = load_average()
    with _isolated(device, threads) as (sync, g):
        for dtype in [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else []):
            name = str(dtype).removeprefix("torch.")
            for family, fn in _benchmarks(device, dtype, g).items():
                if dtype == torch.float32 or family in COMPUTE:
                    rates[f"{family}:{name}"] = _rate(family, fn, sync, clock)
        one = torch.ones(1, device=device)
        reps = 200
        overhead = _best(lambda: [one.add(one) for _ in range(reps)], sync, clock=clock) / reps
    after = load_average()
    load = {"before": before, "after": after, "cores": os.cpu_count() or 1} \
        if before is not None and after is not None else {}
    return DeviceFigures(device=device_name(device, threads), torch=torch.__version__, rates=rates, overhead=overhead,
                         load=load, memory_bytes=device_memory(device))


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory ``device`` holds: a GPU's total, this machine's RAM for a CPU; ``None`` when unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass
    return None


def _pinned(path: str) -> DeviceFigures:
    """The figures the file :data:`FIGURES_ENV` names, read and checked as a ``hardware=FILE`` file is."""
    return read_figures(path, f"{FIGURES_ENV}={path}",
                        f"give a JSON object with the fields device, torch, rates (by 'family:float32' for every "
                        f"family of {', '.join(FAMILIES)}) and overhead (s) (`ppll-plan --calibrate --figures {path}` "
                        f"writes one), or unset {FIGURES_ENV} to calibrate")[0]


def _operator(name: str) -> Any:
    """The ATen operator overload named ``aten.convolution.default`` (its ``str``)."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


TIMING_BUDGET = 2 ** 30
"""Bytes that timing one operator call on the device (:func:`measure_calls`) may allocate: its arguments, their
rotating copies and its outputs. A call that needs more keeps its roofline estimate (the vocabulary projection of a
large language model at a long sequence is gigabytes on its own)."""


def measure_calls(calls: Iterable[tuple[Any, ...]], device: torch.device, threads: int = 1) -> dict[str, float]:
    """Seconds of every operator call (an :attr:`Op.call`) on ``device``, re-created on random tensors of its
    shapes: the fastest of three timed repeats after a warm-up, each repeat running it often enough to last a
    millisecond, on rotating copies of its arguments (at least 8 MiB of them, so that it does not read from a
    warm cache), as in a training step. Leaves the process as it was (see the module's text). A call that cannot
    be re-created is left out (its roofline estimate stands), and so is a call whose arguments and outputs (sized on
    the meta device first, nothing allocated; outputs as large as the arguments where the meta device cannot run it)
    exceed :data:`TIMING_BUDGET`: it is priced by the roofline formula, never timed at a smaller shape; copies and
    repeats are cut to stay within the budget."""
    out: dict[str, float] = {}
    meta = torch.device("meta")
    with _isolated(device, threads) as (sync, g), torch.no_grad():
        for call in calls:
            try:
                func = _operator(call[0])
                shaped = (_rebuild(call[1], meta, g), _rebuild(call[2], meta, g))
                size = sum(nbytes(t) for t in pytree.tree_leaves(shaped) if isinstance(t, Tensor))
                try:
                    result = sum(nbytes(t) for t in pytree.tree_leaves(func(*shaped[0], **shaped[1]))
                                 if isinstance(t, Tensor))
                except Exception:  # noqa: BLE001  (no meta kernel: take the outputs as large as the arguments)
                    result = size
                if size + result > TIMING_BUDGET:
                    continue
                made = [(_rebuild(call[1], device, g), _rebuild(call[2], device, g))]
                copies = min(15, (8 * 2 ** 20) // max(size, 1), (TIMING_BUDGET - size - result) // max(size, 1))
                made += [(_rebuild(call[1], device, g), _rebuild(call[2], device, g)) for _ in range(copies)]
                t0 = time.perf_counter()
                func(*made[0][0], **made[0][1])
                sync()
                reps = max(len(made), min(100, int(1e-3 / max(time.perf_counter() - t0, 1e-7))))
                reps = min(reps, max(1, (TIMING_BUDGET - size * len(made)) // max(result, 1)))
                runs = [made[i % len(made)] for i in range(reps)]
                out[repr(call)] = _best(lambda: [func(*a, **k) for a, k in runs], sync, 3) / reps
            except Exception:  # noqa: BLE001  (an operator whose arguments random tensors cannot stand for)
                continue
    return out


def _read_cache(path: Path) -> dict[str, Any]:
    """The calibration cache: empty when there is none yet, and (with a warning) when it cannot be read as one, so
    that the figures are measured again and the cache is written anew."""
    if not os.path.lexists(path):
        return {}
    try:
        return read_object(path)
    except FiguresProblem as e:
        warnings.warn(f"cannot use the calibration cache {path}: {e.problem}; the figures are measured again and the "
                      f"cache is written anew (if this repeats, delete the file or point {CACHE_ENV} at another "
                      f"folder)", stacklevel=user_stacklevel())
        return {}


def _cached(path: Path, key: str, entry: Any) -> DeviceFigures | None:
    """The figures the cache holds under ``key``, or ``None`` (with a warning: they are measured again) when the
    entry is not figures as :func:`~.figures.check_figures` takes them (damaged, or written by another version)."""
    try:
        if not isinstance(entry, dict):
            raise FiguresProblem(f"a JSON {type(entry).__name__} where an object was expected")
        check_figures(entry)
    except FiguresProblem as e:
        warnings.warn(f"the calibration cache {path} holds figures of {key!r} that cannot be used ({e.problem}): "
                      f"they are measured again and replace them", stacklevel=user_stacklevel())
        return None
    return DeviceFigures(**{**entry, "source": "cache"})


def _busy_cache(figures: DeviceFigures) -> DeviceFigures | None:
    """Cached ``figures`` measured on a busy machine: ``None`` (measure them again, their per-shape times too) when
    the machine is quiet now, else the figures, with a warning that they are used."""
    now, threshold = load_per_core(), busy_threshold()
    if now is not None and now < threshold:
        return None
    at = f" (load {now:.2f} per core now)" if now is not None else ""
    warnings.warn(f"the cached figures of {figures.device} were measured while the machine was busy (load "
                  f"{figures.load_per_core():.2f} per core, at or above {threshold}; {BUSY_ENV} sets the threshold) "
                  f"and it is still busy{at}: they are used, and they may be slow; {AGAIN}, or {REDO}",
                  stacklevel=user_stacklevel())
    return figures


def device_figures(device: torch.device, threads: int = 1, *, calls: Iterable[tuple[Any, ...]] = (),
                   refresh: bool = False, pinned: bool = True) -> DeviceFigures:
    """The figures of ``device`` (a CPU at ``threads`` threads) with the seconds of ``calls`` (compute-family
    :attr:`Op.call` values): pinned by :data:`FIGURES_ENV` (unless ``pinned=False``), else cached, else measured
    now (:func:`measure_device`; a warning when the machine was busy meanwhile); calls not cached yet are measured
    now (:func:`measure_calls`), and the cache is updated. ``refresh`` measures everything again and replaces the
    cached figures, per-shape times included. Cached figures measured on a busy machine are measured again (their
    per-shape times too) when the machine is quiet now (its load per core below
    :func:`~.figures.busy_threshold`), and used with a warning while it is still busy."""
    pin = os.environ.get(FIGURES_ENV) if pinned else None
    if pin:
        return _pinned(pin)
    key = f"{device_name(device, threads)} | torch {torch.__version__}"
    path = cache_path()
    cache = _read_cache(path)
    figures = _cached(path, key, cache[key]) if not refresh and key in cache else None
    if figures is not None and figures.busy():
        figures = _busy_cache(figures)
    changed = figures is None
    if figures is None:
        threshold = busy_threshold()  # a bad setting fails before the measurement
        figures = measure_device(device, threads)
        if figures.busy():
            warnings.warn(f"the machine was busy while the figures of {figures.device} were measured (load average "
                          f"{figures.load_per_core():.2f} per core over {figures.load['cores']:.0f} cores, at or "
                          f"above {threshold}; {BUSY_ENV} sets the threshold): they may be slow, and they are "
                          f"cached; {AGAIN}, or {REDO}", stacklevel=user_stacklevel())
    missing = {repr(c): c for c in calls if c and repr(c) not in figures.calls}
    if missing:
        figures = dataclasses.replace(figures, calls={**figures.calls,
                                                      **measure_calls(missing.values(), device, threads)})
        changed = True
    if changed:
        cache[key] = {**figures.to_dict(), "source": "measured"}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                             delete=False) as f:  # a random name, created exclusively
                f.write(json.dumps(cache))
            os.replace(f.name, path)
        except OSError:
            pass  # a read-only home or a full disk: the figures hold for this process
    return figures

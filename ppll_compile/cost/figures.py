"""A device's figures: what it does per second (a rate per operator family and dtype, and the seconds of operators
timed at their own shapes), its per-operator overhead and memory, and the machine's load while they were measured; the
JSON files that hold them, read safely and checked field by field against the range a device has; and when a load
counts as busy.

:class:`DeviceFigures` come from a calibration on this machine (:mod:`.roofline` measures and caches them), from a
file (``PPLL_DEVICE_FIGURES``, ``hardware=FILE``: :func:`read_figures`) or from a hardware preset
(:mod:`.hardware`, whose figures' ``source`` begins with :data:`PRESET_SOURCE`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..documents import NotRegular, TooLarge, read_regular
from ..errors import PlanError
from .oplog import COMPUTE, FAMILIES

BUSY_LOAD = 0.5
"""The load per core at or above which a calibration counts the machine as busy and warns: the larger 1-minute load
average read before and after measuring, over the machine's cores. At 0.5 other work holds half the cores on
average, and a rate measured beside it may be far below what the device does alone."""
BUSY_ENV = "PPLL_BUSY_LOAD"
"""Environment variable setting another busy threshold than :data:`BUSY_LOAD` (``0``: every calibration warns,
``inf``: none does)."""
PRESET_SOURCE = "preset "
"""How the ``source`` of a hardware preset's figures begins (``preset h100 (NVIDIA H100 ... datasheet)``)."""
FILE_EXTRAS = ("intra_node_bandwidth", "inter_node_bandwidth", "gpus_per_node", "sources")
"""Fields a figures file may hold beside :class:`DeviceFigures`'s, for ``hardware=FILE``: the device's links
(bytes/s, one direction), devices per node, and where the figures come from."""


def load_average() -> float | None:
    """The machine's 1-minute load average (``None`` where the system has none): the one reading of the load that
    calibration records and compares."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def load_per_core() -> float | None:
    """The machine's load now, per core (:func:`load_average` over the cores); ``None`` where unknown."""
    load = load_average()
    return None if load is None else load / max(os.cpu_count() or 1, 1)


def busy_threshold() -> float:
    """The load per core at or above which a calibration warns: :data:`BUSY_ENV`, else :data:`BUSY_LOAD`."""
    text = os.environ.get(BUSY_ENV, "").strip()
    if not text:
        return BUSY_LOAD
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise PlanError(f"{BUSY_ENV}={text!r} is not a load per core; expected a number >= 0 (default {BUSY_LOAD}; "
                        f"0 warns on every calibration, inf on none), or unset {BUSY_ENV}")
    return value


@dataclass(frozen=True, kw_only=True)
class DeviceFigures:
    """What one device does per second, measured by :func:`~.roofline.measure_device`."""

    device: str
    """The device's name (a CPU's model name and thread count, a GPU's name)."""
    torch: str
    """The torch version measured with."""
    rates: dict[str, float] = field(default_factory=dict)
    """By ``family:dtype`` (``matmul:float32``, ``norm:float32``, ...): FLOP/s of a compute family, bytes/s of a
    memory-bound one."""
    calls: dict[str, float] = field(default_factory=dict)
    """Seconds of compute-family operators measured at their own shapes (see :func:`~.roofline.measure_calls`), by
    ``repr(op.call)``: a matrix product's or a convolution's rate depends on its shape."""
    overhead: float = 5e-6
    """Seconds every operator costs beyond its work (dispatch, launch)."""
    source: str = "measured"
    """Where the figures came from: ``measured`` (now), ``cache`` or a pinned file's path."""
    load: dict[str, float] = field(default_factory=dict)
    """The machine's load while the rates were measured: the 1-minute load average ``before`` and ``after``
    measuring, and its ``cores``; empty when unknown (figures written by hand or by an earlier version, or a
    system without a load average)."""
    memory_bytes: int | None = None
    """Bytes of memory the device holds (a GPU's, or this machine's RAM for a CPU); ``None`` when unknown."""

    def rate(self, family: str, dtype: str) -> float:
        """The rate of ``family`` at ``dtype`` (float32's when that dtype was not measured)."""
        return self.rates.get(f"{family}:{dtype}") or self.rates[f"{family}:float32"]

    def load_per_core(self) -> float | None:
        """The larger load average read while measuring, over the cores (``None`` when not recorded)."""
        if not self.load:
            return None
        return max(self.load["before"], self.load["after"]) / max(self.load["cores"], 1)

    def busy(self) -> bool:
        """Whether the machine was busy while measuring: its load per core at or above :func:`busy_threshold`."""
        load = self.load_per_core()
        return load is not None and load >= busy_threshold()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record(self) -> dict[str, Any]:
        """The figures as a plan records them: the per-call seconds counted, not listed (the load when known)."""
        return {**{k: v for k, v in self.to_dict().items()
                    if k != "calls" and (k != "load" or v) and (k != "memory_bytes" or v is not None)},
                "timed_calls": len(self.calls)}

    def describe(self) -> str:
        """One line for a plan's notes: the figures, where they came from, and how to measure them again."""
        if self.source.startswith(PRESET_SOURCE):
            memory = f", {self.memory_bytes / 1e9:.0f} GB per device" if self.memory_bytes else ""
            return (f"costs are seconds on {self.device} (roofline, {self.source} figures at assumed achievable "
                    f"fractions of its peaks: {self.rate('matmul', 'bfloat16') / 1e12:.0f} TFLOP/s bfloat16 matmul, "
                    f"{self.rate('matmul', 'float32') / 1e12:.0f} TFLOP/s float32 matmul, "
                    f"{self.rate('memory', 'float32') / 1e9:.0f} GB/s memory, {self.overhead * 1e6:.1f} us per "
                    f"operator{memory}); nothing was timed on this machine")
        timed = f", {len(self.calls)} operator shapes timed" if self.calls else ""
        source = f"pinned by {Path(self.source).name}" if self.source not in ("measured", "cache") else self.source
        text = (f"costs are seconds on {self.device} (roofline, {source} figures: "
                f"{self.rate('matmul', 'float32') / 1e9:.0f} GFLOP/s matmul, "
                f"{self.rate('memory', 'float32') / 1e9:.0f} GB/s memory{timed})")
        load = self.load_per_core()
        at = f" at load {load:.2f} per core" + (" (busy: they may be slow)" if self.busy() else "") \
            if load is not None else ""
        if self.source == "measured":
            return text + f"; measured now{at} and cached: {REDO}"
        if self.source == "cache" and self.busy():
            return text + f"; measured{at} and the machine is still busy: {AGAIN}, or {REDO}"
        if self.busy():  # a pinned file's
            return text + f"; measured{at}: pin figures measured on a quiet machine ({PIN})"
        return text


REDO = "`ppll-plan --recalibrate` or `ppll_compile.calibrate(refresh=True)` measures them again"
"""How a plan's notes and a busy calibration's warning say to measure the figures again."""
AGAIN = "the first plan or calibration at a load below the busy threshold measures them again by itself"
"""What happens to cached figures measured on a busy machine (see :func:`~.roofline.device_figures`)."""
PIN = "`ppll-plan --recalibrate --figures FILE` writes them"
"""How a pinned file of figures measured on a busy machine is replaced."""


PLAUSIBLE = 1000
"""How far beyond the largest figure of the hardware presets (:mod:`.hardware`) a figures file's figure may go: rates,
memory and links at most 1000 times those of :data:`FASTEST`. Three orders of magnitude leave room for devices
generations ahead (a generation gains 2-3x) and for a calibrated CPU whose memory is a whole machine's RAM (the largest
single machines hold tens of TB, about 100 times 192 GB), while a figure no device has (1e40 FLOP/s, 1e30 bytes) is
refused instead of making every stage look free."""
FASTEST: dict[str, float] = {"compute": 1307.4e12 * 0.7, "memory-bound": 5.3e12 * 0.8, "memory_bytes": 192e9,
                             "link": 450e9 * 0.8}
"""The largest figures of the hardware presets, as the presets price them: the MI300X's bfloat16 matmul (1,307.4
TFLOP/s dense at the 0.7 achievable), its memory bandwidth (5.3 TB/s at 0.8) and memory (192 GB), NVLink 4 (450 GB/s
each way at 0.8): among the largest devices sold when the presets were written down."""
MAX_FIGURES_BYTES = 64 * 2 ** 20
"""Bytes a figures file (or the calibration cache) may hold; no more is read. A calibrated file holds about 200 bytes
per operator shape timed (a plan meets tens to hundreds of shapes), so 64 MiB holds hundreds of thousands of them."""
LIMITS: dict[str, tuple[float, float, str]] = {
    "compute": (1e6, PLAUSIBLE * FASTEST["compute"], "FLOP/s"),
    "memory-bound": (1e6, PLAUSIBLE * FASTEST["memory-bound"], "bytes/s"),
    "memory_bytes": (1.0, PLAUSIBLE * FASTEST["memory_bytes"], "bytes"),
    "intra_node_bandwidth": (1e3, PLAUSIBLE * FASTEST["link"], "bytes/s"),
    "inter_node_bandwidth": (1e3, PLAUSIBLE * FASTEST["link"], "bytes/s"),
    "overhead": (0.0, 1.0, "seconds per operator"),
    "calls": (0.0, 3600.0, "seconds per operator call"),
    "gpus_per_node": (1, 1024, "devices"),
}
"""The range a figures file's numbers must lie in, by field (``compute``: the rates of the compute families,
``memory-bound`` those of the others): at least a million FLOP/s or bytes/s (slower than any processor of the last 30
years), at most :data:`PLAUSIBLE` times :data:`FASTEST`; an operator's overhead under a second, a timed call under an
hour, at most 1024 devices per node (the largest NVLink domain joins 72)."""
FIELDS = ("device", "torch", "rates", "calls", "overhead", "source", "load", "memory_bytes", *FILE_EXTRAS)
"""Every field a figures file may hold."""
WAY = (f"give a JSON object with the fields device, torch, rates (by 'family:float32' for every family of "
       f"{', '.join(FAMILIES)}) and overhead (s), optionally memory_bytes, intra_node_bandwidth and "
       f"inter_node_bandwidth (bytes/s, one direction) and gpus_per_node (ppll_compile.calibrate(out=...) writes one)")
"""The way out of a refused figures file, unless its problem has one of its own: what the file holds."""


class FiguresProblem(ValueError):
    """What is wrong with a figures file or object (``problem``), and the way out particular to it (``way``:
    ``None`` when the reader's own applies)."""

    def __init__(self, problem: str, way: str | None = None) -> None:
        super().__init__(problem, way)
        self.problem, self.way = problem, way

    def refusal(self, name: str, way: str = WAY) -> PlanError:
        """The error naming the file (``name``: ``hardware=PATH``, ``PPLL_DEVICE_FIGURES=PATH``), the problem and the
        way out (its own, else ``way``)."""
        return PlanError(f"{name}: {self.problem}; {self.way or way}")


def read_figures(path: str, name: str, way: str = WAY) -> tuple[DeviceFigures, dict[str, Any]]:
    """The figures a JSON file holds (``source``: its path) and its :data:`FILE_EXTRAS` fields, read by
    :func:`read_object` and checked by :func:`check_figures`; raises a :class:`~ppll_compile.PlanError` naming the
    file as ``name`` (``hardware=PATH``, ``PPLL_DEVICE_FIGURES=PATH``), the key, the value and the way out (``way``
    unless the problem has one of its own)."""
    try:
        data = read_object(path)
        check_figures(data)
    except FiguresProblem as e:
        raise e.refusal(name, way) from None
    extras = {k: data.pop(k) for k in FILE_EXTRAS if k in data}
    if data.get("memory_bytes") is not None:
        data["memory_bytes"] = int(data["memory_bytes"])
    return DeviceFigures(**{**data, "source": str(path)}), extras


def read_object(path: str | Path) -> dict[str, Any]:
    """The JSON object a file holds: a regular file (a FIFO or device is refused before it is opened, and again if
    one was swapped in before the opening), read up to :data:`MAX_FIGURES_BYTES`, nested no deeper than Python
    parses, with no integer longer than Python converts; raises :class:`FiguresProblem`."""
    limit = MAX_FIGURES_BYTES
    special = FiguresProblem("not a regular file (a FIFO, device or directory)", "give the path of a JSON file")
    try:
        raw = read_regular(path, limit)
    except NotRegular:
        raise special from None
    except TooLarge:
        raise FiguresProblem(f"larger than {limit:,} bytes (MAX_FIGURES_BYTES), which no figures file is",
                             "give the path of a figures file (ppll_compile.calibrate(out=...) writes one)") from None
    except OSError as e:
        raise FiguresProblem(f"cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise FiguresProblem("nested too deep to be a figures file (its values are numbers, strings and objects of "
                             "numbers)") from None
    except ValueError as e:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        if "digits" in str(e):  # Python's limit on the digits of an integer it converts
            raise FiguresProblem("holds an integer of more than 4300 digits, which no figure has") from None
        raise FiguresProblem(f"not JSON ({str(e)[:100]})") from None
    if not isinstance(data, dict):
        raise FiguresProblem(f"a JSON {type(data).__name__} where an object was expected")
    return data


def check_figures(data: dict[str, Any]) -> None:
    """Every field of a figures object known (:data:`FIELDS`), of its type and in the range a device has
    (:data:`LIMITS`); raises :class:`FiguresProblem` naming the first that is not, with its value."""
    unknown = sorted(str(k)[:40] for k in data if k not in FIELDS)
    if unknown:
        raise FiguresProblem(f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(FIELDS)}")
    for key, required in (("device", True), ("torch", True), ("source", False), ("sources", False)):
        value = data.get(key)
        if (value is not None or required) and not (isinstance(value, str) and len(value) <= 2000):
            raise FiguresProblem(f"{key} is {_shown(value)}, expected a string (at most 2000 characters)")
    _check_rates(data.get("rates"))
    for key in ("memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth", "overhead", "gpus_per_node"):
        if data.get(key) is not None:
            _check_range(key, data[key], key)
    calls = data.get("calls", {})
    if not isinstance(calls, dict):
        raise FiguresProblem(f"calls is {_shown(calls)}, expected an object of numbers by name")
    for call, value in calls.items():
        _check_range(f"calls[{call[:60]!r}]", value, "calls")
    load = data.get("load", {})
    if not isinstance(load, dict) or (load and set(load) != {"before", "after", "cores"}):
        raise FiguresProblem(f"load is {_shown(load)}, expected {{}} or an object of the 1-minute load average "
                             f"'before' and 'after' measuring and the machine's 'cores'")
    for key, value in load.items():
        if not (_number(value) and 0 <= value <= 1e6):
            raise FiguresProblem(f"load[{key!r}] is {_shown(value)}, expected a number from 0 to 1e6")


def _check_rates(rates: Any) -> None:
    """An object of a positive rate for every family at float32, each key a ``family:dtype``, each rate in range."""
    if not isinstance(rates, dict):
        raise FiguresProblem(f"rates is {_shown(rates)}, expected an object of rates by 'family:dtype'")
    missing = [f for f in FAMILIES if not _positive(rates.get(f"{f}:float32"))]
    bad = [k for k, v in rates.items() if not _positive(v)]
    if missing or bad:
        raise FiguresProblem(f"no positive rate for {', '.join(f'{f}:float32' for f in missing) or ', '.join(bad)}")
    for key, rate in rates.items():
        family, _, dtype = key.partition(":")
        if family not in FAMILIES or not dtype:
            raise FiguresProblem(f"rates has the key {_shown(key)}, expected 'family:dtype' with a family of "
                                 f"{', '.join(FAMILIES)}")
        _check_range(f"rates[{key!r}]", rate, "compute" if family in COMPUTE else "memory-bound")


def _check_range(key: str, value: Any, limit: str) -> None:
    """``value`` a number (an integer for ``gpus_per_node``) within :data:`LIMITS` ``[limit]``."""
    low, high, unit = LIMITS[limit]
    whole = limit == "gpus_per_node"
    if _number(value) and (not whole or isinstance(value, int)) and low <= value <= high and \
            (value > 0 or limit in ("overhead", "calls")):
        return
    why = f" (at most PLAUSIBLE = {PLAUSIBLE} times the largest preset's figure: no device comes near it)" \
        if limit not in ("overhead", "calls", "gpus_per_node") else ""
    way = "give the devices per node of the cluster, or remove the field" if whole else \
        f"give the device's own figure in {unit} (ppll_compile.calibrate(out=...) measures them), or remove the field"
    raise FiguresProblem(f"{key} is {_shown(value)}, expected {'a whole number' if whole else 'a number'} of {unit} "
                         f"from {_figure(low)} to {_figure(high)}{why}", way)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _figure(x: float) -> str:
    return f"{x:.3g}" if x >= 1e5 else f"{x:g}"


def _number(v: Any) -> bool:
    """A JSON number, finite (an integer of any size compares with the bounds exactly, as a float it would overflow)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))


def _positive(v: Any) -> bool:
    return _number(v) and v > 0

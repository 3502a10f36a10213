"""A device's figures: what it does per second (a rate per operator family and dtype, and the seconds of operators
timed at their own shapes), its per-operator overhead and memory, and the machine's load while they were measured; the
JSON files that hold them; and when a load counts as busy.

:class:`DeviceFigures` come from a calibration on this machine (:mod:`.roofline` measures and caches them), from a
file (``PPLL_DEVICE_FIGURES``, ``hardware=FILE``: :func:`read_figures`) or from a hardware preset
(:mod:`.hardware`, whose figures' ``source`` begins with :data:`PRESET_SOURCE`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlanError

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


def read_figures(path: str) -> tuple[DeviceFigures, dict[str, Any]]:
    """The figures a JSON file holds (``source``: its path) and its :data:`FILE_EXTRAS` fields; raises
    ``OSError``, ``ValueError`` or ``TypeError`` when it cannot be read as such."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object was expected, not {type(data).__name__}")
    extras = {k: data.pop(k) for k in FILE_EXTRAS if k in data}
    return DeviceFigures(**{**data, "source": str(path)}), extras

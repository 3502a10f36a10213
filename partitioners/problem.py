"""The partitioning problem every solver reads, its checks and errors, and the arrays solvers evaluate it with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import InfeasibleMemoryError, PartitionError
from .objective import Links, Segments


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Per-segment costs of a model cut into ``n`` atomic segments, plus the devices' speeds and memory limits.

    A stage ``j`` covering segments ``[a, b)`` costs
    ``(sum(compute[a:b]) - start[a] + head[b-1]) / speeds[j] + comm[b-1]`` seconds (the objective of
    :mod:`partitioners.objective` on one replica) and needs
    ``sum(memory[a:b]) + head_memory[b-1]`` bytes, which must not exceed ``memory_limit[j]``. Stage ``j`` runs
    on device ``j``; with ``gpus_per_node``, its send takes ``cross_comm[b-1]`` instead of ``comm[b-1]`` when
    devices ``j`` and ``j + 1`` sit on different nodes. ``None`` means zeros for per-segment fields, ones for
    ``speeds`` and no cap for ``memory_limit``.
    Sums are evaluated as differences of float64 prefix sums, identically by every function here, so
    solvers and the reported costs agree to the last bit.
    """

    compute: Sequence[float]
    """Per segment: backbone forward plus backward time in seconds at speed 1."""
    head: Sequence[float] | None = None
    """Per segment ``i``: compute time of the aux head at the cut after ``i``, paid by a stage ending at ``i``."""
    comm: Sequence[float] | None = None
    """Per segment ``i``: time to send the boundary after ``i`` to the next stage (0 for the last segment)."""
    start: Sequence[float] | None = None
    """Per segment ``a``: time a stage starting at ``a`` saves (its input arrives detached, so its first layers
    compute no input gradient); at most ``compute[a]``."""
    memory: Sequence[float] | None = None
    """Per segment: bytes of parameters, gradients, optimiser state and activations."""
    head_memory: Sequence[float] | None = None
    """Per segment ``i``: bytes of the aux head at the cut after ``i``."""
    params: Sequence[float] | None = None
    """Per segment: parameter count (used by the ``params`` baseline)."""
    speeds: Sequence[float] | None = None
    """Per device: relative speed, one per stage when given."""
    memory_limit: float | Sequence[float] | None = None
    """Per device: memory cap in bytes; a single number caps every device alike."""
    cross_comm: Sequence[float] | None = None
    """Per segment ``i``: time to send the boundary after ``i`` to a device on another node (``None``: ``comm``)."""
    gpus_per_node: int | None = None
    """Consecutive devices per node (device ``j`` is on node ``j // gpus_per_node``), or ``None`` for one node."""

    def __post_init__(self) -> None:
        n = len(vector("compute", self.compute))
        if n == 0:
            raise PartitionError("Problem.compute is empty; expected one cost per segment (a model has at least one)")
        for name in ("head", "comm", "start", "memory", "head_memory", "params", "cross_comm"):
            values = getattr(self, name)
            if values is not None and len(vector(name, values)) != n:
                raise PartitionError(
                    f"Problem.{name} has {len(values)} entries but compute has {n}; "
                    "expected one entry per segment (or None)"
                )
        if self.start is not None and (np.asarray(self.start) > np.asarray(self.compute)).any():
            i = int(np.argmax(np.asarray(self.start) > np.asarray(self.compute)))
            raise PartitionError(f"Problem.start[{i}] is {self.start[i]!r}, more than compute[{i}] "
                                 f"({self.compute[i]!r}); a stage cannot save more than its first segment costs")
        if self.speeds is not None:
            vector("speeds", self.speeds)
        if self.memory_limit is not None:
            vector("memory_limit", self.memory_limit)
        check_gpus_per_node("Problem", self.gpus_per_node)


def check_gpus_per_node(owner: str, value: object) -> None:
    """Raise unless ``value`` is ``None`` or a whole number of devices per node >= 1."""
    if value is not None and not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                                  and value >= 1):
        raise PartitionError(f"{owner}.gpus_per_node is {value!r}; expected a whole number of devices per node >= 1, "
                             "or None for one node")


@dataclass(frozen=True, kw_only=True)
class Arrays:
    """A validated problem for a fixed stage count, as prefix sums and per-cut terms in float64."""

    segments: Segments
    """The per-segment seconds as the sums the stage-cost objective reads."""
    memory_prefix: np.ndarray
    """``memory_prefix[i]`` is the summed memory of segments ``0 .. i-1`` (length n + 1)."""
    memory_top: np.ndarray
    """``memory_prefix[b] + head_memory[b-1]`` at index ``b-1``."""
    speeds: np.ndarray
    """Per stage: the device's relative speed."""
    caps: np.ndarray
    """Per stage: the device's memory cap (``inf`` for none)."""
    cross: np.ndarray | None = None
    """Per stage: whether its send goes to another node (``None``: no stage's does)."""

    @classmethod
    def of(cls, problem: Problem, num_stages: int) -> Arrays:
        """Check the stage count against ``problem`` and precompute the arrays every solver works on."""
        n = len(problem.compute)
        check_stages(num_stages, n)
        memory_prefix = np.concatenate(([0.0], np.cumsum(np.zeros(n) if problem.memory is None
                                                         else np.asarray(problem.memory, dtype=np.float64))))
        head_memory = np.zeros(n) if problem.head_memory is None else np.asarray(problem.head_memory, np.float64)
        links = Links(gpus_per_node=problem.gpus_per_node)
        cross = links.crosses(np.arange(num_stages), 1) if problem.gpus_per_node else None
        return cls(
            segments=Segments.of(problem.compute, head=problem.head, comm=problem.comm, start=problem.start,
                                 cross_comm=problem.cross_comm if problem.gpus_per_node else None),
            cross=cross if cross is not None and cross.any() else None,
            memory_prefix=memory_prefix,
            memory_top=memory_prefix[1:] + head_memory,
            speeds=_per_device("speeds", problem.speeds, num_stages, 1.0),
            caps=_per_device("memory_limit", problem.memory_limit, num_stages, math.inf),
        )

    def stage_cost(self, j: int, a: int, b: int) -> float:
        """Time of stage ``j`` over segments ``[a, b)``: the objective of :mod:`partitioners.objective`."""
        return float(self.segments.cost(a, b, speed=self.speeds[j], cross=self.crossing(j)))

    def crossing(self, j: int) -> bool:
        """Whether stage ``j``'s send goes to another node."""
        return bool(self.cross is not None and self.cross[j])

    @property
    def starts(self) -> bool:
        """Whether a stage's cost depends on where it starts beyond its segments (``start`` is not all zero)."""
        return bool((self.segments.compute_bottom != self.segments.compute_prefix).any())

    def stage_memory(self, a: int, b: int) -> float:
        """Bytes of a stage over segments ``[a, b)``; the exact solver evaluates this same expression."""
        return float(self.memory_top[b - 1] - self.memory_prefix[a])


def _per_device(name: str, values: float | Sequence[float] | None, num_stages: int, default: float) -> np.ndarray:
    """One value per stage from ``None`` (the default), a single number or a sequence of ``num_stages`` numbers."""
    if values is None or np.ndim(values) == 0:
        return np.full(num_stages, default if values is None else float(values))
    if len(values) != num_stages:
        raise PartitionError(
            f"Problem.{name} has {len(values)} entries but num_stages is {num_stages}; "
            "give one value per device (stage)"
        )
    return np.asarray(values, dtype=np.float64)


def vector(name: str, values: object) -> np.ndarray:
    """``values`` as a float64 array, or a ``PartitionError`` naming the field and index of the first bad entry."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        array = None
    if array is None or array.ndim > 1 or (array.ndim == 0 and name != "memory_limit"):
        raise PartitionError(
            f"Problem.{name} is {type(values).__name__}; expected a flat sequence of numbers (a list or 1-D array)"
        )
    if name == "speeds":
        bad, expected = ~(np.isfinite(array) & (array > 0)), "a positive finite relative speed"
    elif name == "memory_limit":
        bad, expected = np.isnan(array) | (array < 0), "a non-negative number of bytes (use None for no cap)"
    else:
        bad, expected = ~(np.isfinite(array) & (array >= 0)), "a non-negative finite number (fix its producer)"
    if bad.any():
        index = int(np.argmax(bad.ravel()))
        where = f"[{index}]" if array.ndim else ""
        raise PartitionError(f"Problem.{name}{where} is {float(array.ravel()[index])!r}; expected {expected}")
    return array


def check_stages(num_stages: int, n: int) -> None:
    """Raise unless ``num_stages`` non-empty stages can be made from ``n`` segments."""
    if num_stages < 1:
        raise PartitionError(f"cannot make {num_stages} stages from {n} segments (at least 1 stage)")
    if num_stages > n:
        raise PartitionError(f"cannot make {num_stages} stages from {n} segments (at most {n} stages)")


def check_ends(ends: Sequence[int], n: int) -> None:
    """Raise unless ``ends`` are strictly increasing stage ends from at least 1 up to exactly ``n``."""
    if not (len(ends) >= 1 and ends[0] >= 1 and ends[-1] == n and all(a < b for a, b in zip(ends, ends[1:]))):
        raise PartitionError(
            f"stage ends {tuple(ends)} do not partition {n} segments; "
            f"expected strictly increasing ends, the first >= 1 and the last == {n}"
        )


def infeasible(caps: np.ndarray, min_limit: float) -> InfeasibleMemoryError:
    """The error for memory caps that no partition into ``len(caps)`` stages fits."""
    if (caps == caps[0]).all():
        found, smallest = f"a memory limit of {format_bytes(caps[0])} per device", "limit"
    else:
        found = f"the memory limits {', '.join(format_bytes(c) for c in caps)} per device"
        smallest = "uniform limit"
    return InfeasibleMemoryError(
        f"no partition into {len(caps)} stages fits {found}; the smallest {smallest} that works is "
        f"{format_bytes(min_limit)} (raise memory_limit or use more devices)",
        min_limit=min_limit,
    )


def format_bytes(value: float) -> str:
    """A byte count in binary units with one decimal, e.g. ``1.6 GiB``."""
    if math.isinf(value):
        return "unlimited"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while value >= 1024 and power < len(units) - 1:
        value /= 1024
        power += 1
    return f"{value:.1f} {units[power]}"

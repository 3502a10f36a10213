"""Pure solvers that cut a sequence of model segments into contiguous pipeline stages, one stage per device."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Problem",
    "PartitionError",
    "InfeasibleMemoryError",
    "Solver",
    "SOLVERS",
    "register",
    "solve",
    "stage_costs",
    "stage_memory",
    "bottleneck",
    "brute_force",
]


class PartitionError(ValueError):
    """A partitioning problem or request that cannot be solved as given."""


class InfeasibleMemoryError(PartitionError):
    """No partition into the requested number of stages fits the per-device memory limits.

    ``min_limit`` is the smallest uniform per-device limit that admits a partition into as many stages.
    """

    def __init__(self, message: str, *, min_limit: float) -> None:
        super().__init__(message)
        self.min_limit = min_limit


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Per-segment costs of a model cut into ``n`` atomic segments, plus the devices' speeds and memory limits.

    A stage ``j`` covering segments ``[a, b)`` costs
    ``(sum(compute[a:b]) + head[b-1]) / speeds[j] + comm[b-1]`` seconds and needs
    ``sum(memory[a:b]) + head_memory[b-1]`` bytes, which must not exceed ``memory_limit[j]``.
    ``None`` means zeros for per-segment fields, ones for ``speeds`` and no cap for ``memory_limit``.
    Sums are evaluated as differences of float64 prefix sums, identically by every function here, so
    solvers and the reported costs agree to the last bit.
    """

    compute: Sequence[float]
    """Per segment: backbone forward plus backward time in seconds at speed 1."""
    head: Sequence[float] | None = None
    """Per segment ``i``: compute time of the aux head at the cut after ``i``, paid by a stage ending at ``i``."""
    comm: Sequence[float] | None = None
    """Per segment ``i``: time to send the boundary after ``i`` to the next stage (0 for the last segment)."""
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

    def __post_init__(self) -> None:
        n = len(_vector("compute", self.compute))
        if n == 0:
            raise PartitionError("Problem.compute is empty; expected one cost per segment (a model has at least one)")
        for name in ("head", "comm", "memory", "head_memory", "params"):
            values = getattr(self, name)
            if values is not None and len(_vector(name, values)) != n:
                raise PartitionError(
                    f"Problem.{name} has {len(values)} entries but compute has {n}; "
                    "expected one entry per segment (or None)"
                )
        if self.speeds is not None:
            _vector("speeds", self.speeds)
        if self.memory_limit is not None:
            _vector("memory_limit", self.memory_limit)


Solver = Callable[[Problem, int], tuple[int, ...]]
"""A partitioner: takes a problem and a stage count, returns the stage ends."""

SOLVERS: dict[str, Solver] = {}
"""Partitioners by name; ``solve`` dispatches on these keys."""


def register(name: str) -> Callable[[Solver], Solver]:
    """Decorator that adds a partitioner to ``SOLVERS`` under ``name``."""

    def add(solver: Solver) -> Solver:
        if name in SOLVERS:
            raise PartitionError(f"partitioner {name!r} is already registered; register yours under another name")
        SOLVERS[name] = solver
        return solver

    return add


def solve(problem: Problem, num_stages: int, method: str = "exact") -> tuple[int, ...]:
    """Cut ``problem`` into ``num_stages`` stages with the named partitioner and return the stage ends."""
    if method not in SOLVERS:
        raise PartitionError(f"unknown partitioner {method!r}; known partitioners: {', '.join(sorted(SOLVERS))}")
    _check_stages(num_stages, len(problem.compute))
    ends = SOLVERS[method](problem, num_stages)
    _check_ends(ends, len(problem.compute))
    return ends


def stage_costs(problem: Problem, ends: Sequence[int]) -> list[float]:
    """Time in seconds of each stage of the partition ``ends``."""
    t = _arrays(problem, len(ends))
    _check_ends(ends, len(problem.compute))
    return [_stage_cost(t, j, a, b) for j, (a, b) in enumerate(zip((0, *ends), ends))]


def stage_memory(problem: Problem, ends: Sequence[int]) -> list[float]:
    """Bytes each stage of the partition ``ends`` needs."""
    t = _arrays(problem, len(ends))
    _check_ends(ends, len(problem.compute))
    return [_stage_memory(t, a, b) for a, b in zip((0, *ends), ends)]


def bottleneck(problem: Problem, ends: Sequence[int]) -> float:
    """Time of the slowest stage of the partition ``ends``, which bounds the pipeline's throughput."""
    return max(stage_costs(problem, ends))


def brute_force(problem: Problem, num_stages: int) -> tuple[int, ...]:
    """Reference min-max partition found by trying every placement of cuts; for small problems and tests."""
    t = _arrays(problem, num_stages)
    n = len(problem.compute)
    best: tuple[int, ...] | None = None
    best_cost = min_limit = math.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        ends = (*cuts, n)
        spans = list(zip((0, *cuts), ends))
        memory = [_stage_memory(t, a, b) for a, b in spans]
        min_limit = min(min_limit, max(memory))
        if all(m <= cap for m, cap in zip(memory, t.caps)):
            cost = max(_stage_cost(t, j, a, b) for j, (a, b) in enumerate(spans))
            if cost < best_cost or best is None:
                best, best_cost = ends, cost
    if best is None:
        raise _infeasible(t.caps, min_limit)
    return best


@dataclass(frozen=True, kw_only=True)
class _Arrays:
    """A validated problem for a fixed stage count, as prefix sums and per-cut terms in float64."""

    compute_prefix: np.ndarray
    """``compute_prefix[i]`` is the summed compute of segments ``0 .. i-1`` (length n + 1)."""
    compute_top: np.ndarray
    """``compute_prefix[b] + head[b-1]`` at index ``b-1``: what a stage ending at ``b`` adds before its start."""
    comm: np.ndarray
    """Per segment ``i``: send time of the boundary after ``i``."""
    memory_prefix: np.ndarray
    """``memory_prefix[i]`` is the summed memory of segments ``0 .. i-1`` (length n + 1)."""
    memory_top: np.ndarray
    """``memory_prefix[b] + head_memory[b-1]`` at index ``b-1``."""
    speeds: np.ndarray
    """Per stage: the device's relative speed."""
    caps: np.ndarray
    """Per stage: the device's memory cap (``inf`` for none)."""


def _stage_cost(t: _Arrays, j: int, a: int, b: int) -> float:
    """Time of stage ``j`` over segments ``[a, b)``; the exact solver evaluates this same expression."""
    return float((t.compute_top[b - 1] - t.compute_prefix[a]) / t.speeds[j] + t.comm[b - 1])


def _stage_memory(t: _Arrays, a: int, b: int) -> float:
    """Bytes of a stage over segments ``[a, b)``; the exact solver evaluates this same expression."""
    return float(t.memory_top[b - 1] - t.memory_prefix[a])


def _arrays(problem: Problem, num_stages: int) -> _Arrays:
    """Check the stage count against ``problem`` and precompute the arrays every solver works on."""
    n = len(problem.compute)
    _check_stages(num_stages, n)

    def column(values: Sequence[float] | None) -> np.ndarray:
        return np.zeros(n) if values is None else np.asarray(values, dtype=np.float64)

    compute_prefix = np.concatenate(([0.0], np.cumsum(column(problem.compute))))
    memory_prefix = np.concatenate(([0.0], np.cumsum(column(problem.memory))))
    return _Arrays(
        compute_prefix=compute_prefix,
        compute_top=compute_prefix[1:] + column(problem.head),
        comm=column(problem.comm),
        memory_prefix=memory_prefix,
        memory_top=memory_prefix[1:] + column(problem.head_memory),
        speeds=_per_device("speeds", problem.speeds, num_stages, 1.0),
        caps=_per_device("memory_limit", problem.memory_limit, num_stages, math.inf),
    )


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


def _vector(name: str, values: object) -> np.ndarray:
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


def _check_stages(num_stages: int, n: int) -> None:
    """Raise unless ``num_stages`` non-empty stages can be made from ``n`` segments."""
    if num_stages < 1:
        raise PartitionError(f"cannot make {num_stages} stages from {n} segments (at least 1 stage)")
    if num_stages > n:
        raise PartitionError(f"cannot make {num_stages} stages from {n} segments (at most {n} stages)")


def _check_ends(ends: Sequence[int], n: int) -> None:
    """Raise unless ``ends`` are strictly increasing stage ends from at least 1 up to exactly ``n``."""
    if not (len(ends) >= 1 and ends[0] >= 1 and ends[-1] == n and all(a < b for a, b in zip(ends, ends[1:]))):
        raise PartitionError(
            f"stage ends {tuple(ends)} do not partition {n} segments; "
            f"expected strictly increasing ends, the first >= 1 and the last == {n}"
        )


def _infeasible(caps: np.ndarray, min_limit: float) -> InfeasibleMemoryError:
    """The error for memory caps that no partition into ``len(caps)`` stages fits."""
    if (caps == caps[0]).all():
        found, smallest = f"a memory limit of {_fmt_bytes(caps[0])} per device", "limit"
    else:
        found = f"the memory limits {', '.join(_fmt_bytes(c) for c in caps)} per device"
        smallest = "uniform limit"
    return InfeasibleMemoryError(
        f"no partition into {len(caps)} stages fits {found}; the smallest {smallest} that works is "
        f"{_fmt_bytes(min_limit)} (raise memory_limit or use more devices)",
        min_limit=min_limit,
    )


def _fmt_bytes(value: float) -> str:
    """A byte count in binary units with one decimal, e.g. ``1.6 GiB``."""
    if math.isinf(value):
        return "unlimited"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while value >= 1024 and power < len(units) - 1:
        value /= 1024
        power += 1
    return f"{value:.1f} {units[power]}"


from . import baselines, exact  # noqa: E402,F401  (registers the built-in partitioners)

"""Pure solvers that cut a sequence of model segments into contiguous pipeline stages, one stage per device.

Takes: lists of numbers (each segment's cost and memory, device speeds, memory caps: :mod:`.problem`), never
torch. Gives: the stage layout: exact, uniform, greedy and by-parameter solvers (:mod:`.exact`, :mod:`.baselines`),
with replicas (:mod:`.replicas`), a stage's cost defined once (:mod:`.objective`), the batch split across replicas
(:mod:`.batch`), and their errors (:mod:`.errors`). Installed as ``ppll_compile.partitioners``.
"""

from __future__ import annotations

if __name__ == "partitioners":  # this folder imported by its old top-level name from a source checkout
    raise ImportError("'partitioners' is installed as 'ppll_compile.partitioners' (a top-level 'partitioners' would clash "
                      "with other packages): import ppll_compile.partitioners")

import itertools
import math
from collections.abc import Callable, Sequence

from .errors import InfeasibleMemoryError, PartitionError
from .problem import Arrays, Problem, check_ends, check_stages, infeasible

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
    check_stages(num_stages, len(problem.compute))
    ends = SOLVERS[method](problem, num_stages)
    check_ends(ends, len(problem.compute))
    return ends


def stage_costs(problem: Problem, ends: Sequence[int]) -> list[float]:
    """Time in seconds of each stage of the partition ``ends``."""
    t = Arrays.of(problem, len(ends))
    check_ends(ends, len(problem.compute))
    return [t.stage_cost(j, a, b) for j, (a, b) in enumerate(zip((0, *ends), ends))]


def stage_memory(problem: Problem, ends: Sequence[int]) -> list[float]:
    """Bytes each stage of the partition ``ends`` needs."""
    t = Arrays.of(problem, len(ends))
    check_ends(ends, len(problem.compute))
    return [t.stage_memory(a, b) for a, b in zip((0, *ends), ends)]


def bottleneck(problem: Problem, ends: Sequence[int]) -> float:
    """Time of the slowest stage of the partition ``ends``, which bounds the pipeline's throughput."""
    return max(stage_costs(problem, ends))


def brute_force(problem: Problem, num_stages: int) -> tuple[int, ...]:
    """Reference min-max partition found by trying every placement of cuts; for small problems and tests."""
    t = Arrays.of(problem, num_stages)
    n = len(problem.compute)
    best: tuple[int, ...] | None = None
    best_cost = min_limit = math.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        ends = (*cuts, n)
        spans = list(zip((0, *cuts), ends))
        memory = [t.stage_memory(a, b) for a, b in spans]
        min_limit = min(min_limit, max(memory))
        if all(m <= cap for m, cap in zip(memory, t.caps)):
            cost = max(t.stage_cost(j, a, b) for j, (a, b) in enumerate(spans))
            if cost < best_cost or best is None:
                best, best_cost = ends, cost
    if best is None:
        raise infeasible(t.caps, min_limit)
    return best


from . import baselines, exact  # noqa: E402,F401  (registers the built-in partitioners)

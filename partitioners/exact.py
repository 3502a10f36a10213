"""Exact min-max partitioning under memory caps and device speeds, by threshold search over reachability probes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import register
from .objective import Segments, stage_seconds
from .problem import Arrays, Problem, infeasible

_SLACK = 1e-9
"""Relative margin that keeps the window pruning and the lower bounds safe against float rounding."""


@register("exact")
def exact_partition(problem: Problem, num_stages: int) -> tuple[int, ...]:
    """Stage ends that minimise the slowest stage's time among all partitions that fit the memory caps.

    Raises ``InfeasibleMemoryError`` (with the smallest uniform cap that would work) when none fits.
    """
    t = Arrays.of(problem, num_stages)
    if t.starts:
        return _dynamic(t)
    ends, _ = _probe(t, math.inf)
    if ends is None:
        raise infeasible(t.caps, _min_limit(t))
    return _min_max(t, ends)


def _dynamic(t: Arrays) -> tuple[int, ...]:
    """The min-max partition by a DP over (stage, end), every start tried: for costs with a ``start`` term, which the
    probes' window bounds do not cover. ``O(k n^2)``."""
    n, k = len(t.segments.comm), len(t.speeds)
    a, b = np.arange(n)[:, None], np.arange(1, n + 1)[None, :]
    memory = np.where(a < b, t.memory_top[b - 1] - t.memory_prefix[a], math.inf)
    best = np.full((k + 1, n + 1), math.inf)
    best[0, 0] = 0.0
    start = np.zeros((k + 1, n + 1), dtype=int)
    for j in range(k):
        cost = t.segments.cost(a, b, speed=t.speeds[j], cross=t.crossing(j))
        cost = np.where((a < b) & (memory <= t.caps[j]), cost, math.inf)
        step = np.maximum(best[j][:n, None], cost)
        best[j + 1, 1:], start[j + 1, 1:] = step.min(axis=0), step.argmin(axis=0)
    if not math.isfinite(best[k, n]):
        raise infeasible(t.caps, _min_limit(t))
    ends, end = [], n
    for j in range(k, 0, -1):
        ends.append(end)
        end = int(start[j, end])
    return tuple(reversed(ends))


def _min_limit(t: Arrays) -> float:
    """Smallest uniform memory cap that some partition fits: the min-max over stage memory instead of time."""
    k, n = len(t.speeds), len(t.memory_top)
    by_memory = dataclasses.replace(
        t,
        segments=Segments(compute_prefix=t.memory_prefix, compute_top=t.memory_top, compute_bottom=t.memory_prefix,
                          comm=np.zeros(n), grad_prefix=np.zeros(n + 1), grad_top=np.zeros(n)),
        speeds=np.ones(k),
        caps=np.full(k, math.inf),
    )
    ends, _ = _probe(by_memory, math.inf)
    return _bottleneck(by_memory, _min_max(by_memory, ends))


def _min_max(t: Arrays, ends: tuple[int, ...]) -> tuple[int, ...]:
    """Improve the feasible partition ``ends`` to one whose slowest stage is as fast as possible.

    Keeps ``lo <= optimum <= hi``. A passing probe at ``limit`` yields a partition whose actual bottleneck
    (at most ``limit``) becomes ``hi``; a failing one proves the optimum exceeds ``limit`` and is at least
    the smallest threshold at which the probe could have accepted something more, which becomes ``lo``.
    Both move strictly and the optimum is the cost of a real stage, so the search ends on it exactly.
    Probes start just above the lower bound ``total compute / total speed``, where the reachability
    windows are narrow and probes cheap, and widen towards bisection after each failure.
    """
    lo = float(t.segments.compute_prefix[-1] / t.speeds.sum()) * (1 - _SLACK)
    hi, fraction = _bottleneck(t, ends), 1 / 64
    while lo < hi:
        limit = lo + (hi - lo) * fraction
        limit = limit if limit < hi else lo
        found, bound = _probe(t, limit)
        if found is None:
            lo, fraction = max(bound, float(np.nextafter(limit, math.inf))), min(2 * fraction, 1 / 2)
        else:
            ends, hi = found, _bottleneck(t, found)
    return ends


def _probe(t: Arrays, limit: float) -> tuple[tuple[int, ...] | None, float]:
    """A partition whose stages all cost at most ``limit`` and fit the memory caps, if one exists.

    Otherwise ``None`` and a threshold below which every probe fails the same way: the smallest cost the
    probe rejected, or the smallest limit at which a stage end it pruned could become usable.

    After stage ``j``, ``reach`` marks the positions a partition can have reached. For an end ``b`` the
    best start is the largest reachable position below ``b``: stage compute and memory only shrink as the
    start moves right, while head and comm depend on ``b`` alone (and on ``j``: a send across nodes). Stage
    ends are only tried in a window:
    a stage cannot end after compute ``limit * speed`` beyond the last reachable position, nor so early
    that the later stages cannot carry the rest of the compute at ``limit``.
    """
    n, k = len(t.segments.comm), len(t.speeds)
    prefix, total = t.segments.compute_prefix, float(t.segments.compute_prefix[-1])
    later_speed = np.append(np.cumsum(t.speeds[::-1])[-2::-1], 0.0)  # total speed of the stages after j
    positions = np.arange(n)
    reach = np.zeros(n + 1, dtype=bool)
    reach[0] = True
    first = last = 0  # first and last reachable position
    bound = math.inf
    starts: list[tuple[int, np.ndarray]] = []
    for j in range(k):
        low, high = (first + 1 if j < k - 1 else n), n - (k - 1 - j)  # the window of stage ends b
        if limit < math.inf:
            reach_to = prefix[last] + limit * t.speeds[j] * (1 + _SLACK) + _SLACK * total
            cut = int(np.searchsorted(prefix, reach_to, side="right")) - 1
            if cut < high:
                high, bound = cut, min(bound, float((prefix[cut + 1] - prefix[last]) / t.speeds[j]))
            if j < k - 1:
                leave = total - limit * later_speed[j] * (1 + _SLACK) - _SLACK * total
                cut = int(np.searchsorted(prefix, leave, side="left"))
                if cut > low:
                    low = cut
                    bound = min(bound, float((total - prefix[cut - 1]) / later_speed[j]) * (1 - _SLACK))
        if low > high:
            return None, bound
        start = np.maximum.accumulate(positions[first:high] * reach[first:high])[low - 1 - first :]
        compute, send = stage_seconds(t.segments.compute_top[low - 1 : high] - prefix[start],
                                      t.segments.sends(t.crossing(j))[low - 1 : high], speed=t.speeds[j])
        cost = compute + send  # start[a] is 0 here (else _dynamic): prefix[start] is the stage's bottom
        good = cost <= limit
        over = ~good
        if t.caps[j] < math.inf:
            fits = t.memory_top[low - 1 : high] - t.memory_prefix[start] <= t.caps[j]
            good &= fits
            over &= fits
        bound = min(bound, float(np.where(over, cost, math.inf).min()))
        hits = np.flatnonzero(good)
        if len(hits) == 0:
            return None, bound
        reach[:] = False
        reach[low : high + 1] = good
        first, last = low + int(hits[0]), low + int(hits[-1])
        starts.append((low, start))
    ends, b = [], n
    for low, start in reversed(starts):
        ends.append(b)
        b = int(start[b - low])
    return tuple(reversed(ends)), bound


def _bottleneck(t: Arrays, ends: tuple[int, ...]) -> float:
    """Time of the slowest stage of ``ends``."""
    return max(t.stage_cost(j, a, b) for j, (a, b) in enumerate(zip((0, *ends), ends)))


def fitting_stage_counts(problem: Problem) -> list[int]:
    """Every stage count (one device each, every device with ``problem``'s one memory cap) at which some partition
    fits the cap, ascending; what the exact partitioner's memory check admits, found without timing any stage.

    A DP over segment ends: bit ``k`` of ``reach[b]`` says that ``k`` stages can end exactly at segment ``b``, each
    within the cap; ``O(n^2)`` big-integer ORs, however many stage counts are asked about."""
    t = Arrays.of(problem, 1)
    n, cap = len(t.memory_top), t.caps[0]
    reach = [1] + [0] * n
    for b in range(1, n + 1):
        row = 0
        for a in np.flatnonzero(t.memory_top[b - 1] - t.memory_prefix[:b] <= cap):
            row |= reach[a]
        reach[b] = row << 1
    return [k for k in range(1, n + 1) if reach[n] >> k & 1]

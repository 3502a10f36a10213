"""Exact hybrid partitioning: contiguous pipeline stages, each data-parallel over its own number of replicas."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .batch import most_replicas
from .errors import InfeasibleMemoryError, PartitionError
from .objective import Links, Segments
from .problem import check_ends, check_gpus_per_node, format_bytes, vector

_SEGMENT_FIELDS = ("head", "comm", "start", "grad_bytes", "head_grad_bytes", "memory", "head_memory", "cross_comm")


@dataclass(frozen=True, kw_only=True)
class ReplicaProblem:
    """Per-segment costs of a model cut into ``n`` segments, to be laid out as replicated stages on ``devices`` devices.

    A stage over segments ``[a, b)`` with ``r`` replicas costs ``(work + comm[b-1]) / r + sync`` seconds (the
    objective of :mod:`partitioners.objective` at speed 1), where ``work = sum(compute[a:b]) - start[a] + head[b-1]``
    and, when ``r > 1``,
    ``sync = 2 (r-1)/r * (sum(grad_bytes[a:b]) + head_grad_bytes[b-1]) / allreduce_bandwidth``; each replica
    needs ``sum(memory[a:b]) + head_memory[b-1]`` bytes. ``None`` means zeros for per-segment fields. With
    ``split_compute`` (measured times at each replica's share of the batch), ``sum(compute[a:b]) / r`` is
    replaced by ``sum(split_compute[r-2][a:b])`` for ``r >= 2``. With ``gpus_per_node``, stage ``j``'s replicas
    take the next devices after stage ``j - 1``'s (from device 0); its send takes ``cross_comm[b-1]`` instead of
    ``comm[b-1]`` when its last device and the next stage's first sit on different nodes, and its all-reduce runs
    at ``inter_node_bandwidth`` when its replicas span nodes (:class:`partitioners.objective.Links`).
    """

    compute: Sequence[float]
    """Per segment: seconds of work at the full batch on one device (split over replicas)."""
    head: Sequence[float] | None = None
    """Per segment ``i``: seconds of the aux head paid by a stage ending at ``i`` (split over replicas)."""
    comm: Sequence[float] | None = None
    """Per segment ``i``: seconds to send the boundary after ``i`` at the full batch (0 for the last)."""
    start: Sequence[float] | None = None
    """Per segment ``a``: seconds a stage starting at ``a`` saves (its input arrives detached: no input gradient)."""
    grad_bytes: Sequence[float] | None = None
    """Per segment: bytes of gradients all-reduced when its stage is replicated."""
    head_grad_bytes: Sequence[float] | None = None
    """Per segment ``i``: bytes of the aux head's gradients at the cut after ``i`` (the head is replicated too)."""
    allreduce_bandwidth: float = 25e9
    """Bytes per second of the all-reduce inside a replicated stage."""
    memory: Sequence[float] | None = None
    """Per segment: bytes one replica needs (replication does not split it)."""
    head_memory: Sequence[float] | None = None
    """Per segment ``i``: bytes of the aux head at the cut after ``i``."""
    memory_limit: float | None = None
    """Per-device memory cap in bytes, or ``None`` for no cap."""
    devices: int
    """Devices available; the replicas of all stages together use at most this many."""
    max_replicas: int | None = None
    """Cap on each stage's replica count (1 disables replication); ``None`` means ``devices``."""
    batch: int | None = None
    """Examples per training step; a stage runs on at most this many replicas (one example each at least,
    :func:`partitioners.batch.most_replicas`), or ``None`` for no such cap."""
    stages: int | None = None
    """Exact number of stages, or ``None`` to let the solver choose any from 1 to ``min(n, devices)``."""
    split_compute: Sequence[Sequence[float]] | None = None
    """``split_compute[r-2][i]``: seconds of segment ``i`` on each of ``r >= 2`` replicas (at its batch share);
    replaces ``compute[i] / r``, and caps the replicas of a stage at ``len(split_compute) + 1``."""
    cross_comm: Sequence[float] | None = None
    """Per segment ``i``: seconds to send the boundary after ``i`` to another node at the full batch (``None``:
    ``comm``)."""
    gpus_per_node: int | None = None
    """Consecutive devices per node (device ``d`` is on node ``d // gpus_per_node``), or ``None`` for one node."""
    inter_node_bandwidth: float | None = None
    """Bytes per second of the all-reduce of a stage whose replicas span nodes (``None``: ``allreduce_bandwidth``)."""

    def __post_init__(self) -> None:
        n = len(_column("compute", self.compute))
        if n == 0:
            raise PartitionError(
                "ReplicaProblem.compute is empty; expected one cost per segment (a model has at least one)"
            )
        for name in _SEGMENT_FIELDS:
            values = getattr(self, name)
            if values is not None and len(_column(name, values)) != n:
                raise PartitionError(
                    f"ReplicaProblem.{name} has {len(values)} entries but compute has {n}; "
                    "expected one entry per segment (or None)"
                )
        if not (_is_number(self.allreduce_bandwidth) and self.allreduce_bandwidth > 0):
            raise PartitionError(
                f"ReplicaProblem.allreduce_bandwidth is {self.allreduce_bandwidth!r}; "
                "expected a positive number of bytes per second"
            )
        if self.inter_node_bandwidth is not None and not (_is_number(self.inter_node_bandwidth)
                                                          and self.inter_node_bandwidth > 0):
            raise PartitionError(
                f"ReplicaProblem.inter_node_bandwidth is {self.inter_node_bandwidth!r}; "
                "expected a positive number of bytes per second, or None for allreduce_bandwidth"
            )
        check_gpus_per_node("ReplicaProblem", self.gpus_per_node)
        if self.memory_limit is not None and not (_is_number(self.memory_limit) and self.memory_limit >= 0):
            raise PartitionError(
                f"ReplicaProblem.memory_limit is {self.memory_limit!r}; "
                "expected a non-negative number of bytes (use None for no cap)"
            )
        if not (_is_whole(self.devices) and self.devices >= 1):
            raise PartitionError(f"ReplicaProblem.devices is {self.devices!r}; expected a whole number of devices >= 1")
        if self.batch is not None and not (_is_whole(self.batch) and self.batch >= 1):
            raise PartitionError(f"ReplicaProblem.batch is {self.batch!r}; expected a whole number of examples >= 1, "
                                 "or None for no cap on replicas by the batch")
        if self.max_replicas is not None and not (_is_whole(self.max_replicas) and self.max_replicas >= 1):
            raise PartitionError(
                f"ReplicaProblem.max_replicas is {self.max_replicas!r}; expected a whole number >= 1 "
                "(1 disables replication), or None for up to devices"
            )
        for r, row in enumerate(self.split_compute or (), 2):
            if len(_column(f"split_compute[{r - 2}]", row)) != n:
                raise PartitionError(
                    f"ReplicaProblem.split_compute[{r - 2}] has {len(row)} entries but compute has {n}; "
                    "expected one entry per segment"
                )
        most = min(n, self.devices)
        if self.stages is not None and not (_is_whole(self.stages) and 1 <= self.stages <= most):
            raise PartitionError(
                f"ReplicaProblem.stages is {self.stages!r} but {n} segments on {self.devices} devices allow 1 to "
                f"{most} stages; set stages in that range (each stage needs a segment and a device), or None"
            )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Contiguous stages and the replica count of each, with the stages' costs."""

    ends: tuple[int, ...]
    """Stage ends: strictly increasing, the last equal to the number of segments."""
    replicas: tuple[int, ...]
    """Per stage: the number of data-parallel replicas (devices) it runs on."""
    costs: tuple[float, ...]
    """Per stage: its time in seconds."""

    @property
    def bottleneck(self) -> float:
        """Time of the slowest stage, which bounds the pipeline's throughput."""
        return max(self.costs)

    @property
    def devices(self) -> int:
        """Devices the layout uses."""
        return sum(self.replicas)


def solve_replicated(problem: ReplicaProblem) -> Layout:
    """The layout that fills whole nodes if any can, then has the fastest slowest stage, then the fewest devices,
    then the fewest stages.

    Every candidate bottleneck is some stage's cost, so a binary search over the sorted stage costs finds the
    optimum exactly: a threshold is feasible when the fewest devices over layouts whose stages all cost at most it
    is within ``devices``. The fewest devices come from a DP over (segment, first free device modulo
    ``gpus_per_node``) that gives each stage the fewest replicas that meet the threshold in every residue (the rest
    of a layout depends on that state alone; 1 without nodes). Only stages that fit the memory cap are spans of the
    DP, and each on at most ``max_replicas`` (the batch's examples, :mod:`partitioners.batch`), so time and memory
    grow as segments x longest fitting stage x replicas x ``gpus_per_node``, not as segments squared x devices.
    With ``gpus_per_node``, a layout whose devices are a whole number of nodes is preferred to any other (a
    cluster runs whole nodes); when none exists, the best of the others. Raises ``InfeasibleMemoryError`` (with
    the smallest memory limit that would work) when no layout fits.
    """
    t = _Tables.of(problem)
    min_limit = _min_memory(t, problem)
    if not min_limit <= t.limit:
        raise _infeasible(problem, min_limit)
    return _Search(problem, t).solve()


class _Search:
    """The threshold search of :func:`solve_replicated` over one problem's stage costs."""

    def __init__(self, problem: ReplicaProblem, t: _Tables) -> None:
        n, most = len(t.memory_top), t.max_replicas
        g = int(t.links.gpus_per_node or 1)
        a, d = np.arange(n)[:, None], np.arange(1, n + 1)[None, :]
        b = np.minimum(a + d, n)
        fits = (a + d <= n) & (_memory(t, a, b) <= t.limit)
        width = int(np.flatnonzero(fits.any(axis=0)).max()) + 1  # the longest stage that fits
        steps = -(-most // g)  # replicas r = k g + s, k < steps, s in 1 .. g
        k, s = np.arange(steps)[:, None], np.arange(1, g + 1)[None, :]
        r = k * g + s  # (steps, g)
        a5, b5 = a[:, :, None, None, None], b[:, :width, None, None, None]
        p5 = np.arange(g)[None, None, :, None, None]
        cost = _cost(t, a5, b5, np.minimum(r, most)[None, None, None], p5)
        ok = fits[:, :width, None, None, None] & (r <= most)[None, None, None]
        self.cost = np.where(ok, cost, math.inf)  # (start, length - 1, first phase, k, s)
        phase = np.arange(g)
        self.s_of = (phase[None, :] - phase[:, None] - 1) % g  # s - 1 of a stage from phase p to phase q
        self.problem, self.n, self.g, self.width = problem, n, g, width
        self.fixed = problem.stages
        self.layers = 1 if self.fixed is None else self.fixed + 1
        self.candidates = np.unique(self.cost[np.isfinite(self.cost)])
        self.finals = [0]
        every = self.fewest(self.candidates[-1])
        if self._devices(every[0], [0])[0] > problem.devices:  # no layout fills whole nodes: the best of the others
            self.finals = list(range(g))

    def fewest(self, limit: float) -> tuple[np.ndarray, np.ndarray]:
        """``best[layer, b, q]``: fewest devices (then stages; ``layer`` stages when fixed) of stages ending at ``b``
        that leave the next free device at phase ``q``, and (start, phase, replicas) of the last of them."""
        n, g, layers, fixed = self.n, self.g, self.layers, self.fixed
        ok = self.cost <= limit
        has = ok.any(axis=3)  # (start, length - 1, p, s)
        least = np.where(has, ok.argmax(axis=3) * g + np.arange(1, g + 1), math.inf)
        phase = np.arange(g)
        least = least[:, :, phase[:, None], self.s_of]  # (start, length - 1, p, q): fewest replicas from p to q
        step = least * (n + 1) + 1 if fixed is None else least
        best = np.full((layers, n + 1, g), math.inf)
        best[0, 0, 0] = 0.0
        back = np.zeros((layers, n + 1, g, 3), dtype=np.int64)
        for end in range(1, n + 1):
            first = max(0, end - self.width)
            starts = np.arange(first, end)
            moves = step[starts, end - 1 - starts]  # (m, p, q)
            prior = best[:, first:end] if fixed is None else best[:-1, first:end]  # (layers', m, p)
            value = (prior[..., None] + moves[None]).reshape(prior.shape[0], -1, g)  # (layers', m p, q)
            pick = value.argmin(axis=1)  # (layers', q)
            low = np.take_along_axis(value, pick[:, None, :], axis=1)[:, 0]
            m, p = np.divmod(pick, g)
            row = np.stack([starts[m], p, least[starts[m], end - 1 - starts[m], p, phase[None, :]]], axis=-1)
            if fixed is None:
                best[0, end], back[0, end] = low[0], np.nan_to_num(row[0], posinf=0).astype(np.int64)
            else:
                best[1:, end], back[1:, end] = low, np.nan_to_num(row, posinf=0).astype(np.int64)
        return best, back

    def _devices(self, best: np.ndarray, finals: list[int]) -> tuple[float, int]:
        """The fewest devices of a whole layout ending at one of the phases ``finals``, and that phase."""
        keys = best[-1, self.n, finals]
        q = finals[int(keys.argmin())]
        key = best[-1, self.n, q]
        return (key if self.fixed is not None else key // (self.n + 1) if math.isfinite(key) else key), q

    def solve(self) -> Layout:
        """The optimum layout (see :func:`solve_replicated`)."""
        candidates = self.candidates
        lo, hi = 0, len(candidates) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            fits = self._devices(self.fewest(candidates[mid])[0], self.finals)[0] <= self.problem.devices
            lo, hi = (lo, mid) if fits else (mid + 1, hi)
        best, back = self.fewest(candidates[lo])
        _, q = self._devices(best, self.finals)
        ends, replicas, end, layer = [], [], self.n, self.layers - 1
        while end > 0:
            start, q, count = (int(x) for x in back[layer, end, q])
            ends.append(end)
            replicas.append(count)
            end, layer = start, layer if self.fixed is None else layer - 1
        return _layout(_Tables.of(self.problem), ends[::-1], replicas[::-1])


def _min_memory(t: _Tables, problem: ReplicaProblem) -> float:
    """The smallest per-device memory cap that some layout of ``problem`` fits (a replica holds its whole stage)."""
    n, counts = len(t.memory_top), _stage_counts(problem)
    a, b = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    memory = np.where(a < b, _memory(t, a, np.maximum(b, 1)), math.inf)
    if problem.stages is None and max(counts) == n:  # any stage count: one pass, not one per count
        best = np.full(n + 1, math.inf)
        best[0] = 0.0
        for end in range(1, n + 1):
            best[end] = np.maximum(best[:end], memory[:end, end]).min()
        return float(best[n])
    return float(min(_layers(memory, np.maximum, max(counts))[s, n] for s in counts))


def solve_fixed_replicas(problem: ReplicaProblem, replicas: Sequence[int]) -> Layout:
    """The stage ends with the fastest slowest stage when stage ``j`` runs on ``replicas[j]`` devices.

    A min-max DP over (stage, end); ``problem.stages`` and ``max_replicas`` are ignored (the replicas are given).
    """
    t = _Tables.of(problem)
    n, k = len(t.memory_top), len(replicas)
    if not (1 <= k <= n) or not all(_is_whole(r) and r >= 1 for r in replicas):
        raise PartitionError(f"replicas {tuple(replicas)} must be 1 to {n} positive whole numbers, one per stage "
                             f"of {n} segments")
    if sum(replicas) > problem.devices:
        raise PartitionError(f"replicas {tuple(replicas)} use {sum(replicas)} devices but the problem has "
                             f"{problem.devices}; use fewer replicas or more devices")
    a, b = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    memory = np.where(a < b, _memory(t, a, np.maximum(b, 1)), math.inf)
    if not _layers(memory, np.maximum, k)[k, n] <= t.limit:
        raise _infeasible(dataclasses.replace(problem, stages=k), float(_layers(memory, np.maximum, k)[k, n]))
    best = np.full((k + 1, n + 1), math.inf)
    best[0, 0] = 0.0
    start = np.zeros((k + 1, n + 1), dtype=int)
    for j, (r, first) in enumerate(zip(replicas, Links.firsts(replicas)), 1):
        cost = np.where((a < b) & (memory <= t.limit), _cost(t, a, np.maximum(b, 1), r, first), math.inf)
        step = np.maximum(best[j - 1][:, None], cost)
        best[j], start[j] = step.min(axis=0), step.argmin(axis=0)
    ends, end = [], n
    for j in range(k, 0, -1):
        ends.append(end)
        end = int(start[j, end])
    return _layout(t, ends[::-1], replicas)


def brute_force_replicated(problem: ReplicaProblem) -> Layout:
    """Reference layout found by trying every stage split and every replica assignment (the order of
    :func:`solve_replicated`: whole nodes, bottleneck, devices, stages); for small problems and tests."""
    t = _Tables.of(problem)
    n = len(t.memory_top)
    best: tuple[tuple[bool, float, int, int], Layout] | None = None
    min_limit = math.inf
    for k in _stage_counts(problem):
        for cuts in itertools.combinations(range(1, n), k - 1):
            spans = list(zip((0, *cuts), (*cuts, n)))
            worst = max(float(_memory(t, a, b)) for a, b in spans)
            min_limit = min(min_limit, worst)
            if worst > t.limit:
                continue
            for replicas in _assignments(k, problem.devices - k, t.max_replicas):
                layout = _layout(t, [b for _, b in spans], list(replicas))
                key = (not _whole(layout.devices, problem.gpus_per_node), layout.bottleneck, layout.devices, k)
                if best is None or key < best[0]:
                    best = key, layout
    if best is None:
        raise _infeasible(problem, min_limit)
    return best[1]


def _whole(devices: int, gpus_per_node: int | None) -> bool:
    """Whether ``devices`` fill a whole number of nodes (always, on one node)."""
    return gpus_per_node is None or devices % gpus_per_node == 0


def layout_costs(problem: ReplicaProblem, ends: Sequence[int], replicas: Sequence[int]) -> list[float]:
    """Time in seconds of each stage of the layout ``ends`` with ``replicas`` per stage."""
    t = _Tables.of(problem)
    check_ends(tuple(ends), len(t.memory_top))
    if len(replicas) != len(ends):
        raise PartitionError(
            f"{len(replicas)} replica counts for {len(ends)} stages; expected one replica count per stage"
        )
    for j, r in enumerate(replicas):
        if not (_is_whole(r) and 1 <= r <= t.max_replicas):
            raise PartitionError(
                f"replicas[{j}] is {r!r}; expected a whole number from 1 to {t.max_replicas} "
                "(max_replicas, at most devices and the batch's examples)"
            )
    if sum(replicas) > problem.devices:
        raise PartitionError(
            f"replicas {tuple(replicas)} use {sum(replicas)} devices but the problem has {problem.devices}; "
            "expected at most that many in total (use fewer replicas or more devices)"
        )
    return list(_layout(t, ends, replicas).costs)


@dataclass(frozen=True, kw_only=True)
class _Tables:
    """A validated problem as float64 prefix sums and per-cut terms."""

    segments: Segments
    """The per-segment seconds and gradient bytes as the sums the stage-cost objective reads."""
    memory_prefix: np.ndarray
    """``memory_prefix[i]`` is the summed memory of segments ``0 .. i-1`` (length n + 1)."""
    memory_top: np.ndarray
    """``memory_prefix[b] + head_memory[b-1]`` at index ``b-1``."""
    links: Links
    """Devices per node and the all-reduce's bytes per second inside and across nodes."""
    limit: float
    """Per-device memory cap (``inf`` for none)."""
    max_replicas: int
    """Largest replica count a stage may have."""

    @classmethod
    def of(cls, problem: ReplicaProblem) -> _Tables:
        n = len(problem.compute)
        memory = np.concatenate(([0.0], np.cumsum(np.zeros(n) if problem.memory is None
                                                  else np.asarray(problem.memory, dtype=np.float64))))
        head_memory = np.zeros(n) if problem.head_memory is None else np.asarray(problem.head_memory, np.float64)
        split = problem.split_compute
        cap = min(problem.max_replicas or problem.devices, problem.devices)
        if split is not None:
            cap = min(cap, len(split) + 1)
        if problem.batch is not None:
            cap = min(cap, most_replicas(problem.batch))
        return cls(
            segments=Segments.of(problem.compute, head=problem.head, comm=problem.comm, start=problem.start,
                                 grad_bytes=problem.grad_bytes, head_grad_bytes=problem.head_grad_bytes, split=split,
                                 cross_comm=problem.cross_comm if problem.gpus_per_node else None),
            memory_prefix=memory,
            memory_top=memory[1:] + head_memory,
            links=Links(gpus_per_node=problem.gpus_per_node, intra=float(problem.allreduce_bandwidth),
                        inter=float(problem.inter_node_bandwidth or problem.allreduce_bandwidth)),
            limit=math.inf if problem.memory_limit is None else float(problem.memory_limit),
            max_replicas=cap,
        )


def _cost(t: _Tables, a, b, r, first=0):
    """Time of the stage ``[a, b)`` on ``r`` replicas from device ``first``: the objective; scalars or broadcast
    arrays, identical bits."""
    compute, send = t.segments.placed(a, b, first, t.links, replicas=r)
    return compute + send


def _memory(t: _Tables, a, b):
    """Bytes one replica of the stage ``[a, b)`` needs; scalars or broadcast arrays."""
    return t.memory_top[b - 1] - t.memory_prefix[a]


def _layout(t: _Tables, ends: Sequence[int], replicas: Sequence[int]) -> Layout:
    """``ends`` and ``replicas`` as a ``Layout`` with each stage's cost."""
    spans = zip((0, *ends), ends, replicas, Links.firsts(replicas))
    costs = tuple(float(_cost(t, a, b, r, first)) for a, b, r, first in spans)
    return Layout(ends=tuple(int(b) for b in ends), replicas=tuple(int(r) for r in replicas), costs=costs)


def _layers(step: np.ndarray, combine: Callable, count: int) -> np.ndarray:
    """``table[s, b]``: best ``combine`` over ``s`` stages ending at ``b`` of ``step[a, b]`` (minimised)."""
    table = np.full((count + 1, step.shape[1]), math.inf)
    table[0, 0] = 0.0
    for s in range(1, count + 1):
        table[s] = combine(table[s - 1][:, None], step).min(axis=0)
    return table


def _stage_counts(problem: ReplicaProblem) -> range:
    """The stage counts a layout of ``problem`` may have."""
    if problem.stages is not None:
        return range(problem.stages, problem.stages + 1)
    return range(1, min(len(problem.compute), problem.devices) + 1)


def _assignments(k: int, spare: int, cap: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``k`` replica counts in ``1 .. cap`` that uses at most ``spare`` devices beyond one each."""
    if k == 0:
        yield ()
        return
    for r in range(1, min(cap, spare + 1) + 1):
        for rest in _assignments(k - 1, spare - (r - 1), cap):
            yield (r, *rest)


def _infeasible(problem: ReplicaProblem, min_limit: float) -> InfeasibleMemoryError:
    """The error for a memory limit that no layout fits."""
    n, devices, stages = len(problem.compute), problem.devices, problem.stages
    shape = f"{n} segments on {devices} devices" + ("" if stages is None else f" in {stages} stages")
    way = "raise memory_limit"
    if stages is None and devices < n:
        way += " or use more devices"
    elif stages is not None and stages < n:
        way += " or use more stages" + (" and devices" if stages == devices else "")
    return InfeasibleMemoryError(
        f"no layout of {shape} fits a memory limit of {format_bytes(problem.memory_limit)} per device; "
        f"the smallest limit that works is {format_bytes(min_limit)} ({way})",
        min_limit=min_limit,
    )


def _column(name: str, values: object) -> np.ndarray:
    """``partitioners.problem.vector`` with errors naming ``ReplicaProblem`` instead of ``Problem``."""
    try:
        return vector(name, values)
    except PartitionError as error:
        raise PartitionError(str(error).replace("Problem.", "ReplicaProblem.", 1)) from None


def _is_whole(value: object) -> bool:
    """Whether ``value`` is an integer (a Python or NumPy one, not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """Whether ``value`` is a real number that is not NaN (a bool is not one)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and value == value

"""Cost vectors of a plan's units (segments or blocks) -> a solver from ``partitioners`` -> the stage layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import partitioners
from partitioners.replicas import Layout, ReplicaProblem, layout_costs, solve_fixed_replicas, solve_replicated

from .analysis import Analysis
from .errors import CutError, PartitionError
from .options import PlanOptions, SavedPlan
from .phases import phase
from .plan import HeadSpec
from .policy import Policy
from .profile import first_device, time_segments

__all__ = ["Costs", "StageRequest", "StageLayout", "segment_costs", "stage_request", "ppll_layout", "block_layout"]


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What the partitioner weighs, per unit: an atomic segment of a ``ppll`` plan, a block of a ``pipebd`` one.

    Unit ``i`` ends at the cut after it; per-cut terms (``head*``, ``comm``) are paid by a stage ending there.
    """

    compute: list[float]
    """Forward and backward seconds at the full batch on one nominal device."""
    comm: list[float]
    """Seconds to send the boundary after the unit at the full batch (0 for the last unit)."""
    memory: list[int]
    """Bytes of parameters, gradients, optimizer state and saved activations."""
    grad_bytes: list[int]
    """Bytes of gradients a replicated stage all-reduces."""
    head: list[float] | None = None
    """``ppll``: seconds of the auxiliary head at the cut after the unit."""
    head_memory: list[int] | None = None
    """``ppll``: bytes of that head."""
    head_grad_bytes: list[int] | None = None
    """``ppll``: bytes of that head's gradients (replicated with its stage)."""
    params: list[int] | None = None
    """``ppll``: parameter count (the ``params`` baseline partitioner balances it)."""
    split: list[list[float]] | None = None
    """Measured seconds at each share of the batch that ``2, 3, ...`` replicas train on (``profile="time"``)."""

    def replica_problem(self, opts: PlanOptions, devices: int, cap: int | None) -> ReplicaProblem:
        """The exact replica partitioner's problem over ``devices``, each stage on at most ``cap`` of them."""
        return ReplicaProblem(compute=self.compute, head=self.head, comm=self.comm, grad_bytes=self.grad_bytes,
                              head_grad_bytes=self.head_grad_bytes, allreduce_bandwidth=opts.link_bandwidth,
                              memory=self.memory, head_memory=self.head_memory, memory_limit=opts.memory_limit,
                              devices=devices, max_replicas=cap, split_compute=self.split)


@dataclass(frozen=True, kw_only=True)
class StageRequest:
    """What the user asked of a ``ppll`` plan's stages, checked against the model."""

    manual: list[int] | None
    """Cuts given by hand (indices into the analysis' cuts), or ``None``: the partitioner chooses."""
    stages: int
    """Number of stages (the most the replica partitioner may use when it chooses them)."""
    speeds: tuple[float, ...] | None
    """Relative speed of every stage's device; ``None`` when the partitioner chooses replicas."""


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """The stages chosen over the units: where each ends, its replicas, its device's speed, and who chose."""

    ends: tuple[int, ...]
    """Stage ends in units: strictly increasing, the last equal to the number of units."""
    replicas: tuple[int, ...]
    """Per stage: the devices that run it data-parallel."""
    speeds: tuple[float, ...]
    """Per stage: the relative speed of its device."""
    partitioner: str
    """``manual``, a solver's name, or ``exact-replicas``."""
    costs: tuple[float, ...] = ()
    """Per stage: seconds as the replica partitioner costs it (empty for the stage-count solvers)."""


def segment_costs(a: Analysis, heads: Mapping[int, HeadSpec], policy: Policy, opts: PlanOptions,
                  notes: list[str]) -> Costs:
    """The ``ppll`` cost vectors: counted FLOPs over ``flops_per_second``, or times measured (``profile="time"``)."""
    n = len(a.cuts) + 1
    seg = [a.summary(a.segment_nodes(i, i), opts.optimizer) for i in range(n)]
    if opts.profile == "time":
        device = first_device(opts.devices)
        seg_time, head_time = time_segments(a, heads, policy, device)
        notes.append(f"costs measured as median forward+backward time on {device}")
    else:
        seg_time = [(s.flops_fwd + s.flops_bwd) / opts.flops_per_second for s in seg]
        head_time = {i: (h.flops_fwd + h.flops_bwd) / opts.flops_per_second for i, h in heads.items()}
    return Costs(
        compute=seg_time, head=[head_time.get(i, 0.0) for i in range(n)],
        comm=[sum(t.bytes for t in a.boundary(c)) / opts.link_bandwidth for c in a.cuts] + [0.0],
        memory=[s.memory for s in seg], grad_bytes=[s.grad_bytes for s in seg],
        head_memory=[heads[i].memory_bytes if i in heads else 0 for i in range(n)],
        head_grad_bytes=[heads[i].param_count * 4 if i in heads else 0 for i in range(n)],  # float32 heads
        params=[s.param_count for s in seg])


def stage_request(a: Analysis, opts: PlanOptions, saved: SavedPlan | None) -> StageRequest:
    """The cuts given by hand (in a saved plan or ``split_points``), the number of stages and the device speeds."""
    manual: list[int] | None = None
    if saved is not None:
        try:
            manual = [a.cut_index(c) for c in saved.cuts]
        except CutError as e:
            raise CutError(f"{saved.source}: {e}") from None
    elif opts.split_points is not None:
        manual = sorted({a.cut_index(c) for c in opts.split_points})
        if len(manual) != len(opts.split_points):
            raise CutError(f"split_points {list(opts.split_points)} name the same cut more than once")
    fixed = opts.replicas if isinstance(opts.replicas, tuple) else None
    if opts.replicas_chosen and manual is not None:
        raise ValueError("with split_points the stages are fixed: give their replicas as a tuple, e.g. "
                         "replicas=(1, 2), or drop split_points to let the partitioner choose both")
    n_stages = _stage_count(opts, manual, fixed)
    if opts.replicas_chosen:
        n_stages = min(n_stages, len(a.cuts) + 1)  # the partitioner chooses how many stages, at most one per device
    if n_stages - 1 > len(a.cuts):
        raise CutError(f"model has {len(a.cuts)} legal cut points, so at most {len(a.cuts) + 1} stages; "
                       f"got gpus={n_stages} (pass split_points=... or fewer gpus){a.dropped_summary()}")
    if opts.gpus is not None and opts.devices is not None and len(opts.devices) != opts.gpus and fixed is None:
        raise ValueError(f"devices lists {len(opts.devices)} device(s) but gpus={opts.gpus}")
    speeds = None if opts.replicas_chosen else _speeds(opts, n_stages)
    return StageRequest(manual=manual, stages=n_stages, speeds=speeds)


def _stage_count(opts: PlanOptions, manual: list[int] | None, fixed: tuple[int, ...] | None) -> int:
    if manual is not None:
        n_stages = len(manual) + 1
        if fixed is not None and len(fixed) != n_stages:
            raise ValueError(f"replicas lists {len(fixed)} count(s) for {n_stages} stages; give one per stage")
        world = sum(fixed) if fixed is not None else n_stages
        if opts.gpus is not None and opts.gpus != world:
            raise CutError(f"{len(manual)} cut(s) make {n_stages} stages" + (f" on {world} devices" if fixed else "")
                           + f", but gpus={opts.gpus}; drop gpus= or give gpus - 1 cuts")
        return n_stages
    if fixed is not None:
        if opts.gpus is not None and opts.gpus != sum(fixed):
            raise ValueError(f"replicas {list(fixed)} use {sum(fixed)} devices, but gpus={opts.gpus}; drop gpus=")
        return len(fixed)
    if opts.gpus is not None or opts.devices is not None:
        return opts.gpus or len(opts.devices or ())
    raise ValueError("say how many devices to plan for: gpus=N (or devices=[...], split_points=[...])")


def _solved(solve: Callable[[], Any]) -> Any:
    """``solve()``, timed as the ``partition`` phase, its errors raised as this package's PartitionError."""
    try:
        with phase("partition"):
            return solve()
    except partitioners.PartitionError as e:
        raise PartitionError(str(e)) from None


def ppll_layout(costs: Costs, request: StageRequest, opts: PlanOptions) -> StageLayout:
    """The ``ppll`` stages: cut by hand, by the replica partitioner (``replicas`` on), or by the named solver."""
    n = len(costs.compute)
    fixed = opts.replicas if isinstance(opts.replicas, tuple) else None
    if request.manual is not None:
        return StageLayout(ends=tuple(c + 1 for c in request.manual) + (n,),
                           replicas=fixed or (1,) * request.stages, speeds=request.speeds,  # type: ignore[arg-type]
                           partitioner="manual")
    if opts.replicas_chosen or fixed is not None:
        cap = opts.replicas if opts.replicas_chosen and opts.replicas is not True else None
        problem = costs.replica_problem(opts, sum(fixed or ()) or opts.gpus or len(opts.devices or ()), cap)
        layout = _solved(lambda: solve_fixed_replicas(problem, fixed) if fixed else solve_replicated(problem))
        return StageLayout(ends=layout.ends, replicas=layout.replicas, speeds=(1.0,) * len(layout.ends),
                           partitioner="exact-replicas", costs=layout.costs)
    problem = partitioners.Problem(compute=costs.compute, head=costs.head, comm=costs.comm, memory=costs.memory,
                                   head_memory=costs.head_memory, params=costs.params, speeds=request.speeds,
                                   memory_limit=opts.memory_limit)
    ends = _solved(lambda: partitioners.solve(problem, request.stages, opts.partitioner))
    return StageLayout(ends=ends, replicas=(1,) * request.stages, speeds=request.speeds,  # type: ignore[arg-type]
                       partitioner=opts.partitioner)


def _speeds(opts: PlanOptions, n_stages: int) -> tuple[float, ...]:
    speeds = opts.device_speeds or (1.0,) * n_stages
    if len(speeds) != n_stages:
        raise ValueError(f"device_speeds has {len(speeds)} entries for {n_stages} stages; give one per device")
    return tuple(speeds)


def block_layout(costs: Costs, manual: list[int] | None, opts: PlanOptions, gpus: int | None) -> StageLayout:
    """The ``pipebd`` stages and replicas: by hand (stage ``manual`` ends in blocks), or by the exact partitioner
    (``replicas`` fixed or not; ``replicas=False`` keeps one device per stage)."""
    r = opts.replicas
    fixed = r if isinstance(r, tuple) else None
    if manual is not None and fixed is not None and len(fixed) != len(manual):
        raise ValueError(f"replicas lists {len(fixed)} count(s) for {len(manual)} stages; give one per stage")
    devices = sum(fixed) if fixed else gpus or (len(manual) if manual else None)
    if devices is None:
        raise ValueError("say how many devices to plan for: gpus=N (or devices=[...], replicas=(...))")
    cap = 1 if r is False else int(r) if opts.replicas_chosen and r is not True else None
    problem = costs.replica_problem(opts, devices, cap)
    if manual is not None:
        reps = tuple(fixed or [1] * len(manual))
        layout = _solved(lambda: Layout(ends=tuple(manual), replicas=reps,
                                        costs=tuple(layout_costs(problem, manual, reps))))
    else:
        layout = _solved(lambda: solve_fixed_replicas(problem, fixed) if fixed else solve_replicated(problem))
    partitioner = "manual" if manual is not None else "exact" if r is False else "exact-replicas"
    return StageLayout(ends=layout.ends, replicas=layout.replicas, speeds=(1.0,) * len(layout.ends),
                       partitioner=partitioner, costs=layout.costs)

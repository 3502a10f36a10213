"""Cost vectors of a plan's units (segments or blocks) -> a solver from ``partitioners`` -> the stage layout."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppll_compile import partitioners
from ppll_compile.partitioners.batch import most_replicas, split_refusal
from ppll_compile.partitioners.exact import fitting_stage_counts
from ppll_compile.partitioners.objective import Links
from ppll_compile.partitioners.replicas import (
    Layout,
    layout_costs,
    solve_fixed_replicas,
    solve_replicated,
)

from ..analysis.analyse import Analysis
from ..cost.hardware import load_hardware
from ..cost.modules import ModuleCost
from ..cost.roofline import (
    DeviceFigures,
    Op,
    device_figures,
    seconds,
    stage_threads,
    step_ops,
)
from ..errors import CutError, InfeasibleMemoryError
from ..heads.policy import Policy

# upward (place -> lower): profile="time" times candidate stages by lowering them
from ..lower.profile import first_device, time_stages
from ..options import PlanOptions, SavedPlan
from ..phases import phase
from ..plans.plan import Plan
from ..plans.specs import HeadSpec, StageTime
from ..plans.units import format_bytes
from .checkpointing import checkpointed
from .costs import Costs


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
    """Per stage: seconds as the solver's objective costs it (empty for cuts given by hand in a ``ppll`` plan)."""

    @property
    def firsts(self) -> list[int]:
        """Per stage: its first device (the stages' replicas take consecutive devices from 0)."""
        return Links.firsts(self.replicas)


def segment_costs(a: Analysis, heads: Mapping[int, HeadSpec], head_costs: Mapping[int, ModuleCost], policy: Policy,
                  opts: PlanOptions, devices: int) -> tuple[Costs, DeviceFigures | None, tuple[str, ...]]:
    """The ``ppll`` cost vectors, by ``opts.profile``: ``roofline`` (every operator's FLOPs and bytes over the
    calibrated figures of the first device, whose cores ``devices`` stages share on a CPU, plus the optimizer
    step; also the starting point of ``time``, see :func:`time_layout`) or ``flops`` (counted FLOPs over
    ``flops_per_second``); the roofline figures used; and the plan's notes on them."""
    n = len(a.cuts) + 1
    nodes = [a.segment_nodes(i, i) for i in range(n)]
    seg = [a.summary(ns, opts.optimizer, detached=False) for ns in nodes]  # as part of a larger stage
    figures = None
    notes: tuple[str, ...] = ()
    if opts.profile == "flops":
        seg_time = [(s.flops_fwd + s.flops_bwd) / opts.flops_per_second for s in seg]
        start = [0.0] + [(seg[i].flops_bwd - a.summary(nodes[i], opts.optimizer).flops_bwd) / opts.flops_per_second
                         for i in range(1, n)]
        head_time = {i: (h.flops_fwd + h.flops_bwd) / opts.flops_per_second for i, h in heads.items()}
        step = head_step = None
    else:  # roofline; a time profile starts from it (see time_layout)
        figures = plan_figures(opts, devices, [op for ns in nodes for op in a.ops(ns, detached=False) + a.ops(ns)]
                               + [op for c in head_costs.values() for op in c.ops])
        seg_time = [seconds(a.ops(ns, detached=False), figures) for ns in nodes]
        start = [0.0] + [max(0.0, seg_time[i] - seconds(a.ops(nodes[i]), figures)) for i in range(1, n)]
        step = [seconds(step_ops(a.trained_param_bytes(ns), opts.optimizer), figures) for ns in nodes]
        seg_time = [t + s for t, s in zip(seg_time, step)]
        steps = {i: seconds(step_ops(_param_tensors(c), opts.optimizer), figures) for i, c in head_costs.items()}
        head_time = {i: seconds(c.ops, figures) + steps[i] for i, c in head_costs.items()}
        head_step = [steps.get(i, 0.0) for i in range(n)]
        notes = (figures.describe(),)
    costs = Costs(
        compute=seg_time, head=[head_time.get(i, 0.0) for i in range(n)], start=start, step=step, head_step=head_step,
        comm=[sum(t.bytes for t in a.boundary(c)) / opts.links().intra for c in a.cuts] + [0.0],
        memory=[s.memory for s in seg], grad_bytes=[s.grad_bytes for s in seg],
        head_memory=[heads[i].memory_bytes if i in heads else 0 for i in range(n)],
        head_grad_bytes=[heads[i].param_count * 4 if i in heads else 0 for i in range(n)],  # float32 heads
        params=[s.param_count for s in seg], batch=planned_batch(a))
    return (checkpointed(costs, a, seg, opts, figures) if opts.checkpoint_activations else costs), figures, notes


def planned_batch(a: Analysis) -> int | None:
    """The examples a training step of the analysed model feeds (its first input's first dimension), or ``None``
    when it has no tensor input."""
    return int(a.inputs[0].shape[0]) if a.inputs and a.inputs[0].shape else None


def check_batch_split(costs: Costs, replicas: Sequence[int], why: str) -> None:
    """Raise unless every stage's replicas (given by hand: ``why`` says where) can split the batch
    (:func:`~ppll_compile.partitioners.batch.split_refusal`, the runtime's rule)."""
    for j, r in enumerate(replicas):
        refusal = None if costs.batch is None else split_refusal(costs.batch, r)
        if refusal is not None:
            raise ValueError(f"stage {j} of {why} runs on {r} replicas, but {refusal} (each replica trains on its "
                             f"own examples): give stage {j} at most {most_replicas(costs.batch or 1)} replicas, "
                             f"or plan a larger batch (batch_size=...)")


SLOW_STAGE_SECONDS = 60.0
"""Predicted seconds per training step of a plan's slowest stage above which planning warns (see
:func:`slow_stage_note`)."""


def slow_stage_note(plan: Plan) -> str | None:
    """The plan's warning when its slowest stage is predicted to take more than :data:`SLOW_STAGE_SECONDS` per
    training step on its device (``None`` when no stage does): the stage, its predicted time, the device the costs
    are of, and the ways out."""
    stage = plan.stages[plan.bottleneck_stage]
    if not stage.cost > SLOW_STAGE_SECONDS:
        return None
    if plan.profile == "roofline" and plan.calibration.get("device"):
        device = f"{stage.device} ({plan.calibration['device']})"
    elif plan.profile == "flops":
        device = f"{stage.device} at {plan.flops_per_second:.3g} FLOP/s (profile='flops')"
    else:
        device = f"{stage.device} (measured)"
    return (f"stage {stage.index} is predicted to take {stage.cost:.0f} s ({stage.cost / 60:.1f} min) per training "
            f"step on {device}: training will take minutes per batch; ways out: a smaller batch or input "
            f"(batch_size=...), more devices (gpus={plan.world_size + 1} or more; replicas=True lets stages share a "
            f"batch), or a faster device (devices=[...], or hardware=NAME to plan for the machine that will train)")


def _param_tensors(cost: ModuleCost) -> list[int]:
    """A head's parameter bytes as the optimizer step sees them (float32; one tensor, as the count is what
    matters for bandwidth)."""
    return [4 * cost.param_count] if cost.param_count else []


def plan_figures(opts: PlanOptions, devices: int, ops: Sequence[Op]) -> DeviceFigures:
    """The roofline figures of the device a plan's stages run on, with the times of ``ops``' compute operators at
    their shapes: the first requested device, else the first GPU, else the CPU, whose cores ``devices`` stages
    share (each gets ``cores // devices`` threads, as the runtimes give them). With ``hardware=`` a preset's or a
    file's figures, nothing measured or timed here (``cpu``: this machine's CPU, as without it)."""
    hardware = load_hardware(opts.hardware) if opts.hardware is not None else None
    if hardware is not None and hardware.figures is not None:
        return hardware.figures
    device = first_device(opts.devices) if hardware is None else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")
    return device_figures(device, stage_threads(device, devices), calls={op.call: None for op in ops if op.call})


def time_layout(a: Analysis, heads: Mapping[int, HeadSpec], policy: Policy, opts: PlanOptions, seed: StageLayout,
                devices: int, *, search: bool = True
                ) -> tuple[StageLayout, dict[tuple[int, int], StageTime], str]:
    """The ``time`` profile: whole candidate stages timed on the first device (a full training step each: forward,
    head, backward, optimizer step; :func:`~ppll_compile.lower.profile.time_stages`), and the layout whose slowest
    measured stage is fastest. The candidates are the stages whose ends lie within 2 legal cuts (1 beyond 2
    stages) of ``seed``'s, the roofline plan; ``search=False`` times ``seed``'s own stages only (cuts given by
    hand, replicated stages). Returns the layout, its stages' times by (first, last) segment, and the plan's note
    on the measurement."""
    n = len(a.cuts) + 1
    k = len(seed.ends)
    reach = (2 if k <= 2 else 1) if search else 0
    options = [sorted({e + d for d in range(-reach, reach + 1) if 1 <= e + d <= n - (k - 1 - j)}) if j < k - 1
               else [n] for j, e in enumerate(seed.ends)]
    intervals = sorted({(s, e - 1) for j in range(k) for s in ([0] if j == 0 else options[j - 1])
                        for e in options[j] if s < e})
    device = first_device(opts.devices)
    threads = torch.get_num_threads()
    torch.set_num_threads(stage_threads(device, devices))
    began = time.perf_counter()
    try:
        times = time_stages(a, heads, policy, device, opts.optimizer, intervals)
    finally:
        torch.set_num_threads(threads)
    ends = _fastest(options, {(s, e + 1): t.seconds for (s, e), t in times.items()}, seed.speeds)
    spread = max(t.spread for t in times.values())
    note = (f"costs measured on {device} as whole training steps of {len(intervals)} candidate stage(s) "
            f"(forward, head, backward, optimizer step; the least of 3 rounds' medians of 3 steps, rounds "
            f"within {100 * spread:.0f}% of each other) in {time.perf_counter() - began:.1f} s")
    layout = dataclasses.replace(seed, ends=ends, costs=())
    return layout, {(s, e - 1): times[(s, e - 1)] for s, e in zip((0, *ends), ends)}, note


def _fastest(options: list[list[int]], seconds: Mapping[tuple[int, int], float],
             speeds: Sequence[float]) -> tuple[int, ...]:
    """The stage ends, stage ``j`` ending at one of ``options[j]``, whose slowest stage (``seconds[(start, end)]``
    over its device's speed) is fastest: a min-max DP over the measured stages."""
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for j, ends in enumerate(options):
        step: dict[int, tuple[float, tuple[int, ...]]] = {}
        for e in ends:
            for s, (worst, chain) in best.items():
                if (s, e) in seconds:
                    cand = (max(worst, seconds[(s, e)] / speeds[j]), chain + (e,))
                    if e not in step or cand[0] < step[e][0]:
                        step[e] = cand
        best = step
    return min(best.values())[1]


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
        k = len(a.cuts)
        raise CutError((f"plan at most {k + 1} stages (gpus={k + 1} or fewer): the model has {k} legal cut point(s)"
                        if k else "the model has no legal cut point, so it runs as one stage only")
                       + f"; got gpus={n_stages}{a.dropped_summary()}")
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


def _solved(solve: Callable[[], Any], costs: Costs | None = None, opts: PlanOptions | None = None,
            devices: int = 0, *, spread: bool = True) -> Any:
    """``solve()``, timed as the ``partition`` phase (its errors are the package's own, ``min_limit`` kept); with
    ``hardware=``, a layout on ``devices`` devices that no memory cap fits is refused with the fewest devices
    that fit it (:func:`fewest_devices`; ``spread``: the replica partitioner places the stages, else one stage per
    device) and the cap that would work."""
    with phase("partition"):
        try:
            return solve()
        except InfeasibleMemoryError as e:
            if costs is None or opts is None or opts.hardware is None or opts.memory_limit is None:
                raise
            raise _refused(e, costs, opts, devices, spread) from None


def fewest_devices(costs: Costs, memory_limit: float, gpus_per_node: int | None = None,
                   spread: bool = True) -> int | None:
    """The fewest devices, a whole number of nodes of ``gpus_per_node`` (any number without), on which a layout
    fits ``memory_limit`` bytes per device; ``None`` when none does. A replica holds its whole stage, so the stage
    counts that fit (one device each: :func:`~ppll_compile.partitioners.exact.fitting_stage_counts`) decide: with
    ``spread`` (the replica partitioner places the stages, leaving devices idle where it must) the fewest of them
    rounded up to whole nodes; without it (one stage per device) the fewest that is a whole number of nodes."""
    g = gpus_per_node or 1
    for k in fitting_stage_counts(costs.problem(None, memory_limit)):
        if spread or k % g == 0:
            return -(-k // g) * g
    return None


def _refused(e: InfeasibleMemoryError, costs: Costs, opts: PlanOptions, devices: int,
             spread: bool) -> InfeasibleMemoryError:
    """The error for stages that cannot fit the memory of ``opts.hardware``'s devices on ``devices`` of them."""
    cap = opts.memory_limit
    assert cap is not None
    fewest = fewest_devices(costs, cap, opts.gpus_per_node, spread)
    where = f"the memory of hardware={opts.hardware!r} ({format_bytes(cap)} per device)" \
        if cap == load_hardware(str(opts.hardware)).memory_bytes else \
        f"memory_limit={format_bytes(cap)} per device (hardware={opts.hardware!r})"
    nodes = f", {fewest // opts.gpus_per_node} whole node(s) of {opts.gpus_per_node}" \
        if opts.gpus_per_node and fewest is not None else ""
    more = (f"the fewest devices that fit it is {fewest}{nodes} (gpus={fewest})" if fewest is not None else
            "no number of devices fits it (a single segment needs more), so only a larger cap works")
    return InfeasibleMemoryError(
        f"the stages cannot fit {where} on {devices} device(s): {more}; on {devices} device(s) the "
        f"smallest memory_limit that works is {format_bytes(e.min_limit)} (pass memory_limit= to plan for devices "
        f"with more memory)", min_limit=e.min_limit)


def idle_note(layout: StageLayout, costs: Costs, opts: PlanOptions, devices: int) -> str | None:
    """The plan's note when ``layout`` leaves some of the ``devices`` asked for idle: how many, and why more
    devices cannot make its slowest stage faster (``None`` when every device works, or the cuts were given by
    hand)."""
    used = sum(layout.replicas)
    if used >= devices or not layout.costs:
        return None
    j = max(range(len(layout.costs)), key=layout.costs.__getitem__)
    r = layout.replicas[j]
    if costs.batch is not None and r >= most_replicas(costs.batch):
        why = (f"its {r} replicas train on one example each of the batch of {costs.batch} (a replica needs an "
               f"example of its own); plan a larger batch (batch_size=...) to put more devices to work")
    else:
        near = sum(c >= 0.95 * layout.costs[j] for c in layout.costs)  # stages about as slow
        why = "no layout that gives them work has a faster slowest stage " + (
            f"({near} stages take within 5% of its time, more than the {devices - used} idle devices could each "
            f"speed up)" if near > devices - used else
            "(more replicas of it add more all-reduce and send time than they save)")
    g = opts.gpus_per_node
    nodes = f" ({used // g} whole node(s) of {g})" if g and used % g == 0 else \
        f" (no layout that fits fills whole nodes of {g})" if g else ""
    return (f"{devices - used} of the {devices} devices are left idle: the plan uses {used}{nodes}; its slowest "
            f"stage, stage {j} ({layout.costs[j]:.3g} s a step on {r} device(s)), is no faster on more: {why}")


def ppll_layout(costs: Costs, request: StageRequest, opts: PlanOptions) -> StageLayout:
    """The ``ppll`` stages: cut by hand, by the replica partitioner (``replicas`` on), or by the named solver."""
    n = len(costs.compute)
    fixed = opts.replicas if isinstance(opts.replicas, tuple) else None
    if fixed is not None:
        check_batch_split(costs, fixed, f"replicas={list(fixed)}")
    if request.manual is not None:
        opts.check_nodes(sum(fixed or (1,) * request.stages))
        return StageLayout(ends=tuple(c + 1 for c in request.manual) + (n,),
                           replicas=fixed or (1,) * request.stages, speeds=request.speeds,  # type: ignore[arg-type]
                           partitioner="manual")
    if opts.replicas_chosen or fixed is not None:
        cap = opts.replicas if opts.replicas_chosen and opts.replicas is not True else None
        devices = sum(fixed or ()) or opts.gpus or len(opts.devices or ())
        problem = costs.replica_problem(opts, devices, cap)
        layout = _solved(lambda: solve_fixed_replicas(problem, fixed) if fixed else solve_replicated(problem), costs,
                         opts, devices)
        return StageLayout(ends=layout.ends, replicas=layout.replicas, speeds=(1.0,) * len(layout.ends),
                           partitioner="exact-replicas", costs=layout.costs)
    opts.check_nodes(request.stages)
    problem = costs.problem(request.speeds, opts.memory_limit, opts.links())
    ends = _solved(lambda: partitioners.solve(problem, request.stages, opts.partitioner), costs, opts,
                   request.stages, spread=False)
    return StageLayout(ends=ends, replicas=(1,) * request.stages, speeds=request.speeds,  # type: ignore[arg-type]
                       partitioner=opts.partitioner, costs=tuple(partitioners.stage_costs(problem, ends)))


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
    if fixed is not None:
        check_batch_split(costs, fixed, f"replicas={list(fixed)}")
    problem = costs.replica_problem(opts, devices, cap)
    if manual is not None:
        reps = tuple(fixed or [1] * len(manual))
        layout = _solved(lambda: Layout(ends=tuple(manual), replicas=reps,
                                        costs=tuple(layout_costs(problem, manual, reps))), costs, opts, devices)
    else:
        layout = _solved(lambda: solve_fixed_replicas(problem, fixed) if fixed else solve_replicated(problem), costs,
                         opts, devices)
    partitioner = "manual" if manual is not None else "exact" if r is False else "exact-replicas"
    return StageLayout(ends=layout.ends, replicas=layout.replicas, speeds=(1.0,) * len(layout.ends),
                       partitioner=partitioner, costs=layout.costs)

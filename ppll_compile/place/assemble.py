"""Analysis + stage layout + heads -> the Plan: one loop over the stages for both plan kinds."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ppll_compile.partitioners.objective import stage_seconds

from ..analysis.analyse import Analysis, Summary
from ..capture.trace import module_path
from ..cost.roofline import DeviceFigures
from ..errors import user_stacklevel
from ..heads.build import head_notes, model_head, stage_head
from ..options import PlanOptions
from ..plans.plan import Plan, StagePlan, TensorSpec
from ..plans.report import large_head_notes
from ..plans.specs import HeadSpec, StageTime
from .checkpointing import checkpoint_note, checkpointed_activations, one_segment_note
from .costs import Costs

if TYPE_CHECKING:  # the layout comes from partition, which reads the plan's notes from here
    from .partition import StageLayout


@dataclass(frozen=True, kw_only=True)
class StageParts:
    """What a plan kind says of one stage: its nodes and their figures, its head, boundary and costs."""

    nodes: list[fx.Node]
    """The traced nodes the stage trains, in graph order."""
    summary: Summary
    """Their FLOPs and memory."""
    head: HeadSpec
    """The stage's head (``ppll``: auxiliary or the model's own; ``pipebd``: its distillation losses)."""
    boundary: tuple[TensorSpec, ...]
    """What it sends on (empty for the last stage)."""
    aux_flops: int
    """FLOPs beside the backbone's: the auxiliary head's, or the teacher blocks'."""
    memory_bytes: int
    """Predicted peak memory of one replica."""
    step_cost: float
    """Seconds of its optimizer step, part of ``compute_cost``."""
    compute_cost: float
    """Compute seconds per batch (over its replicas)."""
    comm_cost: float
    """Seconds to send the boundary on."""
    cost: float
    """Step time in seconds."""
    blocks: tuple[int, ...] = ()
    """``pipebd``: the blocks it trains."""
    head_cost: float = 0.0
    """Seconds of its head (the last stage: its loss) per batch, part of ``compute_cost`` (over its replicas)."""
    notes: tuple[str, ...] = ()
    """What the plan should say about the stage (its head's transfers, a boundary of several values)."""
    checkpoints: tuple[str, ...] = ()
    """``checkpoint_activations``: the legal cuts inside the stage where its checkpointed segments end."""
    kept_bytes: int = 0
    """``checkpoint_activations``: bytes kept from its forward to its backward (its segments' inputs)."""
    recompute_cost: float = 0.0
    """``checkpoint_activations``: seconds of the forward its backward runs again, part of ``compute_cost``."""


def stage_devices(n: int, requested: Sequence[str] | None) -> tuple[str, ...]:
    """One device per stage replica (``n`` in all): ``requested`` or ``cuda:0..n-1``, or every one the CPU when
    this machine lacks a CUDA device asked for (:func:`assemble`, which knows the stages, notes and warns of
    that fallback)."""
    if requested is not None and len(requested) != n:
        raise ValueError(f"devices lists {len(requested)} device(s) for {n} stages; give one per stage")
    wanted = _wanted(n, requested)
    return ("cpu",) * n if _missing_cuda(wanted) else tuple(str(d) for d in wanted)


def _wanted(n: int, requested: Sequence[str] | None) -> list[torch.device]:
    return [torch.device(d) for d in requested] if requested is not None else \
        [torch.device("cuda", i) for i in range(n)]


def _missing_cuda(wanted: Sequence[torch.device]) -> list[str]:
    """The CUDA devices in ``wanted`` that this machine does not have."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [str(d) for d in wanted if d.type == "cuda" and (d.index or 0) >= have]


def _fallback_message(missing: Sequence[str], stages: int, devices: int) -> str:
    """What a plan of ``stages`` stages on ``devices`` devices says when the CUDA devices ``missing`` are absent."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placed = "the stage" if stages == 1 else f"all {stages} stages"
    if devices > stages:
        placed += f" ({devices} replicas)"
    return (f"this machine has {have} CUDA device(s), so {', '.join(missing)} cannot be used; {placed} "
            f"{'runs' if stages == 1 else 'run'} on the CPU (pass devices=[...] to choose)")


def _cpu_fallback(layout: StageLayout, opts: PlanOptions) -> tuple[str, ...]:
    """The note that the stages run on the CPU (if they do), also warned once (on the first process of a machine
    under torchrun)."""
    n = sum(layout.replicas)
    missing = _missing_cuda(_wanted(n, opts.devices[:n] if opts.devices else None))
    if not missing:
        return ()
    msg = _fallback_message(missing, len(layout.ends), n)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # torchrun starts a process per stage: the first one says it
        warnings.warn(msg, stacklevel=user_stacklevel())
    return (msg,)


def assemble(layout: StageLayout, devices: Sequence[str], parts: Callable[[int, int, int, int], StageParts], *,
             analysis: Analysis, opts: PlanOptions, model: str, policy: str, sequential: float,
             notes: Sequence[str], figures: DeviceFigures | None = None, **kind: Any) -> Plan:
    """The validated plan of ``layout``: ``parts(j, start, end, replicas)`` describes stage ``j`` over units
    ``start .. end - 1``; ``notes`` are the earlier steps' (the CPU fallback's and the stages' follow them);
    ``kind`` holds the plan kind's own fields (``mode``, ``teacher``, ``blocks``, ...)."""
    if opts.checkpoint_activations and kind.get("mode", "ppll") != "ppll":
        raise ValueError(f"checkpoint_activations=True recomputes a ppll stage's forward in its backward; a "
                         f"{kind['mode']} plan does not support it: drop checkpoint_activations=")
    notes = (*notes, *_cpu_fallback(layout, opts))
    links = opts.links()
    stages = []
    start = offset = 0
    for j, (end, r) in enumerate(zip(layout.ends, layout.replicas)):
        p = parts(j, start, end, r)
        stages.append(StagePlan(
            crosses_nodes=bool(p.boundary) and bool(links.crosses(offset, r)),
            index=j, device=devices[offset], replicas=r, first_node=p.nodes[0].name, last_node=p.nodes[-1].name,
            first_module=module_path(p.nodes[0]), last_module=module_path(p.nodes[-1]),
            nodes=tuple(n.name for n in p.nodes), aux_flops=p.aux_flops, memory_bytes=p.memory_bytes,
            boundary=p.boundary, head=p.head, compute_cost=p.compute_cost, comm_cost=p.comm_cost, cost=p.cost,
            step_cost=p.step_cost, blocks=p.blocks, head_cost=p.head_cost, checkpoints=p.checkpoints,
            kept_bytes=p.kept_bytes, recompute_cost=p.recompute_cost, **p.summary.fields()))
        notes += p.notes
        start, offset = end, offset + r
    device = opts.memory_limit or (figures.memory_bytes if figures is not None else None)
    notes += tuple(large_head_notes(stages, device))
    a = analysis
    plan = Plan(
        model=model, inputs=a.inputs, batch_size=a.inputs[0].shape[0] if a.inputs else 0,
        num_classes=a.num_classes, policy=policy, partitioner=layout.partitioner, profile=opts.profile,
        optimizer=opts.optimizer, precision=opts.precision, fusion=opts.fused,
        flops_per_second=opts.flops_per_second, link_bandwidth=opts.link_bandwidth,
        device_speeds=layout.speeds, memory_limit=opts.memory_limit, legal_cuts=tuple(c.node for c in a.cuts),
        stages=tuple(stages), sequential_cost=sequential, notes=notes, tracer=a.tracer, hardware=opts.hardware,
        calibration=figures.record() if figures is not None else {}, **opts.topology, **kind)
    plan.validate()
    return plan


def assemble_ppll(model: str, a: Analysis, heads: Mapping[int, HeadSpec], costs: Costs, layout: StageLayout,
                  opts: PlanOptions, policy: str, notes: Sequence[str], figures: DeviceFigures | None = None,
                  measured: Mapping[tuple[int, int], StageTime] | None = None) -> Plan:
    """The ``ppll`` plan: stage ``j`` trains segments up to a cut, with the head chosen there (the last stage:
    the model's own output). Its cost is the solvers' objective (:mod:`partitioners.objective`) over ``costs``,
    or over its ``measured`` time (by first and last segment) under a time profile; its all-reduce counts a
    parameter shared inside the stage once. A head that saves its input, which the stage saves already, does
    not count it twice."""
    used = sum(layout.replicas)  # the replica partitioner may use fewer devices than given
    devices = stage_devices(used, opts.devices[:used] if opts.devices else None)
    multi = tuple(c.node for c in a.cuts if len(c.boundary) > 1)
    last_stage = len(layout.ends) - 1
    head_grad = costs.head_grad_bytes
    assert costs.head is not None and head_grad is not None, "ppll costs price a head at every cut"
    links = opts.links()
    segments, firsts = costs.segments(links), layout.firsts

    def parts(j: int, start: int, end: int, r: int) -> StageParts:
        nodes = [n for n in a.segment_nodes(start, end - 1) if n.op not in ("placeholder", "get_attr")] \
            or a.segment_nodes(start, end - 1)
        s = a.summary(nodes, opts.optimizer)
        last = j == last_stage
        cut = None if last else a.cuts[end - 1]
        head = heads.get(end - 1, model_head()) if last else stage_head(heads[end - 1], j, last_stage + 1)
        grad = s.grad_bytes + (0 if last else head_grad[end - 1])
        speed, first = layout.speeds[j], firsts[j]
        if measured is not None:
            work, step = measured[(start, end - 1)].seconds, measured[(start, end - 1)].step_seconds
            compute, send = stage_seconds(work, segments.send(end, links.crosses(first, r)), speed=speed, replicas=r,
                                          grad_bytes=grad, bandwidth=links.allreduce_bandwidth(first, r))
        else:
            compute, send = segments.placed(start, end, first, links, speed=speed, replicas=r, grad_bytes=grad)
            step = sum(costs.step[start:end]) + (0.0 if last or not costs.head_step else costs.head_step[end - 1]) \
                if costs.step else 0.0
        step /= speed * r
        said = tuple(() if last else head_notes(head, j, links.inter if links.crosses(first, r) else links.intra))
        if cut is not None and cut.node in multi:
            said += (f"stage {j} sends {len(cut.boundary)} values ({', '.join(cut.boundary)}); its aux head reads "
                     f"the first",)
        twice = head.input_saved_bytes if cut is not None and a.saves(nodes, cut.node) else 0
        recompute = sum(costs.recompute[start:end]) / (speed * r) if costs.recompute else 0.0
        kept, inside = 0, ()
        if opts.checkpoint_activations:  # backward recomputes the stage's output: the head's input is not saved twice
            ends, kept, largest = checkpointed_activations(a, costs, start, end, opts.optimizer)
            whole, twice, inside = s, 0, [a.cuts[k] for k in ends]
            s = dataclasses.replace(s, activation_bytes=kept + largest)
            if measured is not None:
                compute += recompute
            said += () if inside else (one_segment_note(j, end - start - 1, kept, s.activation_bytes, whole),)
        return StageParts(nodes=nodes, summary=s, head=head, boundary=() if cut is None else a.boundary(cut),
                          aux_flops=head.flops_fwd + head.flops_bwd,
                          memory_bytes=s.memory + head.memory_bytes - twice, step_cost=step,
                          compute_cost=float(compute), comm_cost=float(send), cost=float(compute + send), notes=said,
                          head_cost=float(costs.head[end - 1]) / (speed * r), kept_bytes=kept,
                          checkpoints=tuple(c.node for c in inside), recompute_cost=float(recompute))

    if measured is not None:
        sequential = sum(t.seconds for t in measured.values()) + sum(costs.recompute or ())
    else:  # every stage's input arrives detached, as in the pipeline; the last stage's head is its loss
        sequential = sum(costs.compute) + sum(costs.head[e - 1] for e in layout.ends) \
            - (sum(costs.start[s] for s in (0, *layout.ends[:-1])) if costs.start else 0.0)
    plan = assemble(layout, devices, parts, analysis=a, opts=opts, model=model, policy=policy,
                    sequential=sequential, notes=notes, figures=figures, multi_tensor_cuts=multi,
                    checkpoint_activations=opts.checkpoint_activations)
    if not opts.checkpoint_activations:
        return plan
    without = [a.summary(plan_nodes, opts.optimizer).activation_bytes
               for plan_nodes in ([a.by_name[n] for n in st.nodes] for st in plan.stages)]
    return dataclasses.replace(plan, notes=(*plan.notes, checkpoint_note(plan, without)))

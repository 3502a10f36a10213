"""Pipe-BD planning and lowering: analyse teacher and student, align them, cost the blocks, place, assemble, lower."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..analysis.analyse import Analysis, Summary, analyse
from ..capture.trace import module_path
from ..cost.roofline import DeviceFigures, seconds, step_ops
from ..errors import CutError, PolicyError
from ..lower.profile import first_device, time_blocks
from ..lower.split import model_inputs, split_stages
from ..lower.stages import Lowered, Stage
from ..options import PlanOptions
from ..pipeline import DistillPipeline
from ..place.assemble import StageParts, assemble, stage_devices
from ..place.costs import Costs
from ..place.partition import block_layout, idle_note, plan_figures, planned_batch
from ..plans.plan import BlockPlan, Plan, TensorSpec
from ..plans.specs import HeadSpec
from .align import Blocks, align, output_spec, stage_ends
from .policy import LOGIT_LOSSES, DistillPolicy, distill_loss, load_distill_policy


@dataclass(frozen=True, eq=False)
class PipeBD:
    """A planned teacher/student pair: the plan, the alignment, and each block's modules and loss."""

    plan: Plan
    """The ``pipebd`` plan."""
    blocks: Blocks
    """Both traced models and where their blocks end."""
    teacher: list[Stage]
    """Per block: the frozen teacher block."""
    student: list[Stage]
    """Per block: the student block (the student's own parameters)."""
    losses: list[Callable[[Tensor, Tensor], Tensor]]
    """Per block: the distillation loss ``fn(student_out, teacher_out)``."""


def _analysed_pair(student: nn.Module, teacher: nn.Module, example_inputs: Sequence[Any] | None,
                   example_kwargs: dict[str, Any] | None, opts: PlanOptions) -> tuple[Analysis, Analysis, TensorSpec]:
    """Both models traced and measured, checked to take the same inputs and return the same shape."""
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    t = analyse(teacher, example_inputs, example_kwargs, opts, need_classes=False)
    s = analyse(student, example_inputs, example_kwargs, opts, need_classes=False)
    t_in = [(x.shape, x.dtype) for x in t.inputs]
    s_in = [(x.shape, x.dtype) for x in s.inputs]
    if t_in != s_in:
        raise ValueError(f"teacher and student must take the same inputs; teacher takes {t_in}, student {s_in}")
    t_out, s_out = output_spec(t), output_spec(s)
    if t_out.shape != s_out.shape:
        raise CutError(f"the teacher returns shape {list(t_out.shape)} but the student {list(s_out.shape)}; the "
                       f"last student block learns the teacher's output, so they must agree")
    return t, s, t_out


def _most_replicas(opts: PlanOptions, gpus: int | None) -> int:
    """The most replicas any stage may get: what the time profile measures shares for."""
    r = opts.replicas
    if isinstance(r, tuple):
        return max(r)
    if r is False or opts.split_points is not None:
        return 1
    return min(gpus or 1, int(r)) if opts.replicas_chosen and r is not True else gpus or 1


def _block_costs(b: Blocks, summaries: list[tuple[Summary, Summary]], teacher: list[Stage], student: list[Stage],
                 losses: list[Callable], opts: PlanOptions, gpus: int | None
                 ) -> tuple[Costs, DeviceFigures | None, str | None]:
    """Per block: teacher forward plus student forward, backward and step (by the roofline, counted FLOPs, or timed
    at every replica share); the roofline figures used; and the plan's note on the costs."""
    split: list[list[float]] = []
    step = None
    figures = None
    note = None
    if opts.profile == "time":
        device = first_device(opts.devices)
        most = _most_replicas(opts, gpus)
        compute, *split = time_blocks(teacher, student, losses, b.teacher.real_inputs, device, most)
        note = (f"costs measured as median teacher forward + student forward/backward time on {device}"
                + (f", also at 1/2 .. 1/{most} of the batch (replicas)" if most > 1 else ""))
    elif opts.profile == "roofline":
        work = [(b.teacher.forward_ops(b.nodes(k)[0]), b.student.ops(b.nodes(k)[1]),
                 step_ops(b.student.trained_param_bytes(b.nodes(k)[1]), opts.optimizer)) for k in range(len(summaries))]
        figures = plan_figures(opts, gpus or 1, [op for t, s, _ in work for op in t + s])
        step = [seconds(st, figures) for _, _, st in work]
        compute = [seconds(t, figures) + seconds(s, figures) + st for (t, s, _), st in zip(work, step)]
        note = figures.describe()
    else:
        compute = [(ts.flops_fwd + ss.flops_fwd + ss.flops_bwd) / opts.flops_per_second for ts, ss in summaries]
    comm = [sum(v.bytes for v in b.teacher.boundary(c)) / opts.links().intra for c in b.cuts(0)] + [0.0]
    return Costs(compute=compute, comm=comm, step=step,
                 memory=[ts.param_bytes + ss.memory for ts, ss in summaries],
                 grad_bytes=[ss.grad_bytes for _, ss in summaries], split=split or None,
                 batch=planned_batch(b.student)), figures, note


def _block_plans(b: Blocks, summaries: list[tuple[Summary, Summary]], costs: Costs, losses: list[dict[str, Any]],
                 output: TensorSpec) -> tuple[BlockPlan, ...]:
    out = []
    for k, ((ts, ss), cost) in enumerate(zip(summaries, costs.compute)):
        tn, sn = b.nodes(k)
        target = b.teacher.boundary(b.cuts(0)[k])[0] if k < len(summaries) - 1 else \
            dataclasses.replace(output, name="output")
        out.append(BlockPlan(
            index=k, teacher_nodes=tuple(x.name for x in tn), student_nodes=tuple(x.name for x in sn),
            teacher_module=module_path(tn[-1]), student_module=module_path(sn[-1]), output=target,
            teacher_flops=ts.flops_fwd, flops_fwd=ss.flops_fwd, flops_bwd=ss.flops_bwd,
            param_count=ss.param_count, teacher_param_count=ts.param_count,
            memory_bytes=costs.memory[k], grad_bytes=ss.grad_bytes, loss=losses[k], cost=cost))
    return tuple(out)


def _checked_options(opts: PlanOptions) -> None:
    if opts.device_speeds is not None:
        raise ValueError("a pipebd plan assumes identical devices (replicas split the batch evenly); drop "
                         "device_speeds")
    if opts.partitioner != "exact":
        raise ValueError(f"a pipebd plan is placed by the exact replica partitioner; got "
                         f"partitioner={opts.partitioner!r} (drop it)")


def _default_rules(output: TensorSpec) -> tuple[DistillPolicy, str | None]:
    """The policy ``auto``: Pipe-BD's own (``pipebd``) when the models return N x C logits, else ``mse`` (and the
    plan's note saying why)."""
    if len(output.shape) == 2:
        return load_distill_policy("pipebd"), None
    return load_distill_policy("mse"), (
        f"policy auto: the models return shape {list(output.shape)}, not N x C logits, so the last block learns "
        f"under mse like the others (policy 'mse'); Pipe-BD's soft-target cross-entropy needs logits")


def _loss_configs(rules: DistillPolicy, n: int, output: TensorSpec) -> list[dict[str, Any]]:
    if rules.last["type"] in LOGIT_LOSSES and len(output.shape) != 2:
        raise PolicyError(f"policy {rules.name!r} compares the last block's outputs with {rules.last['type']}, which "
                          f"needs N x C logits; the models return shape {list(output.shape)} (use policy='mse')")
    return [dict(rules.loss)] * (n - 1) + [dict(rules.last)]


def plan_pipebd(student: nn.Module, teacher: nn.Module, example_inputs: Sequence[Any] | None,
                example_kwargs: dict[str, Any] | None, opts: PlanOptions,
                blocks: Sequence[Sequence[str]] | None) -> PipeBD:
    """Align, cost and place a teacher/student pair: the plan, the alignment, the block modules and losses.

    Both models are traced; their block ends are matched in order by boundary shape, or named with
    ``blocks=[(teacher_module, student_module), ...]``. Student block ``k`` takes the teacher's output of
    block ``k - 1`` and learns the teacher's output of block ``k`` under the policy's loss (``mse``; on the last
    block's logits also ``kl`` or ``soft_ce``). The default policy is Pipe-BD's own, ``pipebd`` (``mse`` on every
    block, the soft-target cross-entropy on the last block's N x C logits), or ``mse`` on every block when the
    models return no N x C logits. The exact replica partitioner groups blocks into stages and chooses
    how many devices replicate each (``replicas=False``: none; an int caps it; a tuple fixes it per stage;
    ``split_points`` names the student block ends where stages end). The teacher is put in eval mode
    with ``requires_grad=False``.
    """
    _checked_options(opts)
    chosen = None if opts.policy == "auto" else load_distill_policy(opts.policy)
    t, s, output = _analysed_pair(student, teacher, example_inputs, example_kwargs, opts)
    rules, why = (chosen, None) if chosen is not None else _default_rules(output)
    b = align(t, s, blocks)
    loss_cfg = _loss_configs(rules, len(b.ends) + 1, output)
    losses = [distill_loss(c) for c in loss_cfg]
    tb, sb = split_stages(t.gm, b.cuts(0)), split_stages(s.gm, b.cuts(1))
    summaries = [(t.summary(tn, opts.optimizer), s.summary(sn, opts.optimizer))
                 for tn, sn in map(b.nodes, range(len(b.ends) + 1))]
    gpus = opts.gpus or (len(opts.devices) if opts.devices else None)
    costs, figures, costed = _block_costs(b, summaries, tb, sb, losses, opts, gpus)
    manual = stage_ends(b, opts.split_points) if opts.split_points is not None else None
    layout = block_layout(costs, manual, opts, gpus)
    devices = stage_devices(sum(layout.replicas), opts.devices[:sum(layout.replicas)] if opts.devices else None)
    block_plans = _block_plans(b, summaries, costs, loss_cfg, output)

    segments = costs.segments(opts.links())

    def parts(j: int, start: int, end: int, r: int) -> StageParts:
        own = block_plans[start:end]
        nodes = [x for k in range(start, end) for x in b.nodes(k)[1]]
        last = j == len(layout.ends) - 1
        boundary = () if last else b.teacher.boundary(b.cuts(0)[end - 1])  # the output, and any side values
        compute, send = segments.placed(start, end, layout.firsts[j], opts.links(), replicas=r)  # the objective
        types = list(dict.fromkeys(k.loss["type"] for k in own))
        return StageParts(nodes=nodes, summary=s.summary(nodes, opts.optimizer),
                          head=HeadSpec(policy=rules.name, kind="distill", config={"type": "+".join(types)}),
                          boundary=boundary, aux_flops=sum(k.teacher_flops for k in own),
                          memory_bytes=sum(k.memory_bytes for k in own), compute_cost=float(compute),
                          step_cost=sum(costs.step[start:end]) / r if costs.step else 0.0,
                          comm_cost=float(send), cost=float(compute + send), blocks=tuple(range(start, end)))

    idle = idle_note(layout, costs, opts, gpus or sum(layout.replicas))
    notes = tuple(n for n in (why, *b.notes, costed, idle) if n is not None)
    plan = assemble(layout, devices, parts, analysis=s, opts=opts, model=type(student).__name__, policy=rules.name,
                    sequential=sum(costs.compute), notes=notes, figures=figures, mode="pipebd",
                    teacher=type(teacher).__name__,
                    blocks=block_plans)
    return PipeBD(plan=plan, blocks=b, teacher=tb, student=sb, losses=losses)


def compile_pipebd(student: nn.Module, teacher: nn.Module, example_inputs: Sequence[Any] | None,
                   example_kwargs: dict[str, Any] | None, opts: PlanOptions,
                   blocks: Sequence[Sequence[str]] | None) -> DistillPipeline:
    """Plan (see :func:`plan_pipebd`) and lower to teacher and student block modules on their stages' devices."""
    p = plan_pipebd(student, teacher, example_inputs, example_kwargs, opts, blocks)
    devices = tuple(torch.device(st.device) for st in p.plan.stages for _ in st.blocks)
    for t, s, d in zip(p.teacher, p.student, devices):
        t.to(d).eval()
        s.to(d)
    s = p.blocks.student
    lowered = Lowered(modules=tuple(p.student), heads=(None,) * len(p.student), devices=devices,
                      teacher=tuple(p.teacher), losses=tuple(p.losses),
                      inputs=model_inputs(student, s.gm, s.fixed_args))
    return DistillPipeline(model=student, teacher=teacher, plan=p.plan, graph_module=s.gm, lowered=lowered)

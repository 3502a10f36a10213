"""Pipe-BD planning: align a frozen teacher with a student block by block, cost the blocks, place them with replicas."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn
from torch.nn import functional as F

import partitioners
import policies as _policies
from partitioners.replicas import (Layout, ReplicaProblem, layout_costs, solve_fixed_replicas,
                                   solve_replicated)

from .api import (PlanOptions, _analyse, _Analysis, _devices, _memory, _model_output_spec, _resolve_cut,
                  first_device, model_inputs)
from .cost import META_KEY, time_callable
from .cuts import Cut
from .errors import CutError, PartitionError, PolicyError
from .lower import split_stages
from .lowered import Lowered, Stage, move
from .pipeline import DistillPipeline
from .plan import BlockPlan, HeadSpec, Plan, StagePlan, TensorSpec
from .trace import module_path

__all__ = ["DistillPolicy", "load_distill_policy", "distill_loss", "build", "compile_pipebd",
           "LOSSES"]

LOSSES: dict[str, dict[str, float]] = {"mse": {}, "smooth_l1": {"beta": 1.0}, "kl": {"temperature": 1.0}}
"""Distillation losses by type, with their options and defaults; ``kl`` compares N x C logits."""


# ---- the loss policy ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DistillPolicy:
    """The loss every student block is trained on to match its teacher block."""

    name: str
    """Shipped policy name or file path."""
    loss: Mapping[str, Any]
    """Loss of every block but the last: ``type`` plus options."""
    last: Mapping[str, Any]
    """Loss of the last block (on the model outputs)."""


def _check_loss(d: Any, source: str, at: str) -> dict[str, Any]:
    if not isinstance(d, Mapping) or "type" not in d:
        raise PolicyError(f"{source}: {at} must be a mapping with a 'type' ({', '.join(LOSSES)}), got {d!r}")
    kind = d["type"]
    if kind not in LOSSES:
        raise PolicyError(f"{source}: {at}.type is {kind!r}; known distillation losses: {', '.join(LOSSES)}")
    unknown = sorted(set(d) - {"type"} - set(LOSSES[kind]))
    if unknown:
        raise PolicyError(f"{source}: {at} has unknown option(s) {unknown}; {kind} takes "
                          f"{sorted(LOSSES[kind]) or 'no options'}")
    out = {"type": kind, **LOSSES[kind]}
    for k, v in d.items():
        if k != "type":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise PolicyError(f"{source}: {at}.{k} must be a positive number, got {v!r}")
            out[k] = float(v)
    return out


def load_distill_policy(policy: str | os.PathLike | Mapping[str, Any] | DistillPolicy) -> DistillPolicy:
    """A :class:`DistillPolicy` from a shipped name (``mse``, ``kl``), a YAML file, or a mapping."""
    if isinstance(policy, DistillPolicy):
        return policy
    if isinstance(policy, Mapping):
        data, source = policy, "distillation policy"
    elif isinstance(policy, (str, os.PathLike)):
        if isinstance(policy, str) and policy in _policies.distill_names():
            path = _policies.distill_path(policy)
        elif Path(policy).is_file():
            path = Path(policy)
        else:
            raise PolicyError(f"unknown distillation policy {os.fspath(policy)!r}: not a shipped one "
                              f"({', '.join(_policies.distill_names())}) nor a file; pass a shipped name or the "
                              f"path to a YAML file with 'loss:' and 'last:'")
        source = str(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise PolicyError(f"{source}: not valid YAML ({e})") from None
    else:
        raise PolicyError(f"a distillation policy is a shipped name, a YAML path or a mapping; got {policy!r}")
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: a distillation policy is a mapping with 'loss:' and 'last:'")
    unknown = sorted(set(data) - {"name", "description", "loss", "last"})
    if unknown:
        raise PolicyError(f"{source}: unknown key(s) {unknown}; a distillation policy has name, description, "
                          f"loss and last")
    loss = _check_loss(data.get("loss", {"type": "mse"}), source, "loss")
    if loss["type"] == "kl":
        raise PolicyError(f"{source}: loss.type kl compares class logits and fits only the last block; use mse "
                          f"or smooth_l1 for 'loss' and put kl under 'last'")
    last = _check_loss(data.get("last", loss), source, "last")
    name = policy if isinstance(policy, str) and policy in _policies.distill_names() else str(data.get("name", source))
    return DistillPolicy(name=name, loss=loss, last=last)


def distill_loss(config: Mapping[str, Any]) -> Callable[[Tensor, Tensor], Tensor]:
    """``fn(student_out, teacher_out) -> loss``, a mean over the batch, for a loss config of a policy."""
    kind = config["type"]
    if kind == "mse":
        return F.mse_loss
    if kind == "smooth_l1":
        beta = float(config["beta"])
        return lambda s, t: F.smooth_l1_loss(s, t, beta=beta)
    temperature = float(config["temperature"])

    def kl(s: Tensor, t: Tensor) -> Tensor:
        return F.kl_div(F.log_softmax(s / temperature, dim=1), F.log_softmax(t / temperature, dim=1),
                        reduction="batchmean", log_target=True) * temperature ** 2
    return kl


# ---- alignment ------------------------------------------------------------------------------------

def _shape(a: _Analysis, cut: Cut) -> tuple[int, ...]:
    return a.boundary(cut)[0].shape


def _candidates(a: _Analysis) -> list[int]:
    """Indices of the cuts where a run of equal boundary shapes ends (single-tensor boundaries only)."""
    out = []
    for i, c in enumerate(a.cuts):
        nxt = a.cuts[i + 1] if i + 1 < len(a.cuts) else None
        if len(c.boundary) == 1 and (nxt is None or len(nxt.boundary) != 1 or _shape(a, nxt) != _shape(a, c)):
            out.append(i)
    return out


def _listing(a: _Analysis, name: str) -> str:
    shown = [f"{a.cuts[i].node} {list(_shape(a, a.cuts[i]))}" for i in _candidates(a)]
    return f"{name}: " + (", ".join(shown) or "none")


def _match(t: _Analysis, s: _Analysis) -> list[tuple[int, int]]:
    """The longest in-order matching of the two sides' candidate boundaries by shape (LCS)."""
    tc, sc = _candidates(t), _candidates(s)
    ts, ss = [_shape(t, t.cuts[i]) for i in tc], [_shape(s, s.cuts[i]) for i in sc]
    n, m = len(ts), len(ss)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = best[i + 1][j + 1] + 1 if ts[i] == ss[j] else max(best[i + 1][j], best[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if ts[i] == ss[j] and best[i][j] == best[i + 1][j + 1] + 1:
            pairs.append((tc[i], sc[j]))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _named(t: _Analysis, s: _Analysis, blocks: Sequence[Sequence[str]]) -> list[tuple[int, int]]:
    """Cut indices of user-named ``(teacher, student)`` block ends, checked for order and matching shapes."""
    pairs = []
    for k, pair in enumerate(blocks):
        if not (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2):
            raise CutError(f"blocks[{k}] is {pair!r}; give (teacher_module, student_module) pairs naming where "
                           f"each block ends")
        try:
            ti = _resolve_cut(t, pair[0])
        except CutError as e:
            raise CutError(f"blocks[{k}], teacher side: {e}") from None
        try:
            si = _resolve_cut(s, pair[1])
        except CutError as e:
            raise CutError(f"blocks[{k}], student side: {e}") from None
        for a, i, side in ((t, ti, "teacher"), (s, si, "student")):
            if len(a.cuts[i].boundary) != 1:
                raise CutError(f"blocks[{k}]: the {side} cut after {a.cuts[i].node!r} carries "
                               f"{len(a.cuts[i].boundary)} values; a block boundary is one tensor")
        if _shape(t, t.cuts[ti]) != _shape(s, s.cuts[si]):
            raise CutError(f"blocks[{k}]: the teacher's output at {pair[0]!r} has shape "
                           f"{list(_shape(t, t.cuts[ti]))} but the student's at {pair[1]!r} has "
                           f"{list(_shape(s, s.cuts[si]))}; a student block learns the teacher's output, so "
                           f"the shapes must agree. Candidate boundaries with their shapes:\n  "
                           f"{_listing(t, 'teacher')}\n  {_listing(s, 'student')}")
        pairs.append((ti, si))
    for (t0, s0), (t1, s1) in zip(pairs, pairs[1:]):
        if not (t0 < t1 and s0 < s1):
            raise CutError(f"blocks must be given in model order on both sides; {blocks!r} is not")
    return pairs


def _align(t: _Analysis, s: _Analysis, blocks: Sequence[Sequence[str]] | None,
           notes: list[str]) -> list[tuple[int, int]]:
    """The block ends as (teacher cut, student cut) index pairs; student blocks without parameters are merged."""
    pairs = _named(t, s, blocks) if blocks is not None else _match(t, s)
    if not pairs and blocks is None:
        raise CutError(f"the teacher and the student share no boundary shape, so they cannot be cut into aligned "
                       f"blocks. Candidate boundaries with their shapes:\n"
                       f"  {_listing(t, 'teacher')}\n  {_listing(s, 'student')}\n"
                       f"Name the block ends with blocks=[(teacher_module, student_module), ...]")
    kept: list[tuple[int, int]] = []
    start = 0
    for ti, si in pairs:
        if _trainable(s, s.segment_nodes(start, si)):
            kept.append((ti, si))
            start = si + 1
        else:
            notes.append(f"student block ending at {s.cuts[si].node!r} has no parameters; merged into the next")
    if kept and not _trainable(s, s.segment_nodes(start, len(s.cuts))):
        dropped = kept.pop()
        notes.append(f"the last student block has no parameters; merged with the one ending at "
                     f"{s.cuts[dropped[1]].node!r}")
    return kept


def _trainable(a: _Analysis, nodes: Sequence[Any]) -> bool:
    return any(p in a.trainable for n in nodes for p in n.meta[META_KEY].params)


# ---- the plan -------------------------------------------------------------------------------------

@dataclass
class _Blocks:
    """Both traced models and the aligned block ends (indices into each side's cuts)."""

    teacher: _Analysis
    student: _Analysis
    ends: list[tuple[int, int]]

    def nodes(self, k: int) -> tuple[list[Any], list[Any]]:
        """Teacher and student nodes of block ``k`` (placeholders and attribute reads dropped)."""
        out = []
        for a, side in ((self.teacher, 0), (self.student, 1)):
            first = self.ends[k - 1][side] + 1 if k > 0 else 0
            last = self.ends[k][side] if k < len(self.ends) else len(a.cuts)
            nodes = a.segment_nodes(first, last)
            out.append([n for n in nodes if n.op not in ("placeholder", "get_attr")] or nodes)
        return out[0], out[1]

    def cuts(self, side: int) -> list[Cut]:
        a = self.teacher if side == 0 else self.student
        return [a.cuts[e[side]] for e in self.ends]


def _output_spec(a: _Analysis) -> TensorSpec:
    spec = _model_output_spec(a.nodes[-1])
    if spec is None:
        raise CutError("a pipebd model must return one tensor (the block losses compare outputs); "
                       "wrap it to return its logits or features")
    return spec


def _time_blocks(tb: list[Stage], sb: list[Stage], losses: list[Callable], inputs: tuple[Any, ...],
                 device: torch.device, replicas: int) -> list[list[float]]:
    """Median seconds of each block on ``device`` (teacher forward plus student forward and backward), at the
    whole batch and at each share of it that ``2 .. replicas`` replicas would train on: ``times[r - 1][k]``.

    Uses copies, so the models' parameters, buffers and gradients are untouched.
    """
    times: list[list[float]] = [[] for _ in range(replicas)]
    values: Any = move(inputs, device)
    for t, s, loss in zip(tb, sb, losses):
        t, s = copy.deepcopy(t).to(device).eval(), copy.deepcopy(s).to(device).train()
        with torch.no_grad():
            out = t(*values)
        for r in range(1, replicas + 1):
            rows = -(-_rows(values) // r)
            x, y = _head_rows(values, rows), _head_rows((out,) if not isinstance(out, tuple) else out, rows)

            def student_step(x: Any = x, target: Tensor = y[0], s: nn.Module = s, loss: Callable = loss) -> None:
                o = s(*x)
                loss(o[0] if isinstance(o, tuple) else o, target).backward()

            def teacher_step(x: Any = x, t: nn.Module = t) -> None:
                with torch.no_grad():
                    t(*x)
            times[r - 1].append(time_callable(teacher_step, device=device) + time_callable(student_step, device=device))
        values = out
    return times


def _rows(values: tuple[Any, ...]) -> int:
    return next(v.shape[0] for v in values if isinstance(v, Tensor) and v.dim())


def _head_rows(values: tuple[Any, ...], rows: int) -> tuple[Any, ...]:
    """The first ``rows`` rows of every batch-major tensor (one replica's share)."""
    n = _rows(values)
    return tuple(v[:rows] if isinstance(v, Tensor) and v.dim() and v.shape[0] == n else v for v in values)


def _most_replicas(opts: PlanOptions, gpus: int | None) -> int:
    """The most replicas any stage may get: what the time profile measures shares for."""
    r = opts.replicas
    if isinstance(r, tuple):
        return max(r)
    if r is False or opts.split_points is not None:
        return 1
    return min(gpus or 1, int(r)) if opts.replicas_chosen and r is not True else gpus or 1


def _stage_ends(b: _Blocks, split_points: Sequence[str]) -> list[int]:
    """Stage ends (in blocks) from student block ends named by hand."""
    ends = {si: k + 1 for k, (_, si) in enumerate(b.ends)}
    out = []
    for name in split_points:
        i = _resolve_cut(b.student, name)
        if i not in ends:
            raise CutError(f"split_points: {name!r} is not where a block ends; a pipebd stage ends at a block end: "
                           f"{', '.join(repr(b.student.cuts[si].node) for _, si in b.ends)}")
        out.append(ends[i])
    if out != sorted(set(out)):
        raise CutError(f"split_points {list(split_points)} must name distinct block ends in model order")
    return out + [len(b.ends) + 1]


def _layout(costs: list[float], split: list[list[float]] | None, b: _Blocks, opts: PlanOptions, gpus: int | None,
            block_memory: list[int], grad_bytes: list[int]) -> Layout:
    """Stages and replicas: by hand (``split_points``), or by the exact partitioner (``replicas`` fixed or not)."""
    comm = [b.teacher.boundary(c)[0].bytes / opts.link_bandwidth for c in b.cuts(0)] + [0.0]
    r = opts.replicas
    fixed = r if isinstance(r, tuple) else None
    manual = _stage_ends(b, opts.split_points) if opts.split_points is not None else None
    if manual is not None and fixed is not None and len(fixed) != len(manual):
        raise ValueError(f"replicas lists {len(fixed)} count(s) for {len(manual)} stages; give one per stage")
    devices = sum(fixed) if fixed else gpus or (len(manual) if manual else None)
    if devices is None:
        raise ValueError("say how many devices to plan for: gpus=N (or devices=[...], replicas=(...))")
    cap = 1 if r is False else int(r) if opts.replicas_chosen and r is not True else None
    problem = ReplicaProblem(compute=costs, comm=comm, grad_bytes=grad_bytes, memory=block_memory,
                             allreduce_bandwidth=opts.link_bandwidth, memory_limit=opts.memory_limit,
                             devices=devices, max_replicas=cap, split_compute=split)
    try:
        if manual is not None:
            reps = list(fixed or [1] * len(manual))
            return Layout(ends=tuple(manual), replicas=tuple(reps), costs=tuple(layout_costs(problem, manual, reps)))
        return solve_fixed_replicas(problem, fixed) if fixed else solve_replicated(problem)
    except partitioners.PartitionError as e:
        raise PartitionError(str(e)) from None


def build(student: nn.Module, teacher: nn.Module, example_inputs: Sequence[Any] | None,
          example_kwargs: dict[str, Any] | None, opts: PlanOptions,
          blocks: Sequence[Sequence[str]] | None) -> tuple[Plan, _Blocks, list[Stage], list[Stage], list[Callable]]:
    """Align, cost and place a teacher/student pair; the plan, the alignment, the block modules and losses.

    Both models are traced; their block ends are matched in order by boundary shape, or named with
    ``blocks=[(teacher_module, student_module), ...]``. Student block ``k`` takes the teacher's output of
    block ``k - 1`` and learns the teacher's output of block ``k`` under the policy's loss (``mse``, or
    ``kl`` on the last block's logits). The exact replica partitioner groups blocks into stages and chooses
    how many devices replicate each (``replicas=False``: none; an int caps it; a tuple fixes it per stage;
    ``split_points`` names the student block ends where stages end). The teacher is put in eval mode
    with ``requires_grad=False``.
    """
    if opts.device_speeds is not None:
        raise ValueError("a pipebd plan assumes identical devices (replicas split the batch evenly); drop "
                         "device_speeds")
    if opts.partitioner != "exact":
        raise ValueError(f"a pipebd plan is placed by the exact replica partitioner; got "
                         f"partitioner={opts.partitioner!r} (drop it)")
    notes: list[str] = []
    rules = load_distill_policy("mse" if opts.policy == "auto" else opts.policy)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    t = _analyse(teacher, example_inputs, example_kwargs, opts, None, need_classes=False)
    s = _analyse(student, example_inputs, example_kwargs, opts, None, need_classes=False)
    t_in = [(x.shape, x.dtype) for x in t.inputs]
    s_in = [(x.shape, x.dtype) for x in s.inputs]
    if t_in != s_in:
        raise ValueError(f"teacher and student must take the same inputs; teacher takes {t_in}, student {s_in}")
    t_out, s_out = _output_spec(t), _output_spec(s)
    if t_out.shape != s_out.shape:
        raise CutError(f"the teacher returns shape {list(t_out.shape)} but the student {list(s_out.shape)}; the "
                       f"last student block learns the teacher's output, so they must agree")
    b = _Blocks(teacher=t, student=s, ends=_align(t, s, blocks, notes))
    n = len(b.ends) + 1
    if rules.last["type"] == "kl" and len(t_out.shape) != 2:
        raise PolicyError(f"policy {rules.name!r} compares the last block's outputs with kl, which needs N x C "
                          f"logits; the models return shape {list(t_out.shape)} (use policy='mse')")
    loss_cfg = [dict(rules.loss)] * (n - 1) + [dict(rules.last)]
    losses = [distill_loss(c) for c in loss_cfg]
    tb, sb = split_stages(t.gm, b.cuts(0)), split_stages(s.gm, b.cuts(1))

    summaries = []
    for k in range(n):
        tn, sn = b.nodes(k)
        summaries.append((t.summary(tn, opts.optimizer), s.summary(sn, opts.optimizer), tn, sn))
    gpus = opts.gpus or (len(opts.devices) if opts.devices else None)
    split: list[list[float]] | None = None
    if opts.profile == "time":
        device = first_device(opts.devices)
        most = _most_replicas(opts, gpus)
        costs, *split = _time_blocks(tb, sb, losses, t.real_inputs, device, most)
        notes.append(f"costs measured as median teacher forward + student forward/backward time on {device}"
                     + (f", also at 1/2 .. 1/{most} of the batch (replicas)" if most > 1 else ""))
    else:
        costs = [(ts["flops_fwd"] + ss["flops_fwd"] + ss["flops_bwd"]) / opts.flops_per_second
                 for ts, ss, _, _ in summaries]
    memory = [ts["param_bytes"] + _memory(ss) for ts, ss, _, _ in summaries]
    grad_bytes = [ss["grad_bytes"] for _, ss, _, _ in summaries]
    layout = _layout(costs, split or None, b, opts, gpus, memory, grad_bytes)
    devices = _devices(layout.devices, opts.devices[:layout.devices] if opts.devices else None, notes)

    block_plans = []
    for k, ((ts, ss, tn, sn), cost) in enumerate(zip(summaries, costs)):
        output = b.teacher.boundary(b.cuts(0)[k])[0] if k < n - 1 else dataclasses.replace(t_out, name="output")
        block_plans.append(BlockPlan(
            index=k, teacher_nodes=tuple(x.name for x in tn), student_nodes=tuple(x.name for x in sn),
            teacher_module=module_path(tn[-1]), student_module=module_path(sn[-1]), output=output,
            teacher_flops=ts["flops_fwd"], flops_fwd=ss["flops_fwd"], flops_bwd=ss["flops_bwd"],
            param_count=ss["param_count"], teacher_param_count=ts["param_count"],
            memory_bytes=memory[k], grad_bytes=ss["grad_bytes"], loss=loss_cfg[k], cost=cost))

    stages = []
    start = offset = 0
    for j, (end, r, cost) in enumerate(zip(layout.ends, layout.replicas, layout.costs)):
        own = block_plans[start:end]
        nodes = [x for k in range(start, end) for x in b.nodes(k)[1]]
        sm = s.summary(nodes, opts.optimizer)
        last = j == len(layout.ends) - 1
        send = 0.0 if last else own[-1].output.bytes / opts.link_bandwidth / r
        types = list(dict.fromkeys(k.loss["type"] for k in own))
        stages.append(StagePlan(
            index=j, device=devices[offset], first_node=nodes[0].name, last_node=nodes[-1].name,
            first_module=module_path(nodes[0]), last_module=module_path(nodes[-1]),
            nodes=tuple(x.name for x in nodes), aux_flops=sum(k.teacher_flops for k in own),
            memory_bytes=sum(k.memory_bytes for k in own),
            boundary=() if last else (own[-1].output,),
            head=HeadSpec(policy=rules.name, kind="distill", config={"type": "+".join(types)}),
            compute_cost=cost - send, comm_cost=send, cost=cost, replicas=r, blocks=tuple(range(start, end)),
            **sm))
        start, offset = end, offset + r
    partitioner = "manual" if opts.split_points is not None else "exact" if opts.replicas is False \
        else "exact-replicas"
    result = Plan(
        mode="pipebd", model=type(student).__name__, teacher=type(teacher).__name__, blocks=tuple(block_plans),
        inputs=s.inputs, batch_size=s.inputs[0].shape[0] if s.inputs else 0, num_classes=s.num_classes,
        policy=rules.name, partitioner=partitioner, profile=opts.profile,
        optimizer=opts.optimizer, flops_per_second=opts.flops_per_second, link_bandwidth=opts.link_bandwidth,
        device_speeds=(1.0,) * len(stages), memory_limit=opts.memory_limit,
        legal_cuts=tuple(c.node for c in s.cuts), stages=tuple(stages), sequential_cost=sum(costs),
        notes=tuple(notes))
    result.validate()
    return result, b, tb, sb, losses


def compile_pipebd(student: nn.Module, teacher: nn.Module, example_inputs: Sequence[Any] | None,
                   example_kwargs: dict[str, Any] | None, opts: PlanOptions,
                   blocks: Sequence[Sequence[str]] | None) -> DistillPipeline:
    """Plan (see :func:`build`) and lower to teacher and student block modules on their stages' devices."""
    result, b, tb, sb, losses = build(student, teacher, example_inputs, example_kwargs, opts, blocks)
    devices = tuple(torch.device(s.device) for s in result.stages for _ in s.blocks)
    for t, s, d in zip(tb, sb, devices):
        t.to(d).eval()
        s.to(d)
    lowered = Lowered(modules=tuple(sb), heads=(None,) * len(sb), devices=devices, teacher=tuple(tb),
                      losses=tuple(losses), inputs=model_inputs(student, b.student.gm, b.student.fixed_args))
    return DistillPipeline(model=student, teacher=teacher, plan=result, graph_module=b.student.gm, lowered=lowered)

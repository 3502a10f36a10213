"""The front door: ``plan`` (model -> Plan) and ``compile`` (model -> CompiledPipeline), dispatched by plan kind."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .analysis.analyse import Analysis, analyse
from .analysis.cut_heads import cut_heads
from .analysis.reach import Reach
from .capture.meta import is_meta
from .errors import PlanError, PPLLError
from .heads.policy import Policy, load_policy
from .lower.materialize import Materialization, MaterializeHook, StateDictSource, planned
from .lower.split import lower_ppll, next_blocks
from .options import PlanOptions, SavedPlan, check_no_blocks, read_saved_plan, resolve_mode, resolve_options
from .pipebd.build import compile_pipebd, plan_pipebd
from .pipeline import CompiledPipeline
from .place.assemble import assemble_ppll
from .place.notes import check_distilled, check_frozen_names, closing_notes, reach_notes, reaching_cuts
from .place.partition import idle_note, ppll_layout, segment_costs, time_layout
from .place.tied import lowers_untied, untie, usable_cuts
from .plans.plan import Plan
from .runtime.distributed.plan_share import (
    confirm_model,
    meet,
    receive_plan,
    request_of,
    send_failure,
    send_plan,
    shared_note,
    shared_ranks,
)


def plan(model: nn.Module, gpus: int | None = None, *, teacher: nn.Module | None = None, mode: str | None = None,
         blocks: Sequence[Sequence[str]] | None = None, example_inputs: Sequence[Any] | None = None,
         example_kwargs: dict[str, Any] | None = None, plan: Plan | str | Path | None = None,
         **options: Any) -> Plan:
    """Trace, measure and partition ``model`` into a :class:`Plan` for ``gpus`` devices.

    ``options`` are the fields of :class:`PlanOptions` (policy, partitioner, profile, optimizer,
    memory_limit, device_speeds, devices, batch_size, leaf_modules, split_points, num_classes, replicas,
    precision, fusion). ``precision="bf16"`` (or ``"fp16"``) prices the plan in mixed precision as
    ``torch.autocast`` runs it (low-precision compute, activations and boundaries; float32 weights, gradients and
    optimizer state), ``"bf16-pure"`` everything in bfloat16, ``"fp32"`` (default) float32; the trainer's autocast
    follows it (see :mod:`ppll_compile.plans.precision`).
    ``plan`` re-applies a saved (possibly hand-edited) plan: its cuts, devices and heads are validated
    against the model and its costs measured afresh.

    With ``teacher=`` (``mode="pipebd"``) the plan is for blockwise distillation of ``model`` from the
    frozen teacher: see :func:`ppll_compile.pipebd.plan_pipebd` (``blocks`` names aligned block ends by hand).
    """
    saved = read_saved_plan(plan)
    opts = resolve_options(gpus, saved, options)
    _check_devices_here(opts, placing=False)
    if resolve_mode(mode, teacher, saved) == "pipebd":
        check_frozen_names(opts.frozen, model)
        distilled = plan_pipebd(model, teacher, example_inputs, example_kwargs, opts,  # type: ignore[arg-type]
                                blocks or (saved and saved.blocks))
        return check_distilled(distilled.plan, distilled.blocks.student.gm, opts.frozen, type(model).__name__)
    check_no_blocks(blocks)
    return _plan_ppll(model, example_inputs, example_kwargs, opts, saved)[0]


def compile(model: nn.Module, gpus: int | None = None, *, teacher: nn.Module | None = None,
            mode: str | None = None, blocks: Sequence[Sequence[str]] | None = None,
            example_inputs: Sequence[Any] | None = None, example_kwargs: dict[str, Any] | None = None,
            plan: Plan | str | Path | None = None, materialize: MaterializeHook | None = None,
            state_dict: StateDictSource | None = None, local_stages: Sequence[int] | None = None,
            share_plan: bool = True, **options: Any) -> CompiledPipeline:
    """Plan ``model`` (see :func:`plan`) and lower it to stage modules and auxiliary heads on their devices.

    The stages share the model's parameter objects (each stage is moved to its device, and the model's
    parameters with it); calling the result runs the stages in order and, in eval mode, gives the model's
    own output. With ``teacher=`` the result is a :class:`~ppll_compile.pipeline.DistillPipeline`.

    A model built on the meta device (``with torch.device("meta"): model = Net()``) is planned without
    allocating it, and each stage is then materialised on its own device only (see
    :mod:`ppll_compile.lower.materialize`): its tensors allocated there, then filled by

    - default: the model's own initialisation (Hugging Face's ``_init_weights``, else ``reset_parameters()`` of
      every module the stage holds; a tensor no module initialises is an error);
    - ``materialize=fn(stage_module, stage_index, device)``: the hook fills the stage's allocated tensors
      (``stage_module.module.named_parameters()``/``named_buffers()`` carry the model's own names);
    - ``state_dict=load``: ``load(stage_index, names) -> {name: tensor}`` gives the stage's tensors by the model's
      ``state_dict`` keys (e.g. read from a safetensors file), or one mapping gives every stage's; loaded over the
      model's own initialisation, so buffers a checkpoint does not hold (rotary frequencies) keep theirs.

    ``local_stages``: the stages this process materialises; by default every stage, or under ``torchrun``
    (``WORLD_SIZE`` equal to the plan's world size) the stage of this ``RANK``, its head with it: the other
    stages stay on meta, and a runtime refuses to run them. The plan's notes say how the model was materialised.

    One plan for every rank (``share_plan=True``, see :mod:`.runtime.plan_share`): under ``torchrun``, when the
    call asks for as many devices as there are processes, rank 0 plans (or re-applies ``plan=``) and every other rank
    lowers rank 0's plan, so calibration caches and timings that differ between processes cannot split the pipeline;
    every rank must then call ``compile()`` (it forms the default process group if there is none). A rank that asked
    for other options plans on its own, with a warning. ``share_plan=False``: every process plans on its own (e.g.
    ``compile()`` on one rank only). ``ppll`` plans; a ``pipebd`` plan is made by every process.

    Every auxiliary head (and every stage of a meta-built model filled by its own initialisation) draws its random
    initial values from a generator seeded by ``torch.initial_seed()`` and its stage, not from the running stream:
    set ``torch.manual_seed`` to change them; under ``torchrun`` rank 0's seed is used on every rank.
    """
    saved = read_saved_plan(plan)
    opts = resolve_options(gpus, saved, options)
    _check_devices_here(opts, placing=True)
    meta = is_meta(model)
    if not meta and (materialize is not None or state_dict is not None or local_stages is not None):
        raise ValueError(f"materialize=, state_dict= and local_stages= give values to a model built on the meta "
                         f"device, but {type(model).__name__} holds no meta tensor; drop them (or build the "
                         f"model under torch.device('meta'))")
    if resolve_mode(mode, teacher, saved) == "pipebd":
        if meta or (teacher is not None and is_meta(teacher)):
            raise PlanError("compile() of a blockwise distillation (teacher=) takes models with their weights: "
                            "materialise the student and teacher first (to_empty() and load their weights), or "
                            "use plan() to plan them on the meta device")
        check_frozen_names(opts.frozen, model)
        pipeline = compile_pipebd(model, teacher, example_inputs, example_kwargs, opts,  # type: ignore[arg-type]
                                  blocks or (saved and saved.blocks))
        pipeline.plan = check_distilled(pipeline.plan, pipeline.graph_module, opts.frozen, type(model).__name__)
        return pipeline
    check_no_blocks(blocks)
    how = Materialization(hook=materialize, state_dict=state_dict) if meta else None
    ranks = shared_ranks(opts, saved) if share_plan else None
    result, a, policy, seed = _one_plan(model, example_inputs, example_kwargs, opts, saved, ranks)
    if how is not None:
        how, result = planned(how, result, local_stages, seed)
    lowered = lower_ppll(model, result, a, policy, untie=lowers_untied(opts, result), materialize=how, seed=seed)
    return CompiledPipeline(model=model, graph_module=a.gm, plan=result, lowered=lowered,
                            policy=opts.policy, front=_FRONT)


_HERE: dict[str, Callable[[int], bool]] = {
    "cpu": lambda index: True,
    "cuda": lambda index: torch.cuda.is_available() and index < torch.cuda.device_count(),
    "mps": lambda index: torch.backends.mps.is_available() and index == 0,
    "xpu": lambda index: torch.xpu.is_available() and index < torch.xpu.device_count(),
}
"""Whether this machine has the device of a kind (one of :data:`~ppll_compile.plans.plan.DEVICE_TYPES`) and index."""


def _check_devices_here(opts: PlanOptions, placing: bool) -> None:
    """The devices a call uses must be on this machine: ``profile='time'`` measures on the first one, and
    ``compile`` (``placing``) moves every stage onto its own; a CUDA device this machine lacks falls back to the
    CPU while planning, so placing checks the other kinds only."""
    devices = [torch.device(d) for d in opts.devices or ()]
    if opts.profile == "time" and devices and not _HERE[devices[0].type](devices[0].index or 0):
        raise PlanError(f"profile='time' measures on the first device, {str(devices[0])!r}, which this machine "
                        f"does not have; pass devices=[...] this machine has, or profile='flops'")
    for d in devices if placing else ():
        if d.type != "cuda" and not _HERE[d.type](d.index or 0):
            raise PlanError(f"devices asks for {str(d)!r}, which this machine does not have; compile() places the "
                            f"stages on their devices: pass devices=[...] this machine has, or use plan() to plan "
                            f"for another machine")


def _one_plan(model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: dict[str, Any] | None,
              opts: PlanOptions, saved: SavedPlan | None, ranks: tuple[int, int] | None
              ) -> tuple[Plan, Analysis, Policy, int]:
    """The plan to lower, its analysis and policy, and the seed of the heads: planned here (``ranks`` None), or under
    torchrun (``ranks``: this rank and the world size) planned on rank 0 and received by every other rank."""
    if ranks is None:
        return (*_plan_ppll(model, example_inputs, example_kwargs, opts, saved), torch.initial_seed())
    rank, world = ranks
    request = request_of(opts, saved)
    meet(rank)
    if rank == 0:
        try:
            result, a, policy = _plan_ppll(model, example_inputs, example_kwargs, opts, saved)
        except Exception as e:
            send_failure(request, e, world)
            raise
        result = dataclasses.replace(result, notes=(*result.notes, shared_note(world)))
        seed = send_plan(request, result)
        confirm_model(rank, world, a.gm)  # every rank traced the same model: else every rank raises
        return result, a, policy, seed
    received, seed = receive_plan(rank, request)
    if received is None:  # this rank asked for another plan: its own
        confirm_model(rank, world, None)
        return (*_plan_ppll(model, example_inputs, example_kwargs, opts, saved), seed)
    try:
        a = analyse(model, example_inputs, example_kwargs, opts, received.inputs)
        a.check_saved_cuts(received.cuts, "rank 0's plan")
    except PPLLError as e:
        confirm_model(rank, world, None, e)  # raises on every rank, naming this one and its error
        raise
    confirm_model(rank, world, a.gm)
    return received, a, load_policy(opts.policy), seed


def _plan_ppll(model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: dict[str, Any] | None,
               opts: PlanOptions, saved: SavedPlan | None) -> tuple[Plan, Analysis, Policy]:
    """The ``ppll`` steps: analyse, choose heads, cost the segments, lay out the stages, assemble the plan."""
    a = analyse(model, example_inputs, example_kwargs, opts, saved.inputs if saved is not None else None)
    policy = load_policy(opts.policy)
    if saved is not None:
        a.check_saved_cuts(saved.cuts, saved.source)
    find = functools.partial(next_blocks, model)  # the blocks a head copies or follows (lowering finds them)
    check_frozen_names(opts.frozen, model)
    a, request, untie_why = usable_cuts(a, policy, opts, saved, type(model).__name__, find)
    reach = Reach.of(a.gm, a.nodes, [c.node for c in a.cuts])  # which parameters each cut's stage loss reaches
    a, request = reaching_cuts(a, reach, request, opts, saved, type(model).__name__)
    heads, head_costs = cut_heads(a, request.manual, saved, policy, opts, find)
    devices = sum(opts.replicas) if isinstance(opts.replicas, tuple) else opts.gpus or request.stages
    costs, figures, notes = segment_costs(a, heads, head_costs, policy, opts, devices)
    layout = ppll_layout(costs, request, opts)
    notes += tuple(n for n in (idle_note(layout, costs, opts, devices),) if n is not None)
    measured = None
    if opts.profile == "time":
        search = request.manual is None and not opts.replicas_chosen and not isinstance(opts.replicas, tuple)
        layout, measured, timed = time_layout(a, heads, policy, opts, layout, devices, search=search)
        notes += (timed,)
    result = assemble_ppll(type(model).__name__, a, heads, costs, layout, opts, policy.name, (*a.notes, *notes),
                           figures, measured)
    result = closing_notes(result, model, a, opts)
    result = untie(a, result, untie_why)
    result = reach_notes(result, a, reach, opts, type(model).__name__)
    return result, a, policy


_FRONT = {"plan": plan, "compile": compile}
"""What a compiled pipeline re-plans through when a trainer moves one of its cuts."""

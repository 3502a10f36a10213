"""The front door: ``plan`` (model -> Plan) and ``compile`` (model -> CompiledPipeline), dispatched by plan kind."""

from __future__ import annotations

import bisect
import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .analysis.analyse import Analysis, analyse
from .analysis.cuts import Cut
from .capture.meta import PLANNED_ON_META, is_meta
from .cost.modules import ModuleCost
from .cost.nodes import META_KEY
from .errors import CutError, PlanError, PolicyError
from .heads.build import copied_blocks, counted_head, counted_loss
from .heads.output import NoOutputProjection
from .heads.policy import Policy, load_policy
from .lower.materialize import Materialization, MaterializeHook, StateDictSource, meta_note
from .lower.materialize import local_stages as materialized_stages
from .lower.split import lower_ppll, next_blocks
from .options import PlanOptions, SavedPlan, check_no_blocks, read_saved_plan, resolve_mode, resolve_options
from .pipebd.build import compile_pipebd, plan_pipebd
from .pipeline import CompiledPipeline
from .place.assemble import assemble_ppll
from .place.partition import (
    StageRequest,
    idle_note,
    ppll_layout,
    segment_costs,
    slow_stage_note,
    stage_request,
    time_layout,
)
from .plans.plan import Plan, TensorSpec
from .plans.specs import HeadSpec
from .runtime.distributed.plan_share import (
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
        return plan_pipebd(model, teacher, example_inputs, example_kwargs, opts,  # type: ignore[arg-type]
                           blocks or (saved and saved.blocks)).plan
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
        return compile_pipebd(model, teacher, example_inputs, example_kwargs, opts,  # type: ignore[arg-type]
                              blocks or (saved and saved.blocks))
    check_no_blocks(blocks)
    how = Materialization(hook=materialize, state_dict=state_dict) if meta else None
    ranks = shared_ranks(opts, saved) if share_plan else None
    result, a, policy, seed = _one_plan(model, example_inputs, example_kwargs, opts, saved, ranks)
    if how is not None:
        how = dataclasses.replace(how, stages=materialized_stages(result, local_stages), seed=seed)
        here = sorted(range(result.num_stages) if how.stages is None else how.stages)
        result = dataclasses.replace(result, notes=(*result.notes, meta_note(how, result, here)))
    lowered = lower_ppll(model, result, a, policy, untie=opts.tied == "untie" or bool(result.untied),
                         materialize=how, seed=seed)
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
        return result, a, policy, send_plan(request, result)
    received, seed = receive_plan(rank, request)
    if received is None:  # this rank asked for another plan: its own
        return (*_plan_ppll(model, example_inputs, example_kwargs, opts, saved), seed)
    a = analyse(model, example_inputs, example_kwargs, opts, received.inputs)
    a.check_saved_cuts(received.cuts, "rank 0's plan")
    return received, a, load_policy(opts.policy), seed


def _plan_ppll(model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: dict[str, Any] | None,
               opts: PlanOptions, saved: SavedPlan | None) -> tuple[Plan, Analysis, Policy]:
    """The ``ppll`` steps: analyse, choose heads, cost the segments, lay out the stages, assemble the plan."""
    a = analyse(model, example_inputs, example_kwargs, opts, saved.inputs if saved is not None else None)
    policy = load_policy(opts.policy)
    if saved is not None:
        a.check_saved_cuts(saved.cuts, saved.source)
    a, request, untie_why = _usable_cuts(a, policy, opts, saved, model)
    heads, head_costs = _heads(a, request, saved, policy, opts, model)
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
    if is_meta(model):
        result = dataclasses.replace(result, notes=(*result.notes, PLANNED_ON_META))
    warned = [note for note in (*_output_notes(model, a, result, opts.num_classes), slow_stage_note(result))
              if note is not None]
    for note in warned:
        warnings.warn(note, UserWarning, stacklevel=3)  # at the caller of plan() or compile()
    result = dataclasses.replace(result, notes=(*result.notes, *warned)) if warned else result
    untied = _untied(a, result)
    if untied:
        result = dataclasses.replace(result, untied=tuple(name for names, _ in untied for name in names),
                                     notes=(*result.notes, *(note for _, note in untied)))
        if untie_why is not None:
            note = _auto_untie_note(result.untied, untie_why)
            warnings.warn(note, UserWarning, stacklevel=3)  # at the caller of plan() or compile()
            result = dataclasses.replace(result, notes=(*result.notes, note))
    return result, a, policy


def _usable_cuts(a: Analysis, policy: Policy, opts: PlanOptions, saved: SavedPlan | None,
                 model: nn.Module) -> tuple[Analysis, StageRequest, str | None]:
    """``a`` with only the cuts a ``ppll`` plan can use, the stages asked for, and why tied parameters are untied
    automatically (``None``: they are not).

    A cut with a parameter used on both sides of it is dropped (``tied='error'``) or kept (``tied='untie'``);
    ``tied='auto'`` drops such cuts when the stages asked for (their number, or the cuts given by hand) can do
    without them, and keeps them otherwise. Under ``tied='error'``, a request that only such cuts would satisfy is
    refused leading with ``tied='untie'``."""
    name = type(model).__name__

    def usable(tied: str) -> tuple[Analysis, StageRequest]:
        kept = _drop_blockless_cuts(_drop_unusable_cuts(a, policy, tied, name), policy, model)
        return kept, stage_request(kept, opts, saved)

    if opts.tied == "untie":
        return (*usable("untie"), None)
    try:
        return (*usable("error"), None)
    except CutError as e:
        refused = e
    try:
        loose, request = usable("untie")
    except CutError as e:
        raise (refused if opts.tied == "error" else e) from None
    manual = request.manual is not None
    if opts.tied == "error":
        if manual:  # the cut given by hand names the parameter and tied='untie' first
            raise refused
        strict = loose.drop_shared_cuts()
        k, total = len(strict.cuts), len(loose.cuts)
        shared = loose.shared_across([c for c in loose.cuts if c not in strict.cuts])
        raise CutError(f"cannot cut {name} into {request.stages} stages with tied='error': "
                       f"{_parameters(shared)} used on both sides of "
                       + (f"all {total} of its legal cut points" if k == 0 else
                          f"{total - k} of its {total} legal cut points, leaving {k}")
                       + "; pass tied='untie' (each later stage trains its own copy; the model keeps the first "
                         "stage's)" + (f", or plan at most {k + 1} stages (gpus={k + 1} or fewer)" if k else ""))
    why = ("the cuts given by hand (split_points or a saved plan) fall between {uses}" if manual else
           f"{name} has too few legal cuts for {request.stages} stages otherwise")
    return loose, request, why


def _parameters(names: Sequence[str]) -> str:
    """``parameter a is`` or ``parameters a, b are``."""
    return f"parameter {names[0]} is" if len(names) == 1 else f"parameters {', '.join(names)} are"


def _auto_untie_note(untied: Sequence[str], why: str) -> str:
    """The plan's note (and the warning) on the parameters ``tied='auto'`` untied, ``why`` naming ``{uses}``."""
    it, uses = ("it", "its uses") if len(untied) == 1 else ("them", "their uses")
    return (f"{_parameters(untied)} untied (tied='auto'): {why.format(uses=uses)}, so each later stage that uses "
            f"{it} trains its own copy and the model keeps the first stage's; pass tied='error' to refuse, or "
            f"tied='untie' to untie without this warning")


def _drop_unusable_cuts(a: Analysis, policy: Policy, tied: str, model: str) -> Analysis:
    """``a`` without the cuts a ``ppll`` plan cannot use: a stage on one side would train nothing, a parameter
    would be trained on both sides (``tied='error'``), or no head of ``policy`` reads the tensor."""
    if a.per_token and policy.builder is None and policy.per_token is None:
        raise PolicyError(f"policy {policy.name!r} has no per-token head, but {model} gives per-token scores "
                          f"(N x L x C), so its labels are per token (N x L); use policy='lm', or add a "
                          f"'per_token:' entry (type lm) to {policy.source or 'the policy file'}")
    a = a.drop_untrained_cuts()
    if tied == "error":
        a = a.drop_shared_cuts()

    def unread(cut: Cut) -> str | None:
        spec = a.boundary(cut)[0]
        readable = "float" in spec.dtype  # not a mask, not token ids
        if readable and policy.fits(spec, a.per_token):
            return None
        return f"{len(spec.shape)}-D{'' if readable else ' ' + spec.dtype} {tuple(spec.shape)}" + \
            (f" {spec.layout}" if spec.layout else "")

    return a.keep_cuts(unread, f"no head of policy {policy.name!r} reads their tensors")


def _copied(a: Analysis, policy: Policy, cut: Cut, config: Any, model: nn.Module) -> list[nn.Module] | None:
    """The model's blocks after ``cut`` that its head (``config``, or the policy's) copies or follows; None if none."""
    if config is None:
        spec = a.boundary(cut)[0]
        config = policy.config_for(spec, a.per_token) if policy.builder is None and policy.fits(spec, a.per_token) \
            else {}
    depth = copied_blocks(config)
    return [m for _, m in next_blocks(model, a.nodes, cut.node, depth, config=config)] if depth else None


def _drop_blockless_cuts(a: Analysis, policy: Policy, model: nn.Module) -> Analysis:
    """``a`` without the cuts after which no block begins, where the policy's head copies or follows the next
    blocks (a ``transformer`` head with ``init: copy``, a ``momentum`` head)."""
    def blockless(cut: Cut) -> str | None:
        try:
            _copied(a, policy, cut, None, model)
        except NoOutputProjection:  # the model's, not the cut's: no cut would do
            raise
        except PolicyError as e:
            return str(e)
        return None

    return a.keep_cuts(blockless,
                       f"policy {policy.name!r} copies or follows the blocks after a cut, and too few begin there")


def _untied(a: Analysis, plan: Plan) -> list[tuple[list[str], str]]:
    """The parameters stages use on both sides of a chosen cut (``tied='untie'``), by the stages that use them:
    per tensor, its names joined by `` = ``; and the plan's note on them."""
    order = {n.name: i for i, n in enumerate(a.nodes)}
    ends = [order[c] for c in plan.cuts]
    by_stages: dict[tuple[int, int], list[str]] = {}
    for lo, hi, names in a.shared_parameters():
        first, last = bisect.bisect_left(ends, lo), bisect.bisect_left(ends, hi)
        if first != last:
            by_stages.setdefault((first, last), []).append(" = ".join(names))
    return [(names, f"tied parameter(s) {', '.join(names)} used by stages {first} to {last}: untied, each stage "
                    f"trains its own copy; the model keeps stage {first}'s")
            for (first, last), names in sorted(by_stages.items())]


def _heads(a: Analysis, request: StageRequest, saved: SavedPlan | None, policy: Policy,
           opts: PlanOptions, model: nn.Module) -> tuple[dict[int, HeadSpec], dict[int, ModuleCost]]:
    """The head at every cut the partitioner may choose (the policy's, or the saved plan's, possibly edited), and
    its measured cost; after the last unit (key ``len(a.cuts)``), the last stage's loss on the model's output."""
    configs = dict(zip(request.manual, saved.heads)) if saved is not None and request.manual else {}
    candidates = request.manual if request.manual is not None else range(len(a.cuts))
    input_shape = a.inputs[0].shape if a.inputs else None
    measured: dict[Any, tuple[HeadSpec, ModuleCost]] = {}
    heads: dict[int, HeadSpec] = {}
    costs: dict[int, ModuleCost] = {}
    for i in candidates:
        spec = a.boundary(a.cuts[i])[0]
        config = configs.get(i)
        try:
            blocks = _copied(a, policy, a.cuts[i], config, model)
        except PolicyError as e:
            raise PolicyError(f"cut after {a.cuts[i].node!r}: {e}") from None
        key = (spec.shape, spec.dtype, spec.layout, repr(config), tuple(map(id, blocks or ())))
        if key not in measured:
            try:
                measured[key] = counted_head(policy, config, spec, a.num_classes, input_shape, opts.optimizer,
                                             per_token=a.per_token, blocks=blocks, precision=opts.precision)
            except PolicyError as e:
                raise PolicyError(f"cut after {a.cuts[i].node!r}: {e}") from None
        heads[i], costs[i] = measured[key]
    # the last unit's head term is the last stage's own loss (the objective adds it to the stage ending there)
    heads[len(a.cuts)], costs[len(a.cuts)] = counted_loss(_scores_spec(a), a.num_classes, a.per_token)
    return heads, costs


def _scores_spec(a: Analysis) -> TensorSpec | None:
    """The tensor of the model's output the last stage's default loss reads (see
    :func:`~ppll_compile.heads.build.logits_of`): the output itself, an output dict's ``logits``, or the first tensor of a
    tuple or list; ``None`` when it finds none."""
    spec = a.output_spec()
    if spec is not None:
        return spec
    out = a.nodes[-1].args[0]
    if isinstance(out, Mapping):
        out = out.get("logits")
    if isinstance(out, (tuple, list)):
        out = next((v for v in out if isinstance(v, fx.Node)), None)
    value = out.meta.get(META_KEY) if isinstance(out, fx.Node) else None
    value = getattr(value, "value", None)
    return value if isinstance(value, TensorSpec) else None


_WAY_OUT = ("pass the trainer the loss of your task: compiled.trainer(..., loss=fn) with fn(output, target) -> scalar "
            "tensor for the last stage, and aux_loss=fn(scores, target) for the auxiliary heads")


def _output_notes(model: nn.Module, a: Analysis, plan: Plan, num_classes: int | None) -> list[str]:
    """What the plan says about the model's output where the default losses do not fit it (empty where they do).

    The defaults (:func:`~ppll_compile.heads.build.task_loss`) read ``N x C`` scores with class labels of shape ``[N]``,
    ``N x L x C`` per-token scores with labels ``[N, L]``, and one score per example (``[N]`` or ``N x 1``) with float
    or 0/1 targets of shape ``[N]``; an output of another rank, not floating point, or without a tensor fits none. A
    model that says its output is features (``num_classes == 0``, as timm's without a classifier), ``num_classes=``
    other than the output's classes, and per-token heads that read another number of tokens than the output has
    are named too."""
    name = type(model).__name__
    spec = _scores_spec(a)
    if spec is None:
        return [f"{name} returns a structured output in which the default loss finds no scores (it reads a "
                f"tensor, an output's 'logits', or the first tensor of a tuple or list): no default loss fits it; "
                f"{_WAY_OUT}"]
    shape = tuple(spec.shape)
    if "float" not in spec.dtype or len(shape) not in (1, 2, 3):
        what = f"{spec.dtype} values" if "float" not in spec.dtype else "a scalar" if not shape else \
            f"a {len(shape)}-D tensor"
        return [f"{name} returns {what} of shape {shape}: no default loss fits it (the defaults take N x C scores "
                f"with class labels of shape [N], N x L x C per-token scores with labels of shape [N, L], or one "
                f"score per example with targets of shape [N]); {_WAY_OUT}"]
    if len(shape) == 1 or shape[-1] == 1:
        return []
    tokens = len(shape) == 3
    labels = f"[{shape[0]}, {shape[1]}]" if tokens else f"[{shape[0]}]"
    read = f"{'per-token scores' if tokens else 'scores'} over {shape[-1]} classes, with class labels of shape {labels}"
    notes = []
    if getattr(model, "num_classes", None) == 0:
        notes.append(f"{name} returns features, not scores: its num_classes is 0, and the default losses would read "
                     f"its output of shape {shape} as {read}; to train it on class labels give it a classifier (for "
                     f"a timm model, num_classes=C where it has one, else e.g. a pooling and nn.Linear({shape[-1]}, "
                     f"C) after it), or {_WAY_OUT}")
    if num_classes is not None and num_classes != shape[-1]:
        notes.append(f"num_classes={num_classes}, but {name} returns {shape}, {read}: the auxiliary heads predict "
                     f"{num_classes} classes, the model's output {shape[-1]}; pass num_classes={shape[-1]}, or "
                     f"give the model an output of {num_classes} classes")
    if tokens:
        other = [(s.index, s.boundary[0].shape[1]) for s in plan.stages[:-1]
                 if len(s.boundary[0].shape) >= 2 and s.boundary[0].shape[1] != shape[1]]
        if other:
            which = ", ".join(f"stage {i}'s: {n}" for i, n in other)
            notes.append(f"the auxiliary heads give per-token scores for the tokens at their cut ({which}), but "
                         f"{name}'s output has {shape[1]} tokens: by default a head scores each of the {shape[1]} "
                         f"labels from the mean of its tokens' scores (as on the encoder of a sequence-to-sequence "
                         f"model); for another rule pass compiled.trainer(..., aux_loss=fn) with fn(scores, target) "
                         f"-> scalar tensor, or cut where the output's tokens are")
    return notes


_FRONT = {"plan": plan, "compile": compile}
"""What a compiled pipeline re-plans through when a trainer moves one of its cuts."""

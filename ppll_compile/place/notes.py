"""The notes an assembled ``ppll`` plan closes with: a model planned on the meta device, a model output the default
losses do not fit, and a slow stage (the last two warned at the user's call too); and the parameters no loss of their
stage reaches: the cuts that would strand them left to the partitioner only when enough others remain, a plan that
strands one refused unless ``frozen=`` accepts it (:mod:`..analysis.reach`)."""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Sequence

from torch import fx, nn

from ..analysis.analyse import Analysis
from ..analysis.cut_heads import scores_spec
from ..analysis.reach import (
    Reach,
    Stranded,
    accepted,
    frozen_hint,
    listed,
    unaccepted,
    unknown_frozen,
)
from ..analysis.usable import drop_stranding_cuts
from ..capture.meta import PLANNED_ON_META, is_meta
from ..errors import CutError, PlanError, user_stacklevel
from ..options import PlanOptions, SavedPlan
from ..plans.plan import Plan
from .partition import StageRequest, slow_stage_note, stage_request

_WAY_OUT = ("pass the trainer the loss of your task: compiled.trainer(..., loss=fn) with fn(output, target) -> scalar "
            "tensor for the last stage, and aux_loss=fn(scores, target) for the auxiliary heads")


def closing_notes(plan: Plan, model: nn.Module, a: Analysis, opts: PlanOptions) -> Plan:
    """``plan`` of ``model`` with its closing notes: planned on the meta device, then those on the model's output
    (:func:`output_notes`) and on a slow stage, which are warned too."""
    if is_meta(model):
        plan = dataclasses.replace(plan, notes=(*plan.notes, PLANNED_ON_META))
    warned = [note for note in (*output_notes(model, a, plan, opts.num_classes), slow_stage_note(plan))
              if note is not None]
    for note in warned:
        warnings.warn(note, UserWarning, stacklevel=user_stacklevel())
    return dataclasses.replace(plan, notes=(*plan.notes, *warned)) if warned else plan


def output_notes(model: nn.Module, a: Analysis, plan: Plan, num_classes: int | None) -> list[str]:
    """What the plan says about the model's output where the default losses do not fit it (empty where they do).

    The defaults (:func:`~ppll_compile.heads.build.task_loss`) read ``N x C`` scores with class labels of shape ``[N]``,
    ``N x L x C`` per-token scores with labels ``[N, L]``, and one score per example (``[N]`` or ``N x 1``) with float
    or 0/1 targets of shape ``[N]``; an output of another rank, not floating point, or without a tensor fits none. A
    model that says its output is features (``num_classes == 0``, as timm's without a classifier), ``num_classes=``
    other than the output's classes, and per-token heads that read another number of tokens than the output has
    are named too."""
    name = type(model).__name__
    spec = scores_spec(a)
    if spec is None:
        return [(f"{name} returns a structured output in which the default loss finds no scores (it reads a "
                 f"tensor, an output's 'logits', or the first tensor of a tuple or list): no default loss fits it; "
                 f"{_WAY_OUT}")]
    shape = tuple(spec.shape)
    if "float" not in spec.dtype or len(shape) not in (1, 2, 3):
        what = f"{spec.dtype} values" if "float" not in spec.dtype else "a scalar" if not shape else \
            f"a {len(shape)}-D tensor"
        return [(f"{name} returns {what} of shape {shape}: no default loss fits it (the defaults take N x C scores "
                 f"with class labels of shape [N], N x L x C per-token scores with labels of shape [N, L], or one "
                 f"score per example with targets of shape [N]); {_WAY_OUT}")]
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


def check_frozen_names(frozen: Sequence[str], model: nn.Module) -> None:
    """Every entry of ``frozen=`` names a parameter of ``model`` or a module holding one."""
    unknown = unknown_frozen(frozen, model)
    if not unknown:
        return
    names = [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_modules() if k]
    close = difflib.get_close_matches(unknown[0], names, n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise ValueError(f"frozen={list(frozen)!r}: {unknown[0]!r} names neither a parameter of {type(model).__name__} nor "
                     f"a module holding one{hint}; give names as model.named_parameters() or model.named_modules() "
                     f"spell them")


def reaching_cuts(a: Analysis, reach: Reach, request: StageRequest, opts: PlanOptions, saved: SavedPlan | None,
                  model: str) -> tuple[Analysis, StageRequest]:
    """``a`` and ``request`` with only the cuts after which the stage's loss reaches every parameter it holds (those
    ``frozen=`` accepts aside), when enough remain for the stages asked for; cuts given by hand (``split_points``, a
    saved plan) are checked stage by stage instead. Refused (:class:`PlanError`) where no such plan exists, naming the
    parameters and the ways out."""
    if request.manual is not None:
        source = f"{saved.source}: " if saved is not None else ""
        refuse_stranded(a, reach, reach.stages([a.cuts[i].node for i in request.manual]), opts.frozen, model, source)
        return a, request
    kept = drop_stranding_cuts(a, reach, opts.frozen)
    if kept is a:
        return a, request
    try:
        return kept, stage_request(kept, opts, saved)
    except CutError:
        pass
    gone = [c for c in a.cuts if c.node in kept.dropped and c not in kept.cuts]
    names = unaccepted(reach.stranding(gone[0].node), opts.frozen)
    k = len(kept.cuts)
    fewer = f"plan at most {k + 1} stages (gpus={k + 1} or fewer), or " if k else ""
    raise PlanError(f"cannot cut {model} into {request.stages} stages so that every stage's loss reaches the "
                    f"parameters it holds: {len(gone)} of its {len(a.cuts)} usable cuts would leave some untrained "
                    f"(the cut after {gone[0].node!r}: {listed(names)}, whose values cross it beside the tensor the "
                    f"head reads), leaving {k}; {fewer}accept them untrained with {frozen_hint(names)} (they keep "
                    f"their values; end-to-end training would train them)")


def refuse_stranded(a: Analysis, reach: Reach, stranded: Sequence[Stranded], frozen: Sequence[str], model: str,
                    source: str = "") -> None:
    """Refuse a plan whose stages would leave parameters ``frozen=`` does not accept untrained, naming the first such
    stage, its parameters, and a working cut (``source``: the saved plan's, prefixed to the message)."""
    bad = [(s, unaccepted(s.names, frozen)) for s in stranded]
    bad = [(s, names) for s, names in bad if names]
    if not bad:
        return
    s, names = bad[0]
    cut = next((c for c in a.cuts if c.node == s.end), None)
    beside = ", ".join(repr(v) for v in cut.boundary[1:]) if cut is not None else ""
    others = f" (and {len(bad) - 1} more stage(s) alike)" if len(bad) > 1 else ""
    raise PlanError(f"{source}stage {s.stage} of {model} would never train {len(names)} parameter tensor(s): "
                    f"{listed(names)}{others}; its loss reads only {s.end!r}, the tensor at its cut (what its head "
                    f"reads), and their values cross the cut detached" + (f" in {beside}" if beside else "")
                    + f", so no loss reaches them (end-to-end training would train them); ways out: "
                      f"{_elsewhere(a, reach, frozen, s.end)}, or accept them untrained with {frozen_hint(names)}")


def _elsewhere(a: Analysis, reach: Reach, frozen: Sequence[str], end: str) -> str:
    """A cut near ``end`` that leaves nothing untrained, as a way out."""
    order = {n.name: i for i, n in enumerate(a.nodes)}
    kept = drop_stranding_cuts(a, reach, frozen).cuts
    if not kept:
        return "no legal cut of the model trains every parameter of the stage before it: plan one stage fewer"
    near = min(kept, key=lambda c: (abs(c.position - order[end]), c.position))
    return f"cut after {near.node!r} instead of {end!r} (the stage before it trains every parameter it holds)"


def reach_notes(plan: Plan, a: Analysis, reach: Reach, opts: PlanOptions, model: str) -> Plan:
    """``plan`` refused if a stage of it would leave parameters untrained that ``frozen=`` does not accept, else with
    notes naming those it accepts; entries of ``frozen=`` that accept nothing in this plan are warned."""
    stranded = reach.stages(plan.cuts)
    refuse_stranded(a, reach, stranded, opts.frozen, model)
    return _accepted_notes(plan, stranded, opts.frozen, "stage")


def check_distilled(plan: Plan, gm: fx.GraphModule, frozen: Sequence[str], model: str) -> Plan:
    """A ``pipebd`` plan refused if a student block would never learn parameters ``frozen=`` does not accept (its
    distillation loss compares the tensor at the block's end, the main one, and the next block reads the teacher's
    values, not the student's side values), else with notes naming those it accepts."""
    ends = [b.student_nodes[-1] for b in plan.blocks[:-1]]
    stranded = Reach.of(gm, list(gm.graph.nodes), ends).stages(ends)
    bad = [(s, unaccepted(s.names, frozen)) for s in stranded]
    bad = [(s, names) for s, names in bad if names]
    if bad:
        s, names = bad[0]
        raise PlanError(f"student block {s.stage} of {model} would never learn {len(names)} parameter tensor(s): "
                        f"{listed(names)}; its distillation loss compares only {s.end!r}, the tensor at the block's "
                        f"end, with the teacher's, and their values leave the block beside it (the next block reads "
                        f"the teacher's values instead), so no loss reaches them; ways out: align the blocks elsewhere "
                        f"(blocks=[(teacher_module, student_module), ...]), or accept them untrained with "
                        f"{frozen_hint(names)}")
    return _accepted_notes(plan, stranded, frozen, "student block")


def _accepted_notes(plan: Plan, stranded: Sequence[Stranded], frozen: Sequence[str], what: str) -> Plan:
    """``plan`` with a note per stage (or block) on the parameters ``frozen`` accepts as never trained, and a warned
    note on entries of ``frozen`` that accept none."""
    notes = [f"{what} {s.stage}: {len(names)} parameter tensor(s) never trained, accepted by frozen=: {listed(names)} "
             f"(no loss of the {what} reaches them; they keep their values)"
             for s in stranded if (names := [n for n in s.names if accepted(n, frozen)])]
    idle = [f for f in frozen if not any(accepted(n, [f]) for s in stranded for n in s.names)]
    if idle:
        note = (f"frozen={idle!r} accepts no parameter of this plan: every loss reaches the parameters it names (or "
                f"they do not require gradients), so they train as usual; drop them from frozen (to stop training a "
                f"parameter, set its requires_grad=False)")
        warnings.warn(note, UserWarning, stacklevel=user_stacklevel())
        notes.append(note)
    return dataclasses.replace(plan, notes=(*plan.notes, *notes), frozen=tuple(frozen))

"""The notes an assembled ``ppll`` plan closes with: a model planned on the meta device, a model output the default
losses do not fit, and a slow stage; the last two are warned at the user's call too."""

from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from ..analysis.analyse import Analysis
from ..analysis.cut_heads import scores_spec
from ..capture.meta import PLANNED_ON_META, is_meta
from ..options import PlanOptions
from ..plans.plan import Plan
from .partition import slow_stage_note

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
        warnings.warn(note, UserWarning, stacklevel=4)  # at the caller of plan() or compile()
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

"""The losses of a pipeline's stages: the task's rule (classification, per-token, multi-label, regression) on a
head's scores or the model's output."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import PPLLError

IGNORE_INDEX = -100
"""Label of a position no loss is taken on (padding, a prompt, the last token of a causal LM), as in torch."""

Loss = Callable[[Any, Any], Tensor]
"""A loss ``fn(scores_or_output, target) -> scalar tensor``."""


def logits_of(output: Any) -> Any:
    """The class scores in a model's output: the tensor itself, an output object's or dict's ``logits``, or the
    first tensor of a tuple or list (e.g. a Hugging Face ``ModelOutput`` or ``return_dict=False`` tuple)."""
    if isinstance(output, Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, (tuple, list)):
        return next((v for v in output if isinstance(v, Tensor)), output)
    return output


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of N x C scores for N labels, or of N x L x C scores for N x L labels (per token);
    positions labelled :data:`IGNORE_INDEX` count for nothing."""
    if logits.dim() > 2 and target.dim() == logits.dim() - 1:
        return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def task_of(scores: Any, target: Any) -> str | None:
    """The task ``target`` sets for ``scores`` (see :func:`task_loss`): ``"classes"`` (N labels for N x C scores),
    ``"tokens"`` (N x L labels for N x L x C scores), ``"multilabel"`` (targets holding as many values per example
    as the scores, each 0 or 1: bool, integer, or float as ``BCEWithLogitsLoss`` takes them), ``"regression"``
    (float targets likewise, with any other value), or ``None`` (no head loss fits)."""
    if not (isinstance(scores, Tensor) and isinstance(target, Tensor) and scores.is_floating_point()
            and scores.dim() >= 1 and target.dim() >= 1) or target.is_complex():
        return None
    floating = target.is_floating_point()
    if not floating and target.dtype != torch.bool and scores.dim() >= 2 and scores.shape[-1] > 1 \
            and target.shape == scores.shape[:-1]:
        return "classes" if target.dim() == 1 else "tokens"
    if scores.shape[0] == target.shape[0] and scores.numel() == target.numel():
        return "regression" if floating and not zero_one(target) else "multilabel"
    return None


def zero_one(target: Tensor) -> bool:
    """Whether every value of the float ``target`` is 0 or 1 (labels, as ``BCEWithLogitsLoss`` takes them); ``False``
    where the values cannot be read (a tensor on the meta device)."""
    if target.device.type == "meta":
        return False
    t = target.detach()
    try:
        return bool(((t == 0) | (t == 1)).all())
    except RuntimeError:  # a fake tensor: its values are unknown
        return False


def to_target_length(scores: Any, target: Any) -> Any:
    """Per-token scores N x S x C for a per-token target N x T of another length: the head sits on an encoder's
    stage of a sequence-to-sequence model, whose S source positions do not line up with the T target ones. Each
    target token is then predicted from the mean of the S positions' scores, the same for every target position:
    the stage learns to encode which tokens the target holds (a bag of tokens), which needs no attention to the
    target and no target length at build time. Other scores pass unchanged (with S == T the positions are taken
    to line up, as in a causal LM)."""
    if (isinstance(scores, Tensor) and isinstance(target, Tensor) and scores.dim() == 3 and target.dim() == 2
            and not target.is_floating_point() and scores.shape[0] == target.shape[0]
            and scores.shape[1] != target.shape[1]):
        return scores.mean(1, keepdim=True).expand(-1, target.shape[1], -1)
    return scores


def task_loss(scores: Any, target: Any, loss: Loss | None = None, *, where: str = "the head",
              way_out: str | None = None) -> Tensor:
    """The loss the task asks of ``scores`` for ``target``: the one rule of every auxiliary head, and of the last
    stage when the trainer has no ``loss=``.

    - integer class labels of the scores' shape without its last dimension (N labels for N x C scores, N x L for
      N x L x C per token, C > 1): cross-entropy, labels :data:`IGNORE_INDEX` counting for nothing;
    - a target holding as many values per example as the scores (the scores are reshaped to the target's shape,
      e.g. N x 1 scores for N targets): labels that are all 0 or 1, as bool, integer or float (what
      ``BCEWithLogitsLoss`` takes), are multi-label: binary cross-entropy with logits on the target as float;
      other float targets are regression: the mean squared error. ``loss`` (the user's ``loss=``) takes every float
      target, 0/1 ones included: it is how a regression whose targets may all be 0 or 1 in a batch stays one;
    - anything else raises a :class:`~ppll_compile.PPLLError` naming ``where`` (the stage) and ``way_out``
      (default: the trainer's ``aux_loss=``).

    The task is read from each batch's target: float targets that hold other values in some batches and only 0
    and 1 in others are scored by MSE in the first and BCE in the second unless ``loss`` is given.
    """
    task = task_of(scores, target)
    if task in ("classes", "tokens"):
        return cross_entropy(scores, target)
    if task is None:
        raise PPLLError(_no_task_loss(scores, target, where, way_out))
    scores = scores.reshape(target.shape)
    if loss is not None and target.is_floating_point():
        return loss(scores, target)
    if task == "multilabel":
        return F.binary_cross_entropy_with_logits(scores, target.to(scores.dtype))
    return F.mse_loss(scores, target.to(scores.dtype))


def _no_task_loss(scores: Any, target: Any, where: str, way_out: str | None) -> str:
    what = f"scores of shape {tuple(scores.shape)}" if isinstance(scores, Tensor) else \
        f"{type(scores).__name__} scores (not a tensor)"
    got = f"a target of shape {tuple(target.shape)} and dtype {target.dtype}" if isinstance(target, Tensor) else \
        f"a {type(target).__name__} target (not a tensor)"
    way_out = way_out or ("give the heads a loss: compiled.trainer(..., aux_loss=fn) with fn(scores, target) -> "
                          "scalar tensor (or aux_loss=[fn or None per auxiliary head])")
    return (f"{where} gives {what}, and {got} fits no task loss (integer class labels of the scores' shape without "
            f"its last dimension: cross-entropy; as many values per example as the scores: 0/1 labels (bool, "
            f"integer or float) multi-label BCE, other float targets regression (loss= or MSE)); {way_out}")


def model_loss(output: Any, target: Tensor, *, where: str = "the last stage (the model's output)") -> Tensor:
    """The default loss of the last stage: :func:`task_loss` of the model's scores (:func:`logits_of`): cross-entropy
    for class labels (per example or per token), BCE for 0/1 labels of the output's shape (bool, integer or float),
    MSE for other float targets. ``where`` names the stage in the error for a target that fits none."""
    return task_loss(logits_of(output), target, where=where,
                     way_out="pass the last stage's loss: compiled.trainer(..., loss=fn) with fn(output, target) -> "
                             "scalar tensor")

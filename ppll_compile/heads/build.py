"""Auxiliary heads: the head a config describes (its type looked up in :mod:`ppll_compile.heads.types`), its local
loss, and its counted cost.

Head types that build on the model's own blocks say so in the registry (``HeadType.blocks``): of the built-in ones,
``transformer`` with ``init: copy`` starts from copies of the blocks that follow its cut, and ``momentum`` (MAN)
keeps an exponential moving average of them. Building those needs the blocks (``blocks=``, found by
:func:`ppll_compile.lower.split.next_blocks` when lowering). Planning costs a head on the meta device: given the blocks it
costs meta copies of them, exactly; without them (as :func:`head_spec` is called while planning today) it costs a
stand-in of the same shape where the blocks are the usual kind: fresh pre-norm transformer blocks of the config's
``heads`` and ``mlp_ratio`` on sequences (the parameter shapes of a timm, torchvision or Hugging Face ViT block of
that MLP ratio), and a residual block's two conv3x3-BN layers at the input's channels on feature maps (a ResNet basic
block that keeps its width). A block of another shape (a bottleneck, a downsampling block) is then costed as that
stand-in, not as itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..cost.autocast import MetaAutocast
from ..cost.modules import ModuleCost, measure_module
from ..cost.optimizers import optimizer_spec
from ..errors import PolicyError
from ..phases import phase
from ..plans.plan import TensorSpec
from ..plans.precision import precision_spec
from ..plans.specs import HeadSpec
from .losses import model_loss
from .modules import AuxHead, MomentumHead, head_scored_loss, meta_copies
from .output import ProjectionHead
from .policy import Policy, check_head_config, tensor_kind
from .types import HeadRequest, head_type, head_type_for


def copied_blocks(config: Mapping[str, Any]) -> int:
    """How many of the model's blocks after its cut a head config copies or follows (0: none, the head stands alone)."""
    t = head_type_for(config)
    return t.blocks.depth(config) if t is not None and t.blocks is not None else 0


def build_head(config: Mapping[str, Any], spec: TensorSpec, num_classes: int,
               input_shape: Sequence[int] | None = None, *, per_token: bool = False,
               blocks: Sequence[nn.Module] | None = None) -> AuxHead:
    """Build the head a config from :meth:`Policy.config_for` (or a hand-edited plan) describes for ``spec``;
    ``per_token``: the labels are one class per token (N x L), so the config must give N x L x C scores.
    ``blocks``: the model's blocks after the cut, for a head that copies or follows them (see :func:`copied_blocks`;
    without them such a head gets stand-ins of the usual shape, see the module's docstring)."""
    options, loss = check_head_config(config, spec, per_token)
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise PolicyError(f"num_classes must be an integer >= 1, got {reprlib.repr(num_classes)}")
    t = head_type(options["type"])
    request = HeadRequest(options=options, loss=loss, kind=tensor_kind(spec), shape=tuple(spec.shape),
                          num_classes=num_classes, input_shape=None if input_shape is None else tuple(input_shape),
                          blocks=blocks if t.blocks is not None else None)
    head = t.build(request)
    wanted = MomentumHead if t.follows_next else AuxHead
    if not isinstance(head, wanted):
        why = ", as it follows the next stage (follows_next=True)" if t.follows_next else ""
        raise PolicyError(f"head type {t.name!r} built {reprlib.repr(head)}, but a head type's builder must return "
                          f"a ppll_compile.heads.modules.{wanted.__name__}{why}; fix its build function")
    head.needs_input = t.needs_input  # what the runtime reads: whether to carry the raw input to this stage
    return head


def make_head(policy: Policy, spec: TensorSpec, num_classes: int, input_shape: Sequence[int] | None = None, *,
              per_token: bool = False, blocks: Sequence[nn.Module] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The head ``policy`` gives boundary ``spec``, and its config (``{"type": "callable", ...}`` for callables);
    ``per_token``: for labels of one class per token (a callable is called as always and must then give
    N x L x C scores); ``blocks``: see :func:`build_head`."""
    config = policy.config_for(spec, per_token=per_token)
    if policy.builder is None:
        return build_head(config, spec, num_classes, input_shape, per_token=per_token, blocks=blocks), config
    head = policy.builder(spec, num_classes)
    if not isinstance(head, nn.Module):
        scores = f"per-token scores N x L x {num_classes}" if per_token else f"logits N x {num_classes}"
        raise PolicyError(f"policy callable {policy.name!r} returned {reprlib.repr(head)} for boundary {spec.name!r}; "
                          f"it must return an nn.Module mapping a tensor of shape {tuple(spec.shape)} to {scores}")
    return head, config


def head_for(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
             input_shape: Sequence[int] | None, *, per_token: bool = False,
             blocks: Sequence[nn.Module] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The head for a boundary: the policy's choice (``config`` None), a callable policy's, or a given config;
    ``per_token``: for labels of one class per token; ``blocks``: see :func:`build_head`."""
    if config is None or config.get("type") == "callable":
        return make_head(policy, spec, num_classes, input_shape, per_token=per_token, blocks=blocks)
    return build_head(config, spec, num_classes, input_shape, per_token=per_token, blocks=blocks), dict(config)


def head_spec(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
              input_shape: Sequence[int] | None, optimizer: str, *, per_token: bool = False,
              blocks: Sequence[nn.Module] | None = None, precision: str = "fp32") -> HeadSpec:
    """The head for a boundary, built on the meta device and counted like the backbone (FLOPs and memory), its
    loss taken on labels of one class per example, or per token (N x L) with ``per_token``. ``blocks``: the model's
    blocks after the cut, for a head that copies or follows them (costed as meta copies of them; without them, as
    stand-ins of the usual shape: see the module's docstring)."""
    return counted_head(policy, config, spec, num_classes, input_shape, optimizer, per_token=per_token,
                        blocks=blocks, precision=precision)[0]


def counted_head(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
                 input_shape: Sequence[int] | None, optimizer: str, *, per_token: bool = False,
                 blocks: Sequence[nn.Module] | None = None, precision: str = "fp32") -> tuple[HeadSpec, ModuleCost]:
    """:func:`head_spec`, and the head's measured cost (its operators, for the roofline), in ``precision`` (a
    low one: the head's layers in its dtype, the loss in float32 as autocast runs it, float32 master weights and
    autocast's weight casts unless pure; see :mod:`ppll_compile.plans.precision`)."""
    with phase("heads"):
        return _counted_head(policy, config, spec, num_classes, input_shape, optimizer, per_token, blocks,
                             precision)


def _counted_head(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
                  input_shape: Sequence[int] | None, optimizer: str, per_token: bool,
                  blocks: Sequence[nn.Module] | None, precision: str) -> tuple[HeadSpec, ModuleCost]:
    fakes = meta_copies(blocks) if blocks is not None else None
    p = precision_spec(precision)
    with torch.device("meta"):
        head, config = head_for(policy, config, spec, num_classes, input_shape, per_token=per_token, blocks=fakes)
        head = head.to("meta")
        pbytes = sum(p.param_bytes(t.numel(), t.element_size(), t.is_floating_point()) for t in head.parameters())
        if p.pure:
            head = head.to(getattr(torch, p.dtype))
        dtype = getattr(torch, p.dtype if p.low and spec.dtype == "float32" else spec.dtype)
        h = torch.empty(spec.shape, dtype=dtype)  # the boundary as the stage sends it
        y = torch.zeros(tuple(spec.shape[:2]) if per_token else spec.shape[0], dtype=torch.long)
        x = torch.empty(input_shape) if input_shape is not None else None
    h.requires_grad_(True)  # the stage's backward runs through the head into its output
    extra = 0
    t = head_type_for(config)
    if t is not None and t.follows_next:  # its trunk is not trained; its EMA weights are kept
        extra = head.ema_bytes()
        config = {**config, "mirror_bytes": extra}
    if isinstance(head, ProjectionHead):  # its frozen copy of the model's projection: no gradient, no optimizer state
        extra = head.frozen_bytes()
    read: list[Any] = []

    def run() -> torch.Tensor:
        with MetaAutocast(getattr(torch, p.dtype)) if p.low else contextlib.nullcontext():
            scores, loss = head_scored_loss(head, h, y, x)
        read.append(scores)
        return loss

    cost = measure_module(head, run, inputs=(h,))
    scores = scores_size(read[0])
    # the scores' gradient exists at the loss's backward beside what the loss saved (measured)
    memory = pbytes * (2 + optimizer_spec(optimizer).states) + cost.activation_bytes + _gradient(read[0]) + extra
    return HeadSpec(policy=policy.name, kind=_kind_text(spec), config=dict(config),
                    param_count=cost.param_count, flops_fwd=cost.flops_fwd, flops_bwd=cost.flops_bwd,
                    memory_bytes=memory, input_saved_bytes=cost.input_saved_bytes, scores_bytes=scores), cost


def scores_size(scores: Any) -> int:
    """Bytes of one copy of ``scores`` when a gradient flows into them (a tensor that requires grad), else 0."""
    if isinstance(scores, torch.Tensor) and scores.requires_grad:
        return scores.numel() * scores.element_size()
    return 0


def _gradient(scores: Any) -> int:
    """Bytes of the gradient a loss gives ``scores`` (0 without one): float32 for low-precision scores, which the
    loss reads as a float32 copy (:class:`~ppll_compile.cost.autocast.MetaAutocast`)."""
    size = scores_size(scores)
    return size * 4 // scores.element_size() if size and scores.dtype in (torch.bfloat16, torch.float16) else size


def counted_loss(scores: TensorSpec | None, num_classes: int, per_token: bool) -> tuple[HeadSpec, ModuleCost]:
    """The last stage's head, the model's own output under the trainer's default loss, measured on the meta device
    as heads are: the cross-entropy of the ``scores`` (N x C, or N x L x C with ``per_token``) on class labels, when
    the default loss reads them so (floating point, ``num_classes > 0``; as the time profile's last stage does),
    in float32 as autocast runs it when the scores are in a low precision (the plan's).
    Its memory: the scores (the stage's output, held until its step ends), what the loss saves for backward
    (the log-probabilities, the labels) and the scores' gradient (float32 for low-precision scores). Its time: the
    loss's operators. Scores the default loss does not read so are costed as nothing (:func:`model_head`)."""
    head = model_head()
    if scores is None or "float" not in scores.dtype or num_classes <= 0 \
            or len(scores.shape) != (3 if per_token else 2) or scores.shape[-1] < 2:
        return head, ModuleCost(flops_fwd=0, flops_bwd=0, param_count=0, activation_bytes=0)
    with phase("heads"), torch.device("meta"):
        s = torch.empty(scores.shape, dtype=getattr(torch, scores.dtype))
        y = torch.zeros(tuple(scores.shape[:-1]), dtype=torch.long)
    s.requires_grad_(True)
    low = s.dtype in (torch.bfloat16, torch.float16)

    def run() -> torch.Tensor:
        with MetaAutocast(s.dtype) if low else contextlib.nullcontext():
            return model_loss(s, y)

    cost = measure_module(nn.Module(), run, inputs=(s,))
    one = scores_size(s)
    return dataclasses.replace(head, flops_fwd=cost.flops_fwd, flops_bwd=cost.flops_bwd, scores_bytes=one,
                               memory_bytes=one + _gradient(s) + cost.activation_bytes), cost


def stage_head(head: HeadSpec, stage: int, stages: int) -> HeadSpec:
    """The head of stage ``stage`` of ``stages``: its type's loss weights there (an infopro head's ``lambda1`` for the
    reconstruction, ``lambda2`` for the classification, see :func:`stage_weights`) written into its config's loss
    section, which the head is built from; a head of a type without them as it is."""
    c = head.config
    t = head_type_for(c)
    weights = t.stage_loss(c, stage, stages) if t is not None and t.stage_loss is not None else None
    if weights is None:
        return head
    return dataclasses.replace(head, config={**dict(c), "loss": {**dict(c.get("loss", {})), **weights}})


def head_notes(head: HeadSpec, stage: int, link_bandwidth: float) -> list[str]:
    """What the plan should say about stage ``stage``'s head, from its type (a momentum head's weight transfers)."""
    t = head_type_for(head.config)
    return t.notes(head.config, stage, link_bandwidth) if t is not None and t.notes is not None else []


def _kind_text(spec: TensorSpec) -> str:
    """The boundary's tensor kind, or its rank (``5-D``) where only a callable policy's head reads it."""
    try:
        return tensor_kind(spec)
    except PolicyError:
        return f"{len(spec.shape)}-D"


def model_head() -> HeadSpec:
    """The last stage's head: the model's own output under the trainer's loss."""
    return HeadSpec(policy="model", kind="model", config={"type": "model", "loss": "cross_entropy"})

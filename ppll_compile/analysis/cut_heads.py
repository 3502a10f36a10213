"""The auxiliary heads a ``ppll`` plan chooses among: the head at every candidate cut with its measured cost, the
model's blocks such a head copies or follows, and the last stage's loss on the model's output."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx, nn

from ..cost.modules import ModuleCost
from ..cost.nodes import META_KEY
from ..errors import PolicyError
from ..heads.build import copied_blocks, counted_head, counted_loss
from ..heads.policy import Policy
from ..options import PlanOptions, SavedPlan
from ..plans.plan import TensorSpec
from ..plans.specs import HeadSpec
from .analyse import Analysis
from .cuts import Cut

FindBlocks = Callable[..., list[tuple[str, nn.Module]]]
"""The model's blocks after a cut, with their module paths: ``find(nodes, cut, depth, config=config)``, lowering's
:func:`~ppll_compile.lower.split.next_blocks` bound to the model by the caller (lowering is a later phase)."""


def copied_after(a: Analysis, policy: Policy, cut: Cut, config: Any, find: FindBlocks) -> list[nn.Module] | None:
    """The model's blocks after ``cut`` that its head (``config``, or the policy's) copies or follows; None if none."""
    if config is None:
        spec = a.boundary(cut)[0]
        config = policy.config_for(spec, a.per_token) if policy.builder is None and policy.fits(spec, a.per_token) \
            else {}
    depth = copied_blocks(config)
    return [m for _, m in find(a.nodes, cut.node, depth, config=config)] if depth else None


def cut_heads(a: Analysis, manual: Sequence[int] | None, saved: SavedPlan | None, policy: Policy, opts: PlanOptions,
              find: FindBlocks) -> tuple[dict[int, HeadSpec], dict[int, ModuleCost]]:
    """The head at every cut the partitioner may choose (the cuts given by hand, ``manual``, else every cut: the
    policy's head, or the saved plan's, possibly edited), and its measured cost; after the last unit (key
    ``len(a.cuts)``), the last stage's loss on the model's output."""
    configs = dict(zip(manual, saved.heads)) if saved is not None and manual else {}
    candidates = manual if manual is not None else range(len(a.cuts))
    input_shape = a.inputs[0].shape if a.inputs else None
    measured: dict[Any, tuple[HeadSpec, ModuleCost]] = {}
    heads: dict[int, HeadSpec] = {}
    costs: dict[int, ModuleCost] = {}
    for i in candidates:
        spec = a.boundary(a.cuts[i])[0]
        config = configs.get(i)
        try:
            blocks = copied_after(a, policy, a.cuts[i], config, find)
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
    heads[len(a.cuts)], costs[len(a.cuts)] = counted_loss(scores_spec(a), a.num_classes, a.per_token)
    return heads, costs


def scores_spec(a: Analysis) -> TensorSpec | None:
    """The tensor of the model's output the last stage's default loss reads (see
    :func:`~ppll_compile.heads.build.logits_of`): the output itself, an output dict's ``logits``, or the first tensor
    of a tuple or list; ``None`` when it finds none."""
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

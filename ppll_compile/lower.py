"""Lower a plan to stage modules with split_module (sharing the model's parameters) and heads, on their devices."""

from __future__ import annotations

import bisect
import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from .analysis import Analysis
from .cuts import Cut
from .errors import PlanError
from .capture import BUFFER_OWNERS
from .export import OUTPUT_SPEC
from .heads import head_for
from .lowered import SOURCE_NAME, Inputs, Lowered, Stage
from .plan import Plan
from .policy import Policy
from .trace import attribute, quiet

__all__ = ["split_stages", "model_inputs", "lower_ppll"]


def split_stages(gm: fx.GraphModule, cuts: Sequence[Cut], *, untie: bool = False) -> list[Stage]:
    """Split ``gm`` after each of ``cuts`` (legal cuts, in graph order) into :class:`Stage` modules.

    A parameter that a later stage uses too (a module called at two depths, tied weights) stays with the
    first stage that uses it; with ``untie`` the later stage trains its own copy, else that is an error.
    """
    nodes = list(gm.graph.nodes)
    for n in nodes:
        n.meta[SOURCE_NAME] = n.name
    order = {n.name: i for i, n in enumerate(nodes)}
    positions = [order[c.node] for c in cuts]
    if positions != sorted(positions) or len(set(positions)) != len(positions):
        raise PlanError(f"cuts {[c.node for c in cuts]} are not in graph order")

    def partition(node: fx.Node) -> int:
        if node.op == "get_attr" and node.users:  # parameters live with the stage that uses them
            node = min(node.users, key=lambda u: order[u.name])
        return bisect.bisect_left(positions, order[node.name])  # cuts strictly before the node

    with quiet():  # fx's notes on attributes it resolves later are not the user's concern
        top = split_module(gm, gm, partition, keep_original_order=True)
        calls = {n.target: n for n in top.graph.nodes if n.op == "call_module"}
        subs = [_own_parameters(getattr(top, f"submod_{i}"), calls[f"submod_{i}"], gm) for i in range(len(cuts) + 1)]
    _untie(subs, untie)
    output = nodes[-1]
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    stages = []
    for i, sub in enumerate(subs):
        ins = placeholders if i == 0 else cuts[i - 1].boundary
        last = i == len(cuts)
        stages.append(Stage(sub, index=i, inputs=ins, outputs=() if last else cuts[i].boundary,
                            result=output.args[0] if last else None,
                            result_spec=gm.meta.get(OUTPUT_SPEC) if last else None,
                            buffers=_model_buffers(sub, gm.meta.get(BUFFER_OWNERS, {}))))
    return stages


def _own_parameters(sub: fx.GraphModule, call: fx.Node, gm: fx.GraphModule) -> fx.GraphModule:
    """Turn parameters that split_module passes in as inputs back into attributes of the stage module.

    Every parameter then belongs to exactly one stage (``stage.parameters()``), as the same object.
    """
    graph = sub.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for ph, arg in zip(placeholders, call.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            with graph.inserting_before(first_op):
                attr = graph.get_attr(arg.target)
            ph.replace_all_uses_with(attr)
            graph.erase_node(ph)
    attrs = {n.target: sub.get_submodule(n.target) if n.op == "call_module" else _attr(sub, gm, n.target)
             for n in graph.nodes if n.op in ("call_module", "get_attr")}
    return fx.GraphModule(attrs, graph, class_name=type(sub).__name__)


def _untie(subs: Sequence[fx.GraphModule], untie: bool) -> None:
    """Give each stage its own copy of the parameters an earlier stage holds (or refuse, without ``untie``).

    A shared module a later stage calls is replaced there by a deep copy; a shared parameter it reads by a
    clone. The model keeps the objects of the first stage that uses them.
    """
    owner: dict[int, int] = {}
    for i, sub in enumerate(subs):
        for name, p in sub.named_parameters():
            if id(p) in owner and not untie:
                raise PlanError(f"stages {owner[id(p)]} and {i} both use parameter {name!r}: two optimizers would "
                                f"train one tensor. Pass tied='untie' to give stage {i} its own copy, or cut "
                                f"elsewhere")
        for n in sub.graph.nodes:
            if n.op not in ("call_module", "get_attr"):
                continue
            obj = _attr(sub, sub, str(n.target))
            if isinstance(obj, nn.Module) and any(id(p) in owner for p in obj.parameters()):
                _set_attr(sub, str(n.target), copy.deepcopy(obj))
            elif isinstance(obj, nn.Parameter) and id(obj) in owner:
                _set_attr(sub, str(n.target), nn.Parameter(obj.detach().clone(), requires_grad=obj.requires_grad))
        owner.update((id(p), i) for p in sub.parameters() if id(p) not in owner)


def _model_buffers(sub: fx.GraphModule, owners: dict[str, tuple[nn.Module, str]]) -> list[tuple[str, nn.Module, str]]:
    """The buffers ``sub`` reads by attribute that belong to the model: (path in ``sub``, owner, name)."""
    targets = {str(n.target) for n in sub.graph.nodes if n.op == "get_attr"}
    return [(t, *owners[t]) for t in sorted(targets) if t in owners]


def _set_attr(sub: nn.Module, target: str, value: Any) -> None:
    """Point ``sub``'s attribute path ``target`` at ``value`` (``sub``'s containers are its own)."""
    parent, _, name = target.rpartition(".")
    setattr(sub.get_submodule(parent) if parent else sub, name, value)


def _attr(sub: nn.Module, gm: nn.Module, target: str) -> Any:
    """An attribute a stage reads: the submodule's own copy reference, else the original model's."""
    try:
        return attribute(target, sub, gm)
    except AttributeError:
        raise PlanError(f"stage reads attribute {target!r}, which the model does not have") from None


def model_inputs(model: nn.Module, gm: fx.GraphModule, fixed: dict[str, Any]) -> Inputs:
    """The binder from a call with ``model``'s signature to the inputs of its traced graph ``gm``."""
    return Inputs(model=type(model).__name__, signature=inspect.signature(model.forward), fixed=fixed,
                  names=tuple(n.target for n in gm.graph.nodes if n.op == "placeholder"))


def lower_ppll(model: nn.Module, plan: Plan, a: Analysis, policy: Policy, *, untie: bool = False) -> Lowered:
    """The stage modules of a ``ppll`` plan and the auxiliary head of every stage but the last, on their devices.

    ``untie``: a parameter used on both sides of a cut is copied into the later stage (``tied='untie'``).
    """
    by_name = {c.node: c for c in a.cuts}
    stages = split_stages(a.gm, [by_name[c] for c in plan.cuts], untie=untie)
    input_shape = a.inputs[0].shape if a.inputs else None
    heads: list[nn.Module | None] = []
    for st, sp in zip(stages, plan.stages):
        st.to(sp.device)
        heads.append(None if sp.is_last else
                     head_for(policy, sp.head.config, sp.boundary[0], a.num_classes, input_shape,
                              per_token=a.per_token)[0].to(sp.device))
    return Lowered(modules=tuple(stages), heads=tuple(heads), devices=tuple(torch.device(d) for d in plan.devices),
                   inputs=model_inputs(model, a.gm, a.fixed_args))

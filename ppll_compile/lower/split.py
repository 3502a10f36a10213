"""Lower a plan to stage modules with split_module (sharing the model's parameters) and heads, on their devices."""

from __future__ import annotations

import bisect
import contextlib
import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from ..analysis.analyse import Analysis
from ..analysis.cuts import Cut
from ..capture.export import OUTPUT_SPEC
from ..capture.frontends import BUFFER_OWNERS
from ..capture.trace import attribute, module_path, quiet
from ..errors import PlanError, PolicyError
from ..heads.build import copied_blocks, head_for
from ..heads.output import share_frozen
from ..heads.policy import Policy
from ..heads.types import head_type_for
from ..plans.plan import Plan
from .materialize import Materialization, materialize_stage, seeded_init
from .stages import SOURCE_NAME, Inputs, Lowered, Stage


def split_stages(gm: fx.GraphModule, cuts: Sequence[Cut], *, untie: bool = False,
                 checkpoints: Sequence[Sequence[str]] | None = None) -> list[Stage]:
    """Split ``gm`` after each of ``cuts`` (legal cuts, in graph order) into :class:`Stage` modules.

    A parameter that a later stage uses too (a module called at two depths, tied weights) stays with the
    first stage that uses it; with ``untie`` the later stage trains its own copy, else that is an error.
    ``checkpoints``: per stage, the nodes after which its block is cut into segments that backward recomputes
    (activation checkpointing, ``Plan.checkpoint_activations``); ``None``: no checkpointing.
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
                            buffers=_model_buffers(sub, gm.meta.get(BUFFER_OWNERS, {})),
                            checkpoints=None if checkpoints is None else checkpoints[i]))
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


def lower_ppll(model: nn.Module, plan: Plan, a: Analysis, policy: Policy, *, untie: bool = False,
               materialize: Materialization | None = None, seed: int | None = None) -> Lowered:
    """The stage modules of a ``ppll`` plan and the auxiliary head of every stage but the last, on their devices.

    ``untie``: a parameter used on both sides of a cut is copied into the later stage (``tied='untie'``). A head that
    copies or follows the blocks after its cut (``transformer`` with ``init: copy``, ``momentum``) gets deep copies of
    the model's own block modules; a momentum head also learns which parameters of the next stage it follows.

    ``materialize`` (a model built on the meta device): each stage it names (every stage by default) is allocated
    on its device and filled (see :mod:`ppll_compile.lower.materialize`), before the heads copy any block; the other
    stages, and their heads, stay on meta.

    ``plan.checkpoint_activations``: every stage recomputes its activations in backward, segment by segment between
    the cuts of its ``checkpoints`` (see :func:`~ppll_compile.lower.stages.run_checkpointed`).

    ``seed``: every head draws its random initial values from the default generator seeded by (``seed``, its stage)
    (:func:`~ppll_compile.lower.materialize.seeded_init`), whichever other heads this process builds; ``None``: from the
    caller's generator, in stage order.
    """
    by_name = {c.node: c for c in a.cuts}
    stages = split_stages(a.gm, [by_name[c] for c in plan.cuts], untie=untie,
                          checkpoints=[s.checkpoints for s in plan.stages] if plan.checkpoint_activations else None)
    input_shape = a.inputs[0].shape if a.inputs else None
    here = range(len(stages)) if materialize is None or materialize.stages is None else materialize.stages
    for st, sp in zip(stages, plan.stages):
        if materialize is None:
            st.to(sp.device)
        elif st.index in here:
            materialize_stage(model, st, st.index, torch.device(sp.device), materialize, tied=plan.untied)
    heads: list[nn.Module | None] = []
    for i, sp in enumerate(plan.stages):
        if sp.is_last:
            heads.append(None)
            continue
        depth = copied_blocks(sp.head.config)
        blocks = next_blocks(model, a.nodes, plan.cuts[i], depth, stage=i, config=sp.head.config) if depth else []
        with torch.device("meta") if i not in here else contextlib.nullcontext(), \
                seeded_init(seed, i, "head"):  # a meta stage: a meta head
            head = head_for(policy, sp.head.config, sp.boundary[0], a.num_classes, input_shape,
                            per_token=a.per_token, blocks=[m for _, m in blocks] if depth else None)[0]
        if (t := head_type_for(sp.head.config)) is not None and t.follows_next:
            head.mirrors = _mirrors(blocks, stages[i + 1], i, plan.cuts[i])
        heads.append(head.to(sp.device) if i in here else head)
    share_frozen(heads)  # shared lm_output heads on one device: one copy of the frozen projection
    return Lowered(modules=tuple(stages), heads=tuple(heads), devices=tuple(torch.device(d) for d in plan.devices),
                   inputs=model_inputs(model, a.gm, a.fixed_args))


def _head_text(config: Any, stage: int | None) -> tuple[str, str, str]:
    """How errors name stage ``stage``'s head (``None``: no stage chosen yet), what it does with the blocks, and the
    way out without them."""
    depth, whose = config.get("depth", 1), "the" if stage is None else f"stage {stage}'s"
    t = head_type_for(config)
    if t is None or t.blocks is None:
        return f"{whose} head (depth {depth})", "copies", "use a head that stands alone"
    return f"{whose} {t.name} head ({t.blocks.detail}depth {depth})", t.blocks.verb, t.blocks.way_out


def next_blocks(model: nn.Module, nodes: Sequence[fx.Node], cut: str, depth: int, *, stage: int | None = None,
                config: Any = None) -> list[tuple[str, nn.Module]]:
    """The ``depth`` blocks of ``model`` that follow the cut after node ``cut`` of the traced ``nodes``, with their
    module paths: the child of a ``ModuleList`` or ``Sequential`` that holds the first module after the cut and
    begins there, and its next ``depth - 1`` siblings. The outermost such container counts (a timm ``blocks.k``, a
    Hugging Face ``layer.k``, a torchvision ``layer2.k``), so a block's own inner Sequential does not.

    ``stage`` (None while planning) and ``config`` (the head's) only word the errors: no block begins at the cut, or
    too few follow it.
    """
    what, verb, way_out = _head_text(config or {}, stage)
    if (t := head_type_for(config or {})) is not None and t.blocks is not None and t.blocks.find is not None:
        return t.blocks.find(model, nodes, cut)  # modules found elsewhere (the lm_output head's norm and projection)
    order = [n.name for n in nodes]
    at = order.index(cut)
    before = module_path(nodes[at])
    first = next((module_path(n) for n in nodes[at + 1:] if n.op not in ("placeholder", "output") and module_path(n)),
                 "")
    parts = first.split(".") if first else []
    for k in range(1, len(parts) + 1):
        path, parent = ".".join(parts[:k]), ".".join(parts[:k - 1])
        try:
            container = model.get_submodule(parent)
        except AttributeError:  # a path the capture names that the module tree does not have: no container here
            continue
        inside = before == path or before.startswith(path + ".")
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and not inside:
            names = list(dict(container.named_children()))
            left = names[names.index(parts[k - 1]):]
            if len(left) < depth:
                full = [f"{parent}.{n}" if parent else n for n in left]
                raise PolicyError(
                    f"{what} {verb} the {depth} blocks after cut {cut!r}, but only {len(left)} block(s) of "
                    f"{parent or type(model).__name__!r} follow it ({', '.join(full)}); use depth: {len(left)} or "
                    f"less, cut earlier, or {way_out.split('; ')[-1]}")
            return [(f"{parent}.{n}" if parent else n, container.get_submodule(n)) for n in left[:depth]]
    where = f"the next module, {first!r}," if first else "the nodes after it belong to no submodule, so nothing"
    raise PolicyError(f"{what} {verb} the {depth} block(s) after cut {cut!r}, but no block begins there: {where} is "
                      f"not a child of a ModuleList or Sequential that begins at the cut; {way_out}")


def _mirrors(blocks: Sequence[tuple[str, nn.Module]], following: Stage, stage: int, cut: str) -> list[str]:
    """The names, in ``following``'s ``named_parameters()``, of the blocks' parameters, in the order a momentum
    head keeps their EMA (``named_parameters()`` of the blocks in a list: a shared weight once)."""
    names = {id(p): n for n, p in following.named_parameters()}
    out = []
    for pname, p in nn.ModuleList([m for _, m in blocks]).named_parameters():
        if id(p) not in names:
            index, _, rest = pname.partition(".")
            raise PolicyError(
                f"stage {stage}'s momentum head follows the {len(blocks)} block(s) after cut {cut!r}, but "
                f"{blocks[int(index)][0]}.{rest} is not trained by stage {stage + 1} (a momentum head follows the next "
                f"stage's parameters only); use a smaller depth, or give stage {stage + 1} more blocks "
                f"(split_points=...)")
        out.append(names[id(p)])
    return out

"""Lower a plan to stage modules with split_module; the stages share the original model's parameters."""

from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from .cuts import Cut
from .errors import PlanError
from .plan import Plan

__all__ = ["Stage", "CompiledPipeline", "split_stages", "move"]

_NAME = "ppll_name"


@dataclass(frozen=True)
class _Ref:
    """A named value inside the model's output structure, filled in when the last stage runs."""

    name: str


def move(value: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (nested) value to ``device``; other objects pass through."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        moved = [move(v, device) for v in value]
        return tuple(moved) if isinstance(value, tuple) else moved
    if isinstance(value, dict):
        return {k: move(v, device) for k, v in value.items()}
    return value


class Stage(nn.Module):
    """One pipeline stage: a submodule made by split_module, plus the names of the values it takes and sends.

    ``forward(*inputs)`` takes the previous stage's boundary values (the model's inputs for stage 0) in the
    order of ``inputs`` and returns the tuple of ``outputs`` (the boundary, main tensor first); the last
    stage returns the model's own output structure instead.
    """

    def __init__(self, module: fx.GraphModule, *, index: int, inputs: Sequence[str], outputs: Sequence[str],
                 result: Any = None):
        super().__init__()
        self.module = module
        self.index = index
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        # the model's output structure for the last stage, its values named by _Ref
        self._result = None if result is None else fx.node.map_arg(result, lambda n: _Ref(n.name))
        # split_module renames nodes inside a submodule; their meta keeps the original name
        self._sub_inputs = tuple(n.meta[_NAME] for n in module.graph.nodes if n.op == "placeholder")
        out = next(n for n in module.graph.nodes if n.op == "output").args[0]
        self._sub_outputs = tuple(a.meta[_NAME] for a in out) if isinstance(out, (tuple, list)) \
            else (out.meta[_NAME],)
        self._single = not isinstance(out, (tuple, list))

    @property
    def is_last(self) -> bool:
        return self._result is not None

    def forward(self, *values: Any) -> Any:
        if len(values) != len(self.inputs):
            raise TypeError(f"stage {self.index} takes {len(self.inputs)} value(s) {list(self.inputs)}, "
                            f"got {len(values)}")
        env = dict(zip(self.inputs, values))
        out = self.module(*(env[n] for n in self._sub_inputs))
        env.update(zip(self._sub_outputs, (out,) if self._single else out))
        if self._result is not None:
            return fx.node.map_aggregate(self._result, lambda v: env[v.name] if isinstance(v, _Ref) else v)
        return tuple(env[n] for n in self.outputs)


def split_stages(gm: fx.GraphModule, cuts: Sequence[Cut]) -> list[Stage]:
    """Split ``gm`` after each of ``cuts`` (legal cuts, in graph order) into :class:`Stage` modules."""
    nodes = list(gm.graph.nodes)
    for n in nodes:
        n.meta[_NAME] = n.name
    order = {n.name: i for i, n in enumerate(nodes)}
    positions = [order[c.node] for c in cuts]
    if positions != sorted(positions) or len(set(positions)) != len(positions):
        raise PlanError(f"cuts {[c.node for c in cuts]} are not in graph order")

    def partition(node: fx.Node) -> int:
        if node.op == "get_attr" and node.users:  # parameters live with the stage that uses them
            node = min(node.users, key=lambda u: order[u.name])
        return bisect.bisect_left(positions, order[node.name])  # cuts strictly before the node

    top = split_module(gm, gm, partition, keep_original_order=True)
    output = nodes[-1]
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    calls = {n.target: n for n in top.graph.nodes if n.op == "call_module"}
    stages = []
    for i in range(len(cuts) + 1):
        sub = _own_parameters(getattr(top, f"submod_{i}"), calls[f"submod_{i}"], gm)
        ins = placeholders if i == 0 else cuts[i - 1].boundary
        last = i == len(cuts)
        stages.append(Stage(sub, index=i, inputs=ins, outputs=() if last else cuts[i].boundary,
                            result=output.args[0] if last else None))
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


def _attr(sub: nn.Module, gm: nn.Module, target: str) -> Any:
    """An attribute a stage reads: the submodule's own copy reference, else the original model's."""
    for root in (sub, gm):
        obj: Any = root
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise PlanError(f"stage reads attribute {target!r}, which the model does not have")


class CompiledPipeline:
    """A model compiled into pipeline stages: ``plan``, ``stages``, ``heads``; calling it runs the stages in order.

    The stages share the original model's parameter objects, so training them trains the model in place.
    """

    def __init__(self, *, model: nn.Module, graph_module: fx.GraphModule, plan: Plan, stages: list[Stage],
                 heads: list[nn.Module | None], fixed_args: dict[str, Any]):
        self.model = model
        self.graph_module = graph_module
        self.plan = plan
        self.stages = stages
        self.heads = heads
        self._signature = inspect.signature(model.forward)
        self._fixed = fixed_args
        self._arg_names = tuple(n.target for n in graph_module.graph.nodes if n.op == "placeholder")

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(torch.device(d) for d in self.plan.devices)

    def train(self, mode: bool = True) -> CompiledPipeline:
        for s, h in zip(self.stages, self.heads):
            s.train(mode)
            if h is not None:
                h.train(mode)
        return self

    def eval(self) -> CompiledPipeline:
        return self.train(False)

    def stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Parameters stage ``index`` trains: its backbone slice and its auxiliary head."""
        params = list(self.stages[index].parameters())
        head = self.heads[index]
        return params + (list(head.parameters()) if head is not None else [])

    def make_runners(self, config: Any, indices: Sequence[int], devices: Sequence[torch.device],
                     groups: Sequence[Any] | None = None) -> list[Any]:
        """The runtime's runners for stages ``indices`` on ``devices`` (``groups``: each one's replica group)."""
        from .runtime.stage import make_runners
        return make_runners(self, config, indices, devices, groups)

    @property
    def carries_input(self) -> bool:
        """Whether a head needs the model's raw input (InfoPro), so messages carry it."""
        return any(getattr(h, "needs_input", False) for h in self.heads)

    def trainer(self, **options: Any) -> Any:
        """A :class:`~ppll_compile.runtime.Trainer` for this pipeline; ``options`` are its keyword arguments.

        ``optimizer`` (a factory ``fn(params) -> Optimizer``) is required; ``runtime`` is ``sequential``
        (default), ``threads`` or ``distributed``.
        """
        from .runtime import Trainer
        return Trainer(self, **options)

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The model inputs in stage 0's order, from a call with the model's own signature."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{type(self.model).__name__}: {e}") from None
        bound.apply_defaults()
        for name, default in self._fixed.items():
            if bound.arguments.get(name, default) is not default:
                raise TypeError(f"{type(self.model).__name__} was compiled with {name}={default!r} fixed; "
                                f"compile again with {name} in example_kwargs to pass it")
        return tuple(bound.arguments[n] for n in self._arg_names)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values: Any = self.bind(*args, **kwargs)
        for stage, device in zip(self.stages, self.devices):
            values = stage(*move(values, device))
        return values

    def __repr__(self) -> str:
        return f"CompiledPipeline({type(self.model).__name__}, {len(self.stages)} stages)\n{self.plan.table()}"

"""What lowering hands the runtime: stage modules, heads, Pipe-BD's teacher blocks and losses, and the input binder."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..capture.meta import check_materialized, check_real_batch
from ..plans.plan import StagePlan

SOURCE_NAME = "ppll_name"
"""``node.meta`` key that keeps a node's name in the traced graph after ``split_module`` renames it."""


@dataclass(frozen=True)
class _Ref:
    """A named value inside the model's output structure, filled in when the last stage runs."""

    name: str


def move(value: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (nested) value to ``device``; other objects pass through."""
    if isinstance(value, Tensor):
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
                 result: Any = None, result_spec: pytree.TreeSpec | None = None,
                 buffers: Sequence[tuple[str, nn.Module, str]] = ()):
        super().__init__()
        # (attribute path in ``module``, the model's module holding that buffer, its name there): moving the
        # stage replaces buffer tensors, and the model must keep seeing the ones the stage updates
        self._model_buffers = list(buffers)
        self._result_spec = result_spec  # rebuilds the model's output object from flat values (torch.export)
        self.module = module
        self.index = index
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        # the model's output structure for the last stage, its values named by _Ref
        self._result = None if result is None else fx.node.map_arg(result, lambda n: _Ref(n.name))
        # split_module renames nodes inside a submodule; their meta keeps the original name
        self._sub_inputs = tuple(n.meta[SOURCE_NAME] for n in module.graph.nodes if n.op == "placeholder")
        out = next(n for n in module.graph.nodes if n.op == "output").args[0]
        self._sub_outputs = tuple(a.meta[SOURCE_NAME] for a in out) if isinstance(out, (tuple, list)) \
            else (out.meta[SOURCE_NAME],)
        self._single = not isinstance(out, (tuple, list))

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Stage:
        super()._apply(fn, *args, **kwargs)
        for path, owner, name in self._model_buffers:
            owner._buffers[name] = self.module.get_buffer(path)
        return self

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
            result = fx.node.map_aggregate(self._result, lambda v: env[v.name] if isinstance(v, _Ref) else v)
            return result if self._result_spec is None else pytree.tree_unflatten(list(result), self._result_spec)
        return tuple(env[n] for n in self.outputs)


@dataclass(frozen=True)
class Inputs:
    """Turns a call with the model's own signature into stage 0's inputs, in the traced graph's order."""

    model: str
    """Class name of the model, for error messages."""
    signature: inspect.Signature
    """The model's ``forward`` signature."""
    names: tuple[str, ...]
    """The graph's placeholders: the arguments stage 0 takes, in order."""
    fixed: dict[str, Any]
    """Arguments traced at their default value (constants in the graph): a call must not change them."""

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The model inputs in stage 0's order, from a call with the model's own signature.

        An argument captured as a constant may be left out (it keeps its captured value) or passed with that
        same value; another value is an error, as the stages cannot compute it.
        """
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.model}: {e}") from None
        for name, value in bound.arguments.items():
            if name in self.fixed and not _same(value, self.fixed[name]):
                raise TypeError(f"{self.model} was compiled with {name}={self.fixed[name]!r}, a constant of the "
                                f"captured graph, and is called with {name}={value!r}; compile again with "
                                f"{name}={value!r} in example_kwargs (or a tensor there, to make it an input)")
        missing = [n for n in self.names if n not in bound.arguments]
        if missing:
            raise TypeError(f"{self.model} was compiled with {', '.join(missing)} as input(s) of the graph, but "
                            f"the call does not pass {'it' if len(missing) == 1 else 'them'}; pass "
                            f"{', '.join(missing)}, or compile without {'it' if len(missing) == 1 else 'them'}")
        return tuple(bound.arguments[n] for n in self.names)


def _same(a: Any, b: Any) -> bool:
    """Whether a call's argument equals the constant it was captured as (tensors are never constants)."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - objects whose == does not give a truth value
        return False


@dataclass(frozen=True, eq=False)
class Lowered:
    """The modules a plan trains, each on its device; they hold the model's own parameter objects.

    A ``ppll`` plan has one module per stage and an auxiliary head for every stage but the last. A
    ``pipebd`` plan has one student module per distillation block (``plan.blocks``), the frozen teacher
    block it learns from, and its loss ``fn(student_out, teacher_out)``; its heads are all ``None``.
    """

    modules: tuple[Stage, ...]
    """Per stage (``ppll``) or per block (``pipebd``): the trained backbone module."""
    heads: tuple[nn.Module | None, ...]
    """Per module: its auxiliary head, ``None`` where the model's own output is trained on."""
    devices: tuple[torch.device, ...]
    """Per module: the device it is placed on."""
    inputs: Inputs
    """Binds a call with the model's signature to the first module's inputs."""
    teacher: tuple[Stage, ...] = ()
    """``pipebd``: per block, the frozen teacher block."""
    losses: tuple[Callable[[Tensor, Tensor], Tensor], ...] = ()
    """``pipebd``: per block, the distillation loss."""

    @property
    def carries_input(self) -> bool:
        """Whether a head reconstructs the model's raw input (InfoPro), so messages carry it."""
        return any(getattr(h, "needs_input", False) for h in self.heads)

    def mirrors(self, index: int) -> list[nn.Parameter]:
        """The parameters of stage ``index + 1`` that stage ``index``'s momentum head follows by EMA, in the order of
        its ``pull``: what stage ``index + 1`` publishes every ``head.every`` steps; empty for any other head."""
        head = self.heads[index] if 0 <= index < len(self.heads) else None
        names = getattr(head, "mirrors", None)
        if not names:
            return []
        params = dict(self.modules[index + 1].named_parameters())
        return [params[n] for n in names]

    def stage_parameters(self, stage: StagePlan) -> list[nn.Parameter]:
        """Parameters ``stage`` trains: its modules' (every block of a ``pipebd`` stage) and its head's (a momentum
        head's EMA trunk is buffers, so not among them)."""
        own = stage.blocks or (stage.index,)
        return [p for k in own for m in (self.modules[k], self.heads[k]) if m is not None for p in m.parameters()]

    def train(self, mode: bool = True) -> None:
        """Set the train/eval mode of every trained module and head (a teacher stays in eval mode)."""
        for m in (*self.modules, *self.heads):
            if m is not None:
                m.train(mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the modules in order, each on its device: the model's own output (in eval mode)."""
        values: Any = self.inputs.bind(*args, **kwargs)
        check_real_batch(values)
        for i, (module, device) in enumerate(zip(self.modules, self.devices)):
            check_materialized(i, module, None)
            values = module(*move(values, device))
        return values

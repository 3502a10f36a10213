"""What lowering hands the runtime: stage modules, heads, Pipe-BD's teacher blocks and losses, and the input binder."""

from __future__ import annotations

import bisect
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

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


RNG_LOCK = threading.RLock()
"""Held while a checkpointed segment's recompute replays the random numbers its forward drew (torch's default
generators are process-wide): the lock that every seeded training forward holds too
(:data:`ppll_compile.runtime.rng.RNG_LOCK`)."""


@dataclass(frozen=True)
class _Part:
    """One checkpointed segment of a block: the code of its nodes, what it reads from before it, what it gives on."""

    run: Callable[..., tuple[Any, ...]]
    """``run(block_module, *inputs)``: the segment's nodes, reading the block's own attributes when called."""
    inputs: tuple[fx.Node, ...]
    """Nodes of the block's graph (placeholders or earlier segments') whose values it reads."""
    outputs: tuple[fx.Node, ...]
    """Its nodes whose values a later segment or the block's output reads."""


@dataclass(frozen=True)
class Segments:
    """A block's graph cut into segments for activation checkpointing, run by :func:`run_checkpointed`."""

    parts: tuple[_Part, ...]
    """The segments in graph order."""
    placeholders: tuple[fx.Node, ...]
    """The block's inputs."""
    result: Any
    """The block's output structure (of its graph's nodes)."""


def segments_of(gm: fx.GraphModule, ends: Sequence[str]) -> Segments:
    """``gm``'s graph cut after each node named ``ends`` (names in the traced model, as :data:`SOURCE_NAME` keeps
    them): per segment, Python code over its nodes that reads the block's parameters, buffers and submodules when
    it runs (so moving or materialising the block never leaves a segment holding old tensors)."""
    nodes = list(gm.graph.nodes)
    by_source = {n.meta.get(SOURCE_NAME, n.name): i for i, n in enumerate(nodes)}
    missing = [e for e in ends if e not in by_source]
    if missing:
        raise ValueError(f"checkpoints {missing} are not nodes of this stage: a plan's stages[j].checkpoints name "
                         f"legal cuts inside stage j (re-create the plan, or correct them)")
    positions = sorted(by_source[e] for e in ends)
    body = [(i, n) for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output")]
    groups: list[list[fx.Node]] = [[] for _ in range(len(positions) + 1)]
    for i, n in body:
        groups[bisect.bisect_left(positions, i)].append(n)
    output = nodes[-1]
    parts = tuple(_part(g, groups[k + 1:], output) for k, g in enumerate(groups) if g)
    return Segments(parts=parts, placeholders=tuple(n for n in nodes if n.op == "placeholder"),
                    result=output.args[0])


def _part(group: list[fx.Node], later: list[list[fx.Node]], output: fx.Node) -> _Part:
    """The segment of ``group``'s nodes, as Python code over the block's attributes (``self`` is the block)."""
    inside, after = set(group), {n for g in later for n in g} | {output}
    inputs = list(dict.fromkeys(u for n in group for u in n.all_input_nodes if u not in inside and u.op != "get_attr"))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {u: graph.placeholder(u.name) for u in inputs}
    for n in group:
        for u in n.all_input_nodes:
            if u not in env:  # a parameter or buffer read by attribute: read from the block when the segment runs
                env[u] = graph.get_attr(u.target)
        env[n] = graph.node_copy(n, lambda x: env[x])
    outputs = tuple(n for n in group if any(user in after for user in n.users))
    graph.output(tuple(env[o] for o in outputs))
    code = graph.python_code(root_module="self")
    scope = dict(code.globals)
    exec(compile(code.src, f"<checkpointed segment of {len(group)} nodes>", "exec"), scope)  # noqa: S102
    return _Part(run=scope["forward"], inputs=tuple(inputs), outputs=outputs)


def run_checkpointed(gm: fx.GraphModule, segments: Segments, args: Sequence[Any]) -> Any:
    """``gm(*args)``, each segment under ``torch.utils.checkpoint`` (not re-entrant): it keeps its inputs instead of
    its activations and recomputes them in backward, drawing the random numbers (dropout) its forward drew."""
    env: dict[fx.Node, Any] = dict(zip(segments.placeholders, args))
    for part in segments.parts:
        out = checkpoint(_replaying(part.run, gm), *(env[u] for u in part.inputs), use_reentrant=False,
                         preserve_rng_state=False)
        env.update(zip(part.outputs, out))
    return fx.node.map_arg(segments.result, lambda n: env[n])


def _replaying(run: Callable[..., Any], gm: fx.GraphModule) -> Callable[..., Any]:
    """``run(gm, *inputs)`` that, called again (the recompute in backward), draws what the first call drew and
    updates no buffer twice: the default generators (the CPU's and the inputs' CUDA device's) are set to their
    states before that call, under :data:`RNG_LOCK`, and restored after (a first call that drew nothing replays
    plainly); every buffer of ``gm`` gets back the value it had before the recompute, so what the forward updates in
    place (batch norm's running statistics; the kernels do not always count such updates) is updated once."""
    before: list[torch.Tensor] | None = None
    drew = False

    def call(*inputs: Any) -> Any:
        nonlocal before, drew
        gens = _generators(inputs)
        if before is None:
            before = [g.get_state() for g in gens]
            out = run(gm, *inputs)
            drew = any(not torch.equal(g.get_state(), b) for g, b in zip(gens, before))
            return out
        kept = [(b, b.clone()) for b in gm.buffers()]
        try:
            return _recompute(run, gm, inputs, gens, before if drew else None)
        finally:
            with torch.no_grad():
                for b, k in kept:
                    b.copy_(k)
    return call


def _recompute(run: Callable[..., Any], gm: fx.GraphModule, inputs: Sequence[Any], gens: list[torch.Generator],
               before: list[torch.Tensor] | None) -> Any:
    """``run(gm, *inputs)`` again, the generators ``gens`` first set to the states ``before`` the first call
    (``None``: it drew nothing) under :data:`RNG_LOCK`, and restored after."""
    if before is None:
        return run(gm, *inputs)
    with RNG_LOCK:
        now = [g.get_state() for g in gens]
        try:
            for g, state in zip(gens, before):
                g.set_state(state)
            return run(gm, *inputs)
        finally:
            for g, state in zip(gens, now):
                g.set_state(state)


def _generators(values: Sequence[Any]) -> list[torch.Generator]:
    """torch's default CPU generator, and that of the CUDA device of the first CUDA tensor among ``values``."""
    cuda = next((v.device for v in values if isinstance(v, Tensor) and v.is_cuda), None)
    if cuda is None:
        return [torch.default_generator]
    return [torch.default_generator, torch.cuda.default_generators[cuda.index or torch.cuda.current_device()]]


class Stage(nn.Module):
    """One pipeline stage: a submodule made by split_module, plus the names of the values it takes and sends.

    ``forward(*inputs)`` takes the previous stage's boundary values (the model's inputs for stage 0) in the
    order of ``inputs`` and returns the tuple of ``outputs`` (the boundary, main tensor first); the last
    stage returns the model's own output structure instead.
    """

    def __init__(self, module: fx.GraphModule, *, index: int, inputs: Sequence[str], outputs: Sequence[str],
                 result: Any = None, result_spec: pytree.TreeSpec | None = None,
                 buffers: Sequence[tuple[str, nn.Module, str]] = (), checkpoints: Sequence[str] | None = None):
        super().__init__()
        # activation checkpointing: the block's segments, split after the nodes ``checkpoints`` names (None: off)
        self._segments = None if checkpoints is None else segments_of(module, checkpoints)
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

    @property
    def checkpointed(self) -> int:
        """How many segments backward recomputes one by one (activation checkpointing); 0: none, the block keeps
        its activations from its forward."""
        return 0 if self._segments is None else len(self._segments.parts)

    def forward(self, *values: Any) -> Any:
        if len(values) != len(self.inputs):
            raise TypeError(f"stage {self.index} takes {len(self.inputs)} value(s) {list(self.inputs)}, "
                            f"got {len(values)}")
        env = dict(zip(self.inputs, values))
        args = [env[n] for n in self._sub_inputs]
        out = self.module(*args) if self._segments is None or not torch.is_grad_enabled() else \
            run_checkpointed(self.module, self._segments, args)
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

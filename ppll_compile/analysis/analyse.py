"""The traced, measured model with its legal cuts: the one object both plan kinds read."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from ..capture.frontends import capture
from ..capture.trace import module_path
from ..cost.nodes import META_KEY, measure_graph
from ..cost.optimizers import OPTIMIZER_STATES
from ..cost.reprice import reprice
from ..cost.roofline import Op
from ..errors import CutError, PlanError
from ..options import PlanOptions
from ..phases import phase
from ..plans.plan import TensorSpec
from ..plans.precision import precision_spec
from .batch_cuts import batch_folded
from .cuts import Cut, legal_cuts
from .layout import layout_of

INFERRED_BATCH = 32
"""Batch size of an inferred example input (override with ``batch_size=``)."""


@dataclass(frozen=True, kw_only=True)
class Summary:
    """FLOPs and memory of a run of nodes, shared parameters and saved storages counted once."""

    flops_fwd: int
    """Forward FLOPs."""
    flops_bwd: int
    """Backward FLOPs."""
    param_count: int
    """Parameters used."""
    param_bytes: int
    """Bytes of those parameters."""
    grad_bytes: int
    """Bytes of the gradients of the trainable ones."""
    optim_bytes: int
    """Bytes of their optimizer state."""
    activation_bytes: int
    """Bytes saved for backward."""

    @property
    def memory(self) -> int:
        """Parameters, gradients, optimizer state and saved activations, in bytes."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_bytes

    def fields(self) -> dict[str, int]:
        """The figures as keyword arguments of a :class:`~ppll_compile.plans.plan.StagePlan`."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Analysis:
    """A traced model measured node by node, with its legal cuts; segment ``i`` ends at cut ``i``.

    Not changed once made: a step that drops cuts returns a new analysis (:meth:`keep_cuts`)."""

    gm: fx.GraphModule
    """The traced model; every node carries its :class:`~ppll_compile.cost.nodes.NodeCost` in ``meta``."""
    nodes: list[fx.Node]
    """The graph's nodes in order (the output node last)."""
    cuts: list[Cut]
    """The legal cuts in graph order."""
    inputs: tuple[TensorSpec, ...]
    """The graph's inputs at the planned batch size."""
    real_inputs: tuple[Any, ...]
    """The example values of those inputs."""
    fixed_args: dict[str, Any]
    """Arguments of ``forward`` captured as constants (their default, or a given Python value)."""
    num_classes: int
    """Classes the auxiliary heads predict."""
    param_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of every parameter by qualified name."""
    trainable: set[str] = field(default_factory=set)
    """Names of the parameters that require gradients."""
    tracer: str = "fx"
    """The front end that captured the graph: ``fx`` or ``export``."""
    notes: tuple[str, ...] = ()
    """What the plan should tell the user about the capture and the cuts."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Legal cuts taken out of :attr:`cuts` (node name -> why), so that naming one gets the reason."""

    def segment_nodes(self, first: int, last: int) -> list[fx.Node]:
        """Nodes of atomic segments ``first..last`` (inclusive), excluding the output node."""
        lo = self.cuts[first - 1].position + 1 if first > 0 else 0
        hi = self.cuts[last].position + 1 if last < len(self.cuts) else len(self.nodes) - 1
        return self.nodes[lo:hi]

    def backward_kinds(self, nodes: Sequence[fx.Node], detached: bool = True) -> dict[str, str]:
        """Per node of a stage made of ``nodes``: the backward it runs in training, ``full`` (its inputs' gradients
        too), ``params`` (only its parameters': nothing before it in the stage needs a gradient) or ``none`` (no
        gradient reaches it). ``detached``: the stage's inputs arrive detached, as every stage's do; else values
        from outside ``nodes`` need a gradient where the whole model's do (a segment inside a larger stage)."""
        inside = {n.name for n in nodes}
        grad: dict[str, bool] = {}
        kinds: dict[str, str] = {}
        for n in nodes:
            if n.op in ("get_attr", "placeholder"):
                continue
            inputs = [u for u in n.all_input_nodes if u.op != "get_attr"]
            flowing = any(grad.get(u.name, False) if u.name in inside else not detached and u.meta[META_KEY].grad
                          for u in inputs)
            trains = self.trains([n])
            grad[n.name] = flowing or trains and n.meta[META_KEY].grad
            kinds[n.name] = "full" if flowing and n.meta[META_KEY].grad else "params" if grad[n.name] else "none"
        return kinds

    def summary(self, nodes: Sequence[fx.Node], optimizer: str, detached: bool = True) -> Summary:
        """FLOPs and memory of a stage made of ``nodes``, counting shared parameters and saved storages once; a
        parameter read by a ``get_attr`` node counts with the nodes that use it, as lowering puts it into their
        stage. The stage's input arrives detached (``detached``): no node computes its gradient, and nodes no
        gradient reaches save nothing (see :meth:`backward_kinds`)."""
        params: dict[str, int] = {}
        saved: dict[str, int] = {}
        fwd = bwd = 0
        kinds = self.backward_kinds(nodes, detached)
        for n in nodes:
            if n.op == "get_attr":
                continue  # a parameter read by attribute counts where it is used (see below)
            c = n.meta[META_KEY]
            kind = kinds.get(n.name, "none")
            fwd += c.flops_fwd
            bwd += c.flops_bwd if kind == "full" else c.flops_bwd_params if kind == "params" else 0
            params.update(c.params)
            for attr in n.all_input_nodes:
                if attr.op == "get_attr":
                    params.update(attr.meta[META_KEY].params)
            for k, b in c.saved.items() if kind != "none" else ():
                saved[k] = max(saved.get(k, 0), b)
        pbytes = sum(self.param_bytes[p] for p in params)
        gbytes = sum(self.param_bytes[p] for p in params if p in self.trainable)
        return Summary(flops_fwd=fwd, flops_bwd=bwd, param_count=sum(params.values()), param_bytes=pbytes,
                       grad_bytes=gbytes, optim_bytes=gbytes * OPTIMIZER_STATES[optimizer],
                       activation_bytes=sum(saved.values()))

    def ops(self, nodes: Sequence[fx.Node], detached: bool = True) -> list[Op]:
        """Every operator a training step of a stage made of ``nodes`` runs: their forwards, and their backwards as
        :meth:`backward_kinds` tells (the optimizer step is not included)."""
        kinds = self.backward_kinds(nodes, detached)
        out: list[Op] = []
        for n in nodes:
            c = n.meta[META_KEY]
            kind = kinds.get(n.name, "none")
            out += c.ops_fwd
            out += c.ops_bwd if kind == "full" else c.ops_bwd_params if kind == "params" else ()
        return out

    @staticmethod
    def forward_ops(nodes: Sequence[fx.Node]) -> list[Op]:
        """Every operator of a forward pass of ``nodes`` (a frozen teacher's)."""
        return [op for n in nodes for op in n.meta[META_KEY].ops_fwd]

    def trained_param_bytes(self, nodes: Sequence[fx.Node]) -> list[int]:
        """Bytes of every trainable parameter tensor ``nodes`` use (each once): what their optimizer step updates."""
        names: dict[str, None] = {}
        for n in nodes:
            for m in (n, *(a for a in n.all_input_nodes if a.op == "get_attr")):
                names.update(dict.fromkeys(p for p in m.meta[META_KEY].params if p in self.trainable))
        return [self.param_bytes[p] for p in names]

    def saves(self, nodes: Sequence[fx.Node], name: str) -> bool:
        """Whether a stage made of ``nodes`` saves the output of node ``name`` for its backward."""
        key = self.by_name[name].meta[META_KEY].storage
        kinds = self.backward_kinds(nodes)
        return isinstance(key, str) and any(key in n.meta[META_KEY].saved for n in nodes
                                            if kinds.get(n.name, "none") != "none")

    def trains(self, nodes: Sequence[fx.Node]) -> bool:
        """Whether any of ``nodes`` uses a trainable parameter (directly, or read by attribute)."""
        return any(p in self.trainable for n in nodes
                   for m in (n, *(a for a in n.all_input_nodes if a.op == "get_attr"))
                   for p in m.meta[META_KEY].params)

    @functools.cached_property
    def by_name(self) -> dict[str, fx.Node]:
        """Every node by its name."""
        return {n.name: n for n in self.nodes}

    def boundary(self, cut: Cut) -> tuple[TensorSpec, ...]:
        """The values that cross ``cut``, main tensor first; a 4-D main tensor's layout is read off the graph."""
        specs = [dataclasses.replace(self.by_name[name].meta[META_KEY].value, name=name) for name in cut.boundary]
        if len(specs[0].shape) == 4:
            specs[0] = dataclasses.replace(specs[0], layout=layout_of(self.by_name[cut.node], self.gm))
        return tuple(specs)

    @functools.cached_property
    def per_token(self) -> bool:
        """Whether the labels are per token: the model's output is ``N x L x C`` scores (a language model,
        token classification), so every head gives per-token scores."""
        out = self.output_spec()
        return out is not None and len(out.shape) == 3 and out.dtype not in ("int64", "int32", "bool")

    def keep_cuts(self, reason: Callable[[Cut], str | None], summary: str) -> Analysis:
        """This analysis without the cuts for which ``reason`` gives a reason (``None`` keeps the cut); a note
        counts them."""
        kept, dropped = [], {}
        for c in self.cuts:
            why = reason(c)
            if why is None:
                kept.append(c)
            else:
                dropped[c.node] = why
        if not dropped:
            return self
        note = f"{len(dropped)} of {len(self.cuts)} legal cuts dropped: {summary} ({_reasons(dropped)})"
        return dataclasses.replace(self, cuts=kept, dropped={**self.dropped, **dropped}, notes=(*self.notes, note))

    def shared_parameters(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """Parameters that nodes at different places use (a module called at two depths, tied weights): per
        tensor, its first and last use in graph order and every name it goes by."""
        ident = {name: id(p) for name, p in self.gm.named_parameters(remove_duplicate=False)}
        order = {n: i for i, n in enumerate(self.nodes)}
        uses: dict[Any, list[int]] = {}
        names: dict[Any, set[str]] = {}
        for i, n in enumerate(self.nodes):
            cost = n.meta.get(META_KEY)
            at = [order[u] for u in n.users] if n.op == "get_attr" else [i]  # a parameter read where it is used
            for name in (cost.params if cost is not None else ()):
                key = ident.get(name, name)
                uses.setdefault(key, []).extend(at)
                names.setdefault(key, set()).add(name)
        return [(min(u), max(u), tuple(sorted(names[k]))) for k, u in uses.items() if u and min(u) != max(u)]

    def shared_across(self, cuts: Sequence[Cut]) -> list[str]:
        """The parameters used on both sides of any of ``cuts``, in graph order of first use: per tensor, its names
        joined by `` = ``."""
        return _crossing(self.shared_parameters(), cuts)

    def drop_shared_cuts(self) -> Analysis:
        """This analysis without the cuts that would put one parameter into two stages (``tied='error'``)."""
        spans = self.shared_parameters()

        def reason(cut: Cut) -> str | None:
            crossing = _crossing(spans, [cut])
            return (f"parameter {crossing[0]} is used on both sides of it; pass tied='untie' to give each later "
                    f"stage its own copy") if crossing else None

        return self.keep_cuts(reason, "parameters used on both sides")

    def drop_untrained_cuts(self) -> Analysis:
        """This analysis without the cuts that leave the stage before or after them nothing to train (only
        parameter-free layers, such as a final flatten)."""
        trained = [i for i, n in enumerate(self.nodes) if n.op not in ("get_attr", "output") and self.trains([n])]
        if not trained:
            return self
        first, last = trained[0], trained[-1]
        return self.keep_cuts(lambda c: None if first <= c.position < last else "no parameter to train on one side",
                       "a stage would have nothing to train")

    def dropped_summary(self) -> str:
        """Why cuts were dropped, for an error that finds too few of them ('' when none were)."""
        return f"; {len(self.dropped)} candidate cut(s) were dropped ({_reasons(self.dropped)})" if self.dropped else ""

    def output_spec(self) -> TensorSpec | None:
        """The model's output when it is one tensor (or, captured by ``torch.export``, its first tensor: the
        logits of a Hugging Face output), else ``None``."""
        arg = self.nodes[-1].args[0]
        if self.tracer == "export" and isinstance(arg, (tuple, list)) and arg:
            arg = _first_scores(arg)
        if isinstance(arg, fx.Node):
            value = arg.meta[META_KEY].value
            return value if isinstance(value, TensorSpec) else None
        return None

    def cut_index(self, name: str) -> int:
        """Index into :attr:`cuts` of a cut given as a node name or a module name."""
        legal = {c.node: i for i, c in enumerate(self.cuts)}
        if name in legal:
            return legal[name]
        if name in self.dropped:
            raise CutError(f"cannot cut after {name!r}: {self.dropped[name]}; nearest usable cuts: "
                           f"{self._nearest_cuts(name)}")
        node = next((n for n in self.nodes if n.op == "call_module" and n.target == name), None)
        if node is None:
            inside = [n for n in self.nodes if module_path(n) == name or module_path(n).startswith(name + ".")]
            node = inside[-1] if inside else None
        if node is not None and node.name in legal:
            return legal[node.name]
        if node is not None and node.name in self.dropped:
            raise CutError(f"cannot cut after {name!r} (node {node.name!r}): {self.dropped[node.name]}; nearest "
                           f"usable cuts: {self._nearest_cuts(node.name)}")
        if node is None and name not in self.by_name:
            close = difflib.get_close_matches(name, [n.name for n in self.nodes] + [c.node for c in self.cuts], n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise CutError(f"{name!r} is neither a node nor a module of the traced model{hint}; "
                           f"legal cuts include {self._nearest_cuts(name)}")
        target = node.name if node is not None else name
        raise CutError(f"cannot cut after {name!r}: its output does not carry everything later layers need "
                       f"(a skip connection or other value crosses it); nearest legal cuts: "
                       f"{self._nearest_cuts(target)}")

    def check_saved_cuts(self, names: Sequence[str], source: str) -> None:
        """A saved plan's cuts (the ``last_node`` of every stage but the last) must name distinct cuts in graph
        order; errors name ``source``, the plan file."""
        try:
            at = [self.cut_index(c) for c in names]
        except CutError as e:
            raise CutError(f"{source}: {e}") from None
        for i in range(1, len(at)):
            if at[i] == at[i - 1]:
                raise PlanError(f"{source}: stages[{i - 1}] and stages[{i}] end at the same cut ({names[i - 1]!r}, "
                                f"{names[i]!r}); delete the duplicated stage, or move its last_node")
            if at[i] < at[i - 1]:
                raise PlanError(f"{source}: stages[{i}] ends at {names[i]!r}, which comes before {names[i - 1]!r} "
                                f"where stages[{i - 1}] ends; the stages must follow the model's order: swap their "
                                f"last_node values (and head configs), or re-create the plan")

    def _nearest_cuts(self, name: str) -> str:
        pos = next((i for i, n in enumerate(self.nodes) if n.name == name), None)
        if pos is None:
            return ", ".join(repr(c.node) for c in self.cuts[:6]) + (" ..." if len(self.cuts) > 6 else "")
        before = [c.node for c in self.cuts if c.position < pos][-1:]
        after = [c.node for c in self.cuts if c.position > pos][:1]
        return " or ".join(repr(c) for c in before + after) or "none"


def _first_scores(values: Sequence[Any]) -> Any:
    """The first of a flattened output's values that is not a 0-D tensor: a Hugging Face output given ``labels``
    starts with its own scalar loss, and the logits (what heads and the default loss read) follow it."""
    for v in values:
        spec = v.meta[META_KEY].value if isinstance(v, fx.Node) else None
        if not (isinstance(spec, TensorSpec) and len(spec.shape) == 0):
            return v
    return values[0]


def _crossing(spans: list[tuple[int, int, tuple[str, ...]]], cuts: Sequence[Cut]) -> list[str]:
    """Of the shared parameters ``spans`` (first use, last use, names), those used on both sides of any of ``cuts``,
    in graph order of first use: per tensor, its names joined by `` = ``."""
    return [" = ".join(names) for lo, hi, names in sorted(spans, key=lambda s: s[:2])
            if any(lo <= c.position < hi for c in cuts)]


def _reasons(dropped: dict[str, str]) -> str:
    """The distinct reasons cuts were dropped for, the first three."""
    whys = sorted(set(dropped.values()))
    return "; ".join(whys[:3]) + (" ..." if len(whys) > 3 else "")


def _infer_inputs(model: nn.Module) -> tuple[Tensor, ...]:
    """An example input for models whose first layer tells the input shape (e.g. torchvision classifiers)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            return (torch.randn(INFERRED_BATCH, m.in_channels, 224, 224),)
        if isinstance(m, nn.Linear):
            return (torch.randn(INFERRED_BATCH, m.in_features),)
        if isinstance(m, (nn.Conv1d, nn.Conv3d, nn.Embedding, nn.RNNBase, nn.MultiheadAttention)):
            break
    raise ValueError(f"cannot infer an input shape for {type(model).__name__}; pass example_inputs=(x,) "
                     "with a batch of real inputs (only their shapes and dtypes are used for planning)")


def _at_batch(x: Any, batch: int) -> Any:
    """Repeat (or trim) a tensor's first dimension to ``batch`` rows; other values pass through."""
    if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] == batch:
        return x
    return x[torch.arange(batch) % x.shape[0]]


def _inputs_from_specs(specs: Sequence[TensorSpec]) -> tuple[Tensor, ...]:
    out = []
    for s in specs:
        dtype = getattr(torch, s.dtype)
        out.append(torch.randn(s.shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(s.shape, dtype=dtype))
    return tuple(out)


def _example(model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: dict[str, Any] | None,
             batch_size: int | None, planned: Sequence[TensorSpec] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example call at the planned batch size: given (one tensor stands for a 1-tuple), re-made from a saved
    plan's inputs, or inferred."""
    if isinstance(example_inputs, Tensor):
        example_inputs = (example_inputs,)
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"example_inputs must be a tuple of forward()'s positional arguments (or one tensor), got "
                        f"a {type(example_inputs).__name__}; pass e.g. example_inputs=(x,)")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a dict of forward()'s keyword arguments, got a "
                        f"{type(example_kwargs).__name__}")
    if example_inputs is None and not example_kwargs:
        example_inputs = _inputs_from_specs(planned) if planned else _infer_inputs(model)
    example_inputs = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    first = next((x for x in (*example_inputs, *kwargs.values()) if isinstance(x, Tensor) and x.dim() > 0), None)
    if first is None:
        raise ValueError("example_inputs must contain at least one tensor with a batch dimension: a pipeline "
                         "passes batches of tensors from stage to stage, so a model whose inputs are all Python "
                         "scalars (or 0-D tensors) cannot be split; give it a batched tensor input")
    empty = [tuple(x.shape) for x in (*example_inputs, *kwargs.values())
             if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == 0]
    if empty:
        raise ValueError(f"the example inputs hold a batch of 0 examples (shape {empty[0]}); give at least one "
                         f"example per tensor (only shapes and dtypes are used; batch_size=N sets the planned batch)")
    batch = batch_size or first.shape[0]
    try:
        return tuple(_at_batch(x, batch) for x in example_inputs), {k: _at_batch(v, batch) for k, v in kwargs.items()}
    except (RuntimeError, OverflowError) as e:  # no memory for tensors of that many rows
        raise ValueError(f"cannot make example inputs of batch_size={batch} on this machine "
                         f"({type(e).__name__}: {str(e).splitlines()[0]}); pass a smaller batch_size") from None


def _num_classes(model: nn.Module, out: TensorSpec | None, given: int | None, needed: bool) -> int:
    if given is not None:
        return given
    if out is not None and len(out.shape) in (2, 3):  # N x C, or N x L x C per token
        return out.shape[-1]
    if not needed:
        return 0
    raise ValueError(f"cannot infer the number of classes: {type(model).__name__} returns "
                     f"{'shape ' + str(list(out.shape)) if out else 'a structured output'}, "
                     "not N x classes (or N x tokens x classes) scores; pass num_classes=...")


def analyse(model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: dict[str, Any] | None,
            opts: PlanOptions, planned_inputs: Sequence[TensorSpec] | None = None, *,
            need_classes: bool = True) -> Analysis:
    """Trace ``model`` on its example call, measure every node on fake tensors and find the legal cuts.

    Without example inputs, they are made from ``planned_inputs`` (a saved plan's) or inferred from the
    model's first layer. ``need_classes``: the number of classes must be known (given, or read off N x C
    logits), as auxiliary heads predict them.
    """
    args, kwargs = _example(model, example_inputs, example_kwargs, opts.batch_size, planned_inputs)
    with phase("trace"):
        captured = capture(model, args, kwargs, tracer=opts.tracer, leaf_modules=opts.leaf_modules,
                           split_points=opts.split_points, bake_train_mode=opts.bake_train_mode)
    gm, real_inputs = captured.gm, captured.inputs
    with phase("cost"):
        measure_graph(gm, real_inputs)
    with phase("cuts"):
        cuts = legal_cuts(gm)
        cuts, folded, batch_notes = batch_folded(gm, cuts, real_inputs, model=type(model).__name__, opts=opts)
    precision = precision_spec(opts.precision)
    trainable = {k for k, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    with phase("cost"):
        reprice(gm, precision, opts.fused, trainable, {v for c in cuts for v in c.boundary})
    nodes = list(gm.graph.nodes)
    analysis = Analysis(
        gm=gm, nodes=nodes, cuts=cuts,
        inputs=tuple(dataclasses.replace(n.meta[META_KEY].value, name=n.name) for n in nodes
                     if n.op == "placeholder"),
        real_inputs=real_inputs, fixed_args=captured.fixed, num_classes=0, tracer=captured.tracer,
        notes=(*captured.notes, *batch_notes), dropped=folded,
        param_bytes={k: precision.param_bytes(p.numel(), p.element_size(), p.is_floating_point())
                     for k, p in gm.named_parameters(remove_duplicate=False)},
        trainable=trainable,
    )
    return dataclasses.replace(
        analysis, num_classes=_num_classes(model, analysis.output_spec(), opts.num_classes, need_classes))

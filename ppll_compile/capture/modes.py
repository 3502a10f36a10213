"""Keep train/eval behaviour switchable: merge a model's train-mode and eval-mode captures into one graph.

A capture (symbolic tracing or ``torch.export``) runs the model's Python once, so every ``self.training``
it reads is frozen into the graph. Capturing in both modes and lining the two graphs up node by node shows
exactly what the mode changes. Where only constant arguments differ (``dropout(x, p, training=True)`` vs
``False``, ``batch_norm(..., training)``, ``dropout_p=0.1`` vs ``0.0``), the node becomes a
:class:`TrainEval` module call that takes the train or eval arguments by its own ``training`` flag, which
``model.train()`` / ``model.eval()`` set on every stage. Nodes that only the train mode runs and whose result
nothing uses (BatchNorm's batch counter) run in train mode only; train-only copies that change no value
(a ``contiguous()``) pass their input through in eval mode; a call of one of the model's modules kept whole
(stochastic depth) that eval mode skips stays a call, the module following the mode itself. Anything else is a
*structural* difference (a branch on ``self.training`` that changes the computation); it is reported to the caller.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

SWITCH_PREFIX = "ppll_mode_"
"""Name prefix of the :class:`TrainEval` modules a merge adds to the graph module."""

_SKIP = None
_PASS = "pass"
"""The eval-mode call of a train-only copy (``contiguous``, ``clone``): its input, unchanged."""
_COPIES = ("contiguous", "clone", "alias")


@dataclass(frozen=True)
class _Slot:
    """Stands for the ``index``-th input value of a :class:`TrainEval` call in an argument template."""

    index: int


def _fill(template: Any, values: Sequence[Any]) -> Any:
    """``template`` with every :class:`_Slot` replaced by its input value."""
    return fx.node.map_aggregate(template, lambda v: values[v.index] if isinstance(v, _Slot) else v)


class TrainEval(nn.Module):
    """One captured operation whose constant arguments depend on the mode: it follows ``self.training``.

    ``train`` and ``eval`` are ``(args, kwargs)`` templates whose input values are :class:`_Slot` markers,
    or ``None`` where that mode does not run the operation at all (the call then returns ``None``), or
    ``"pass"`` where that mode skips a copy (the call returns its first input).
    """

    def __init__(self, op: str, target: Any, train: tuple[Any, Any] | None, eval: tuple[Any, Any] | None) -> None:
        super().__init__()
        self.op, self.target = op, target
        self.calls = {True: train, False: eval}

    def forward(self, *values: Any) -> Any:
        call = self.calls[self.training]
        if call is _SKIP:
            return None
        if call == _PASS:
            return values[0]
        args, kwargs = _fill(call[0], values), _fill(call[1], values)
        if self.op == "call_method":
            return getattr(args[0], self.target)(*args[1:], **kwargs)
        return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        name = getattr(self.target, "__name__", str(self.target))
        return f"{name}: train {self.calls[True]}, eval {self.calls[False]}"


@dataclass
class Merge:
    """What :func:`merge_modes` did: the nodes now switched by mode, and the structural differences left."""

    switched: list[str]
    """Names of the nodes that became :class:`TrainEval` calls."""
    structural: list[fx.Node]
    """Nodes of the train graph (or, for eval-only computation, of the eval graph) where the two modes
    compute differently; empty when the merged graph behaves like the model in both modes."""
    sources: list[fx.Node] = dataclasses.field(default_factory=list)
    """The structural nodes that only one mode runs: where the difference starts. The others merely read a
    value that differs (they are fine once the source is kept opaque)."""


def _key(n: fx.Node) -> tuple[str, str]:
    return n.op, str(n.target)


def _template(train_args: Any, eval_args: Any, pair: dict[fx.Node, fx.Node] | None, slots: dict[fx.Node, int]
              ) -> tuple[Any, Any, bool] | None:
    """Templates of a train and an eval argument structure, and whether a constant differs; ``None`` when the
    two structures differ in which values they read. ``pair`` maps eval nodes to the train nodes computing the
    same value in their mode (a train-only copy stands for the node it copies); ``None``: any value matches
    (both modes then read the train graph's values)."""
    if isinstance(train_args, fx.Node) or isinstance(eval_args, fx.Node):
        if not (isinstance(train_args, fx.Node) and isinstance(eval_args, fx.Node)) or pair is not None \
                and pair.get(eval_args) not in (train_args, pair.get(train_args, train_args)):
            return None
        slot = _Slot(slots.setdefault(train_args, len(slots)))
        return slot, slot, False
    if isinstance(train_args, slice) and isinstance(eval_args, slice):
        parts = _template((train_args.start, train_args.stop, train_args.step),
                          (eval_args.start, eval_args.stop, eval_args.step), pair, slots)
        return None if parts is None else (slice(*parts[0]), slice(*parts[1]), parts[2])
    if isinstance(train_args, (tuple, list)) and isinstance(eval_args, (tuple, list)):
        if len(train_args) != len(eval_args):
            return None
        parts = [_template(a, b, pair, slots) for a, b in zip(train_args, eval_args)]
        if any(p is None for p in parts):
            return None
        kind = tuple if isinstance(train_args, tuple) else list
        return (kind(p[0] for p in parts), kind(p[1] for p in parts),  # type: ignore[index]
                any(p[2] for p in parts))  # type: ignore[index]
    if isinstance(train_args, dict) and isinstance(eval_args, dict):
        if train_args.keys() != eval_args.keys():
            return None
        parts = {k: _template(train_args[k], eval_args[k], pair, slots) for k in train_args}
        if any(p is None for p in parts.values()):
            return None
        return ({k: p[0] for k, p in parts.items()}, {k: p[1] for k, p in parts.items()},  # type: ignore[index]
                any(p[2] for p in parts.values()))  # type: ignore[index]
    differs = type(train_args) is not type(eval_args) or train_args != eval_args
    return train_args, eval_args, bool(differs)


def _call(n: fx.Node) -> tuple[Any, Any]:
    """A node's ``(args, kwargs)``, with the positional defaults an ATen operator's schema leaves out filled
    in (``torch.export`` omits an argument at its default, e.g. ``dropout_p=0.0`` in eval mode only)."""
    args, kwargs = tuple(n.args), dict(n.kwargs)
    schema = getattr(n.target, "_schema", None) if isinstance(n.target, torch._ops.OpOverload) else None
    if schema is not None:
        for a in schema.arguments[len(args):]:
            if a.kwarg_only or a.name in kwargs or not a.has_default_value():
                break
            args += (a.default_value,)
    return args, kwargs


def _unused(block: Sequence[fx.Node]) -> bool:
    """Whether nothing outside ``block`` uses its results (side effects such as a buffer update)."""
    inside = set(block)
    return all(u in inside for n in block for u in n.users) and all(n.op in ("call_function", "call_method")
                                                                     for n in block)


def _copy(n: fx.Node) -> bool:
    """Whether ``n`` copies its one tensor input without changing a value."""
    name = str(getattr(n.target, "__name__", n.target)).split(".")[0]
    return n.op in ("call_function", "call_method") and name in _COPIES and len(n.all_input_nodes) == 1


def _eval_dropout(n: Any) -> bool:
    """``n`` is ``aten.dropout(x, p, False)``: an eval-mode dropout, which returns ``x`` itself."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is torch.ops.aten.dropout.default \
        and len(n.args) >= 3 and n.args[2] is False


def _unchain_eval_dropouts(eval: fx.GraphModule) -> None:
    """Let an eval-mode dropout that reads another's output read that one's input (the same tensor): ``torch.export``
    records a value that several dropouts each read (DeBERTa's relative embeddings, one ``pos_dropout`` per layer)
    as a chain in eval mode, where each dropout hands back the very tensor it was given."""
    for n in eval.graph.nodes:
        while _eval_dropout(n) and _eval_dropout(n.args[0]):
            n.args = (n.args[0].args[0], *n.args[1:])


def _opaque(n: fx.Node) -> bool:
    """Whether ``n`` calls one of the model's own modules kept whole, whose eval mode returns its first input."""
    return n.op == "call_module" and not str(n.target).startswith(SWITCH_PREFIX) and bool(n.all_input_nodes)


def _switch(gm: fx.GraphModule, node: fx.Node, train: tuple[Any, Any] | None, eval: tuple[Any, Any] | None,
            inputs: Sequence[fx.Node], index: int) -> None:
    """Turn ``node`` in place into a call of a new :class:`TrainEval` module (its name and meta are kept)."""
    name = f"{SWITCH_PREFIX}{index}"
    gm.add_submodule(name, TrainEval(node.op, node.target, train, eval))
    node.op, node.target = "call_module", name
    node.args, node.kwargs = tuple(inputs), {}


def merge_modes(train: fx.GraphModule, eval: fx.GraphModule, *, partial: bool = False) -> Merge:
    """Make ``train`` (a train-mode capture) follow the mode wherever ``eval`` (the same model captured in eval
    mode) differs only in constants or in unused side effects; report the other differences.

    The graphs are lined up by each node's operation and target (a longest-matching-blocks alignment), so
    nodes that only one mode runs do not shift the match of the rest. ``train`` is changed in place: not at
    all when a structural difference is found, unless ``partial`` (the structural parts then stay as train
    mode runs them, everything else follows the mode).
    """
    _unchain_eval_dropouts(eval)
    tn, en = list(train.graph.nodes), list(eval.graph.nodes)
    matcher = difflib.SequenceMatcher(None, [_key(n) for n in tn], [_key(n) for n in en], autojunk=False)
    pair: dict[fx.Node, fx.Node] = {}  # eval node -> train node
    changes: list[tuple[fx.Node, tuple[Any, Any] | None, tuple[Any, Any] | None, list[fx.Node]]] = []
    structural: list[fx.Node] = []
    sources: list[fx.Node] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for a, b in zip(tn[i1:i2], en[j1:j2]):
                pair[b] = a
                slots: dict[fx.Node, int] = {}
                t = _template(_call(a), _call(b), pair, slots)
                if t is None and partial:  # past a structural difference: the train graph's values, both modes
                    t = _template(_call(a), _call(b), None, slots := {})
                if t is None:
                    structural.append(a)
                elif t[2]:
                    if a.op not in ("call_function", "call_method"):
                        structural.append(a)
                        continue
                    changes.append((a, t[0], t[1], list(slots)))
        elif tag == "delete" and _unused(tn[i1:i2]):
            changes += [(a, (a.args, a.kwargs), _SKIP, []) for a in tn[i1:i2]]
        elif tag == "delete" and all(_opaque(a) for a in tn[i1:i2]):
            for a in tn[i1:i2]:  # a module kept whole that eval mode skips (a drop-path): it follows the mode itself
                pair[a] = a.all_input_nodes[0]
        elif tag == "delete" and all(_copy(a) for a in tn[i1:i2]):
            changes += [(a, (a.args, a.kwargs), _PASS, []) for a in tn[i1:i2]]
            for a in tn[i1:i2]:  # an eval node reading the copied value reads the copy in train mode
                pair[a] = a.all_input_nodes[0]
        else:
            sources += tn[i1:i2] or en[j1:j2]
    if (structural or sources) and not partial:
        return Merge(switched=[], structural=sources + structural, sources=sources)
    for i, (node, t, e, inputs) in enumerate(changes):
        if e is _SKIP or e == _PASS:  # a train-only node: its template reads its own input nodes directly
            slots = {}
            t = _template((node.args, node.kwargs), (node.args, node.kwargs), {n: n for n in node.all_input_nodes},
                          slots)[0]  # type: ignore[index]
            inputs = list(slots)
        _switch(train, node, t, e, inputs, i)
    if changes:
        train.graph.lint()
        train.recompile()
    return Merge(switched=[c[0].name for c in changes], structural=sources + structural, sources=sources)

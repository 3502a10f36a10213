"""Measured costs re-priced as a plan trains: in its precision, and with its element-wise chains fused."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch.fx as fx

from ..plans.precision import Precision
from ..plans.specs import TensorSpec
from .nodes import META_KEY, NodeCost
from .oplog import Op


def _cast_op(op: Op, dtype: str) -> Op:
    if op.dtype != "float32":
        return op
    return Op(op.kind, dtype, op.flops, op.kept + (op.bytes - op.kept) // 2, _cast_call(op.call, dtype), op.kept)


def _cast_call(value: Any, dtype: str) -> Any:
    """An :attr:`Op.call` with its float32 tensors in ``dtype`` (so a per-shape timing times the low precision)."""
    if isinstance(value, tuple) and len(value) == 4 and value[0] == "T":
        return ("T", value[1], value[2], dtype) if value[3] == "float32" else value
    if isinstance(value, tuple):
        return tuple(_cast_call(v, dtype) for v in value)
    return value


def _cast_value(value: Any, dtype: str) -> Any:
    if isinstance(value, TensorSpec):
        if value.dtype != "float32":
            return value
        return dataclasses.replace(value, dtype=dtype, bytes=value.bytes // 2)
    if isinstance(value, (tuple, list)):
        items = [_cast_value(v, dtype) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _cast_value(v, dtype) for k, v in value.items()}
    return value


def _autocast_ops(params: dict[str, int], trainable: set[str]) -> tuple[list[Op], list[Op]]:
    """Autocast's casts of the weights a node uses: forward (float32 -> low, 6 bytes per element) and backward (the
    gradient back to float32, 6 bytes per element, for trainable weights)."""
    fwd = [Op("memory", "float32", 0, 6 * n) for n in params.values()]
    bwd = [Op("memory", "float32", 0, 6 * n) for name, n in params.items() if name in trainable]
    return fwd, bwd


def _weights(n: fx.Node) -> dict[str, int]:
    """The parameters a computing node uses, its module's or read by attribute (name -> elements)."""
    if n.op in ("placeholder", "get_attr"):
        return {}
    out = dict(n.meta[META_KEY].params)
    for u in n.all_input_nodes:
        if u.op == "get_attr" and META_KEY in u.meta:
            out.update(u.meta[META_KEY].params)
    return out


def cast_costs(gm: fx.GraphModule, precision: Precision, trainable: Iterable[str]) -> None:
    """Re-price every measured node of ``gm`` (its :class:`~ppll_compile.cost.nodes.NodeCost`) in ``precision`` (see the
    module's text); float32 leaves everything as measured. The model's inputs keep their dtype under mixed
    precision (the user's data) and become the low dtype when pure; parameters read by attribute keep theirs under
    mixed precision."""
    if not precision.low:
        return
    dtype, trained = precision.dtype, set(trainable)
    for n in gm.graph.nodes:
        c: NodeCost | None = n.meta.get(META_KEY)
        if c is None or (n.op in ("placeholder", "get_attr") and not precision.pure):
            continue
        casts: tuple[list[Op], list[Op]] = ([], [])
        saved = {k: b // 2 if k in c.saved_float32 else b for k, b in c.saved.items()}
        weights = _weights(n)
        if not precision.pure and weights and any(op.dtype == "float32" for op in c.ops_fwd):
            casts = _autocast_ops(weights, trained)
            saved.update({f"{name}:{dtype}": 2 * count for name, count in weights.items()})
        cast = [_cast_op(op, dtype) for op in c.ops_fwd]
        n.meta[META_KEY] = dataclasses.replace(
            c, ops_fwd=(*casts[0], *cast), ops_bwd=(*(_cast_op(op, dtype) for op in c.ops_bwd), *casts[1]),
            ops_bwd_params=(*(_cast_op(op, dtype) for op in c.ops_bwd_params), *casts[1]),
            saved=saved, saved_float32=frozenset(), value=_cast_value(c.value, dtype))


FUSIBLE = ("memory", "math")
"""The operator families a fused kernel runs in one pass: element-wise arithmetic, copies and reductions
(``memory``), transcendental activations and softmax (``math``); what ``torch.compile``'s Inductor generates one
kernel for (pointwise operators and the reductions beside them)."""


def _fusible(n: fx.Node) -> bool:
    """A node whose forward runs only :data:`FUSIBLE` operators (or none: a view) and uses no parameter."""
    c = n.meta.get(META_KEY)
    return (n.op in ("call_function", "call_method", "call_module") and c is not None and not c.params
            and all(op.kind in FUSIBLE for op in c.ops_fwd))


def _bytes(value: Any) -> int:
    """Bytes of a (possibly structured) value's tensors."""
    if isinstance(value, TensorSpec):
        return value.bytes
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    return 0


def element_wise_chains(gm: fx.GraphModule, crossing: Iterable[str] = ()) -> list[list[fx.Node]]:
    """The element-wise chains of ``gm``, in graph order, each of two nodes or more: the connected sets of fusible
    nodes (:data:`FUSIBLE` operators only, no parameters) joined along the edges from a node to its users when every
    user of it is fusible and its output is not among ``crossing`` (the values that cross a legal cut). So a value
    inside a chain is read by the chain alone (a fused kernel keeps it in registers), no value a stage may send is
    inside one, and no chain spans a cut."""
    stop = set(crossing)
    parent: dict[fx.Node, fx.Node] = {}

    def root(n: fx.Node) -> fx.Node:
        while n in parent:
            n = parent[n]
        return n

    fusible = {n for n in gm.graph.nodes if _fusible(n)}
    for n in gm.graph.nodes:
        if n in fusible and n.users and n.name not in stop and all(u in fusible for u in n.users):
            for u in n.users:
                a, b = root(n), root(u)
                if a is not b:
                    parent[a] = b
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n in fusible:
            groups.setdefault(root(n), []).append(n)
    return [g for g in groups.values() if len(g) > 1]


def _fused(chain: list[fx.Node]) -> NodeCost:
    """The chain's last node's cost with the whole chain's work as one fused kernel per pass."""
    costs = [n.meta[META_KEY] for n in chain]
    inside = set(chain)
    inputs = {u for n in chain for u in n.all_input_nodes if u not in inside}
    read = sum(_bytes(u.meta[META_KEY].value) for u in inputs)
    grads = sum(_bytes(u.meta[META_KEY].value) for u in inputs if u.meta[META_KEY].grad)
    written = sum(_bytes(n.meta[META_KEY].value) for n in chain if not n.users or any(u not in inside for u in n.users))
    fwd = [op for c in costs for op in c.ops_fwd]
    bwd = [op for c in costs for op in c.ops_bwd]
    kind = "math" if any(op.kind == "math" for op in fwd + bwd) else "memory"
    dtype = next((op.dtype for op in fwd), "float32")

    def one(ops: list[Op], fused_bytes: int) -> tuple[Op, ...]:
        if not ops:
            return ()
        return (Op(kind, dtype, sum(op.flops for op in ops), min(sum(op.bytes for op in ops), fused_bytes)),)

    return dataclasses.replace(costs[-1], ops_fwd=one(fwd, read + written),
                               ops_bwd=one(bwd, read + written + grads))


def fuse_chains(gm: fx.GraphModule, crossing: Iterable[str] = ()) -> int:
    """Price every element-wise chain of ``gm`` (:func:`element_wise_chains`) as one fused kernel: its forward reads
    each input of the chain once and writes each of its outputs (a value read outside it) once; its backward reads
    those inputs and the outputs' gradients once and writes the gradients of the inputs that need one once; never
    more bytes than the operators one at a time (where they moved fewer, those). The work goes on the chain's last
    node (which every stage holding the chain holds, as no chain spans a cut); the other nodes of the chain cost
    nothing. Returns the number of chains."""
    chains = element_wise_chains(gm, crossing)
    for chain in chains:
        fused = _fused(chain)
        for n in chain[:-1]:
            n.meta[META_KEY] = dataclasses.replace(n.meta[META_KEY], ops_fwd=(), ops_bwd=(), ops_bwd_params=())
        chain[-1].meta[META_KEY] = fused
    return len(chains)


def reprice(gm: fx.GraphModule, precision: Precision, fusion: str, trainable: Iterable[str],
            crossing: Iterable[str]) -> None:
    """Re-price the measured nodes of ``gm`` as the plan trains: in ``precision`` (:func:`cast_costs`), then, with
    ``fusion="fused"``, its element-wise chains as fused kernels (:func:`fuse_chains`, no chain spanning a value of
    ``crossing``)."""
    cast_costs(gm, precision, trainable)
    if fusion == "fused":
        fuse_chains(gm, crossing)

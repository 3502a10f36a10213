"""Find the legal cut points of a traced graph: nodes whose output carries everything later nodes need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx
import torch.fx as fx

from .cost import META_KEY

__all__ = ["Cut", "legal_cuts", "live_values", "MAX_SIDE_VALUES"]

MAX_SIDE_VALUES = 2
"""At most this many side tensors (e.g. an attention mask) may travel with the main tensor across a cut."""

_SOURCE = "__ppll_source__"
_COMPUTE = ("call_module", "call_function", "call_method")


@dataclass(frozen=True)
class Cut:
    """A legal cut after ``node``: the stage before it sends ``boundary`` (main value first) to the next one."""

    node: str
    """Name of the node after which the graph is cut; its output is the main boundary tensor."""
    position: int
    """Index of ``node`` in graph order."""
    boundary: tuple[str, ...]
    """Every value produced up to the cut and used after it, ``node`` first."""


def _is_tensor_spec(node: fx.Node) -> bool:
    cost = node.meta.get(META_KEY)
    value = getattr(cost, "value", None)
    return value is not None and not isinstance(value, (tuple, list, dict)) and value.shape is not None \
        and value.dtype not in ("int", "float", "bool")


def live_values(nodes: Sequence[fx.Node], position: int) -> list[fx.Node]:
    """Values produced at or before ``position`` (graph order) that a later node (or the output) uses."""
    order = {n: i for i, n in enumerate(nodes)}
    return [n for n in nodes[:position + 1]
            if n.op != "get_attr" and any(order[u] > position for u in n.users)]


def _dominator_cuts(nodes: Sequence[fx.Node], side: set[fx.Node]) -> list[fx.Node]:
    """Nodes that dominate the output in the data-flow graph, with ``side`` values' edges left out."""
    g = nx.DiGraph()
    g.add_node(_SOURCE)
    output = nodes[-1]
    for n in nodes:
        if n.op == "get_attr":
            continue
        g.add_node(n)
        inputs = [a for a in n.all_input_nodes if a.op != "get_attr"]
        if n.op == "placeholder" or not inputs:
            g.add_edge(_SOURCE, n)
        for a in inputs:
            if a not in side:
                g.add_edge(a, n)
    idom = nx.immediate_dominators(g, _SOURCE)
    if output not in idom:
        return []
    chain = []
    v = idom[output]
    while v != _SOURCE:
        chain.append(v)
        v = idom[v]
    return chain[::-1]


def _valid(nodes: Sequence[fx.Node], order: dict[fx.Node, int], v: fx.Node) -> bool:
    """A dominator is a usable cut if it is a computed tensor with computation on both sides of it."""
    p = order[v]
    return (v.op in _COMPUTE and _is_tensor_spec(v)
            and any(n.op in _COMPUTE for n in nodes[p + 1:]))


def legal_cuts(gm: fx.GraphModule, *, max_side_values: int = MAX_SIDE_VALUES) -> list[Cut]:
    """The legal cuts of a measured GraphModule, in graph order.

    A cut after node ``v`` is legal when ``v`` dominates the output: every path from the inputs to the
    output passes through it, so its output carries everything the rest of the graph needs. Skip
    connections inside a residual block are therefore never cut; the boundaries between blocks are.
    Python scalars (sizes read off tensors) may cross a cut beside ``v``; so may up to ``max_side_values``
    side tensors (inputs or widely used values such as an attention mask) when leaving their edges out of
    the dominance test yields more cuts. Requires :func:`ppll_compile.cost.measure_graph` to have run.
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    side = {n for n in nodes if n.op in _COMPUTE and n.meta.get(META_KEY) is not None
            and not _is_tensor_spec(n) and not isinstance(n.meta[META_KEY].value, (tuple, list, dict))}
    side |= {n for n in nodes if n.op in _COMPUTE and not [a for a in n.all_input_nodes if a.op != "get_attr"]}

    def count(extra: set[fx.Node]) -> list[fx.Node]:
        return [v for v in _dominator_cuts(nodes, side | extra) if _valid(nodes, order, v)]

    best = count(set())
    candidates = [n for n in nodes if n.op != "get_attr" and n.op != "output" and n not in side
                  and (n.op == "placeholder" or len(n.users) >= 3) and _is_tensor_spec(n)]
    candidates.sort(key=lambda n: (-len(n.users), order[n]))
    chosen: set[fx.Node] = set()
    for c in candidates:
        if len(chosen) >= max_side_values:
            break
        trial = count(chosen | {c})
        if len(trial) > len(best):
            chosen.add(c)
            best = trial

    cuts = []
    for v in best:
        live = live_values(nodes, order[v])
        if any(n is not v and n not in side and n not in chosen for n in live):
            continue  # defensive: something besides side values crosses; never a legal cut
        rest = sorted((n for n in live if n is not v), key=lambda n: order[n])
        cuts.append(Cut(node=v.name, position=order[v], boundary=(v.name, *(n.name for n in rest))))
    return cuts

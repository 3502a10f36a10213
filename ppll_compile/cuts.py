"""Find the legal cut points of a traced graph: nodes whose output carries everything later nodes need."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx as fx

from .cost import META_KEY
from .plan import TensorSpec

MAX_SIDE_VALUES = 3
"""At most this many side tensors (an attention mask; a rotary embedding's cos and sin) may travel with the main
tensor across a cut."""
_GROUP_POOL = 6  # the most used candidates, tried in groups

_SOURCE = "__ppll_source__"
_COMPUTE = ("call_module", "call_function", "call_method")
_SCALARS = ("int", "float", "bool")  # TensorSpec dtypes of Python scalars


@dataclass(frozen=True)
class Cut:
    """A legal cut after ``node``: the stage before it sends ``boundary`` (main value first) to the next one."""

    node: str
    """Name of the node after which the graph is cut; its output is the main boundary tensor."""
    position: int
    """Index of ``node`` in graph order."""
    boundary: tuple[str, ...]
    """Every value produced up to the cut and used after it, ``node`` first."""


def _value(node: fx.Node) -> Any:
    cost = node.meta.get(META_KEY)
    return cost.value if cost is not None else None


def _is_tensor(node: fx.Node) -> bool:
    """The node's output is one tensor (not a Python scalar, a structure, or an unknown object; a ``bool``
    tensor such as a mask is a tensor)."""
    value = _value(node)
    return isinstance(value, TensorSpec) and not (value.dtype in _SCALARS and value.shape == () and value.bytes == 0)


def _live_sets(nodes: Sequence[fx.Node], positions: Sequence[int]) -> list[list[fx.Node]]:
    """For each position (ascending), the values produced up to it that a later node or the output uses."""
    order = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((order[u] for u in n.users), default=-1) for n in nodes if n.op != "get_attr"}
    live: dict[fx.Node, None] = {}
    result = []
    done = 0
    for p in positions:
        for n in nodes[done:p + 1]:
            if n in last_use:
                live[n] = None
        done = p + 1
        for n in [n for n in live if last_use[n] <= p]:
            del live[n]
        result.append(list(live))
    return result


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
    last_compute = max(i for i, n in enumerate(nodes) if n.op in _COMPUTE)
    # scalars and other non-tensor values, and values computed from no input at all, may cross any cut
    side = {n for n in nodes if n.op in _COMPUTE and not _is_tensor(n)
            and not isinstance(_value(n), (tuple, list, dict))}
    side |= {n for n in nodes if n.op in _COMPUTE and all(a.op == "get_attr" for a in n.all_input_nodes)}

    def count(extra: set[fx.Node]) -> list[fx.Node]:
        """Dominators that are computed tensors with computation on both sides of them, across which nothing
        but side values (and ``extra``) travels."""
        dominators = [v for v in _dominator_cuts(nodes, side | extra)
                      if v.op in _COMPUTE and _is_tensor(v) and order[v] < last_compute]
        lives = _live_sets(nodes, [order[v] for v in dominators])
        return [v for v, live in zip(dominators, lives) if all(n is v or n in side or n in extra for n in live)]

    best = count(set())
    candidates = [n for n in nodes if n.op != "get_attr" and n.op != "output" and n not in side
                  and (n.op == "placeholder" or len(n.users) >= 3) and _is_tensor(n)]
    candidates.sort(key=lambda n: (-len(n.users), order[n]))
    chosen: set[fx.Node] = set()
    for c in candidates:
        if len(chosen) >= max_side_values:
            break
        trial = count(chosen | {c})
        if len(trial) > len(best):
            chosen.add(c)
            best = trial
    # computed values that only help together (a rotary embedding's cos and sin, and the mask): groups of the most
    # used ones (the model's own inputs travel alone, so two input branches are never cut apart)
    pool = [c for c in candidates if c.op != "placeholder"][:_GROUP_POOL]
    for size in range(2, max_side_values + 1):
        for group in itertools.combinations(pool, size):
            trial = count(set(group))
            if len(trial) > len(best):
                chosen, best = set(group), trial

    cuts = []
    for v, live in zip(best, _live_sets(nodes, [order[v] for v in best])):
        rest = sorted((n for n in live if n is not v), key=lambda n: order[n])
        cuts.append(Cut(node=v.name, position=order[v], boundary=(v.name, *(n.name for n in rest))))
    return cuts

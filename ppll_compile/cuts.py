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


def _graph(nodes: Sequence[fx.Node], side: set[fx.Node]) -> nx.DiGraph:
    """The data-flow graph from a source before the inputs to the output, ``side`` values' edges left out."""
    g = nx.DiGraph()
    g.add_node(_SOURCE)
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
    return g


def _dominator_cuts(nodes: Sequence[fx.Node], side: set[fx.Node]) -> list[fx.Node] | None:
    """Nodes that dominate the output in the data-flow graph, with ``side`` values' edges left out, in graph
    order; ``None`` when the output cannot be reached from the inputs at all."""
    idom = nx.immediate_dominators(_graph(nodes, side), _SOURCE)
    output = nodes[-1]
    if output not in idom:
        return None
    chain = []
    v = idom[output]
    while v != _SOURCE:
        chain.append(v)
        v = idom[v]
    return chain[::-1]


def _reaches_output(nodes: Sequence[fx.Node], side: set[fx.Node]) -> bool:
    """The output can be reached from the inputs with ``side`` values' edges left out."""
    return nx.has_path(_graph(nodes, side), _SOURCE, nodes[-1])


class _Trials:
    """Counts the cuts that leaving out the edges of ``side`` plus a few ``extra`` values yields, recomputing
    dominators only for trials that can add cuts.

    A cut after ``v`` needs two things: ``v`` dominates the output in the graph without the edges of
    ``side | extra``, and every value live after ``v`` is ``v``, a side value or an extra one. The second
    alone is read off the live sets once: ``bound(extra)`` counts the eligible positions whose live values
    beyond ``v`` and ``side`` all lie in ``extra``. The cuts are a subset of those positions, so a trial whose
    bound does not beat the best count cannot beat it; nor can one that cuts the output off from the inputs
    (no cuts at all). Every other trial is counted in full by :meth:`count`, so the result is that of
    counting every trial. Those are few: when the output is reachable the bound is the count, since every
    path from the inputs to the output leaves the nodes up to ``v`` by an edge from a value live after ``v``
    (a later node fed by nothing is a side value whose edges are left out), and every such value but ``v``
    has lost its edges, so the path passes through ``v``. Dominators are thus recomputed about once per
    change of the chosen side values, and the search takes time linear in the graph's size, not quadratic.
    """

    def __init__(self, nodes: Sequence[fx.Node], side: set[fx.Node], eligible: Sequence[fx.Node],
                 order: dict[fx.Node, int]) -> None:
        self.nodes, self.side, self.order = nodes, side, order
        self.eligible = set(eligible)
        self.lacking: dict[frozenset[fx.Node], int] = {}  # how many positions lack exactly these values
        for v, live in zip(eligible, _live_sets(nodes, [order[v] for v in eligible])):
            key = frozenset(n for n in live if n is not v and n not in side)
            self.lacking[key] = self.lacking.get(key, 0) + 1

    def bound(self, extra: set[fx.Node]) -> int:
        """How many eligible positions have nothing but ``v``, side values and ``extra`` live after them."""
        members = list(extra)
        return sum(self.lacking.get(frozenset(k), 0)
                   for size in range(len(members) + 1) for k in itertools.combinations(members, size))

    def count(self, extra: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node] | None]:
        """The cuts with ``extra`` values travelling beside the side values, and the output's dominators in
        graph order (``None`` where the output cannot be reached)."""
        chain = _dominator_cuts(self.nodes, self.side | extra)
        if chain is None:
            return [], None
        dominators = [v for v in chain if v in self.eligible]
        lives = _live_sets(self.nodes, [self.order[v] for v in dominators])
        return ([v for v, live in zip(dominators, lives) if all(n is v or n in self.side or n in extra for n in live)],
                chain)


def legal_cuts(gm: fx.GraphModule, *, max_side_values: int = MAX_SIDE_VALUES) -> list[Cut]:
    """The legal cuts of a measured GraphModule, in graph order.

    A cut after node ``v`` is legal when ``v`` dominates the output: every path from the inputs to the
    output passes through it, so its output carries everything the rest of the graph needs. Skip
    connections inside a residual block are therefore never cut; the boundaries between blocks are.
    Python scalars (sizes read off tensors) may cross a cut beside ``v``; so may up to ``max_side_values``
    side tensors (inputs or widely used values such as an attention mask) when leaving their edges out of
    the dominance test yields more cuts. Requires :func:`ppll_compile.cost.measure_graph` to have run.

    Side values are chosen greedily from the most used candidates, then from groups of the few most used
    computed ones; a trial is kept when it yields more cuts. Trials that cannot yield more are told apart
    without recomputing dominators (see :class:`_Trials`), so the time grows linearly with the model's depth.
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    last_compute = max(i for i, n in enumerate(nodes) if n.op in _COMPUTE)
    # scalars and other non-tensor values, and values computed from no input at all, may cross any cut
    side = {n for n in nodes if n.op in _COMPUTE and not _is_tensor(n)
            and not isinstance(_value(n), (tuple, list, dict))}
    side |= {n for n in nodes if n.op in _COMPUTE and all(a.op == "get_attr" for a in n.all_input_nodes)}
    # cuts are computed tensors with computation on both sides of them
    eligible = [n for n in nodes if n.op in _COMPUTE and _is_tensor(n) and order[n] < last_compute]
    trials = _Trials(nodes, side, eligible, order)

    best, chain = trials.count(set())
    dominating = set(chain or ())
    candidates = [n for n in nodes if n.op != "get_attr" and n.op != "output" and n not in side
                  and (n.op == "placeholder" or len(n.users) >= 3) and _is_tensor(n)]
    candidates.sort(key=lambda n: (-len(n.users), order[n]))
    chosen: set[fx.Node] = set()
    for c in candidates:
        if len(chosen) >= max_side_values:
            break
        # leaving out the edges of c as well cuts the output off exactly when c dominates it already
        if chain is None or trials.bound(chosen | {c}) <= len(best) or c in dominating:
            continue
        trial, trial_chain = trials.count(chosen | {c})
        if len(trial) > len(best):
            chosen.add(c)
            best, chain = trial, trial_chain
            dominating = set(chain or ())
    # computed values that only help together (a rotary embedding's cos and sin, and the mask): groups of the most
    # used ones (the model's own inputs travel alone, so two input branches are never cut apart)
    pool = [c for c in candidates if c.op != "placeholder"][:_GROUP_POOL]
    for size in range(2, max_side_values + 1):
        for group in itertools.combinations(pool, size):
            if trials.bound(set(group)) <= len(best) or not _reaches_output(nodes, side | set(group)):
                continue
            trial, _ = trials.count(set(group))
            if len(trial) > len(best):
                chosen, best = set(group), trial

    cuts = []
    for v, live in zip(best, _live_sets(nodes, [order[v] for v in best])):
        rest = sorted((n for n in live if n is not v), key=lambda n: order[n])
        cuts.append(Cut(node=v.name, position=order[v], boundary=(v.name, *(n.name for n in rest))))
    return cuts

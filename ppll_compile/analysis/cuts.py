"""Find the legal cut points of a traced graph: nodes whose output carries everything later nodes need."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx as fx

from ..cost.nodes import META_KEY
from ..plans.plan import TensorSpec

MAX_SIDE_VALUES = 3
"""At most this many side tensors (an attention mask; a rotary embedding's cos and sin) may travel with the main
tensor across a cut."""
STREAM_SIDE_VALUES = 3
"""How many more side tensors a cut inside one stream of a two-stream model may carry: a T5 decoder layer reads the
encoder's output, the encoder's mask, its own causal mask, two position biases and the target tokens."""
_GROUP_POOL = 6  # the most used candidates, tried in groups

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


def _value(node: fx.Node) -> Any:
    cost = node.meta.get(META_KEY)
    return cost.value if cost is not None else None


def _is_tensor(node: fx.Node) -> bool:
    """The node's output is one tensor (not a Python scalar, a structure, or an unknown object; a ``bool``
    tensor such as a mask is a tensor)."""
    value = _value(node)
    return isinstance(value, TensorSpec) and not value.scalar


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


def _dominates_after(nodes: Sequence[fx.Node], v: fx.Node, travel: set[fx.Node], side: set[fx.Node],
                     order: dict[fx.Node, int]) -> bool:
    """``v`` dominates the output once the values in ``travel`` cross the cut after ``v`` beside it: their uses
    after ``v`` (and every use of the scalar ``side`` values) are left out, their uses before ``v`` kept. Only the
    inputs feed the source: values computed from no input can be recomputed on either side of a cut."""
    g = nx.DiGraph()
    g.add_node(_SOURCE)
    at = order[v]
    for n in nodes:
        if n.op == "get_attr":
            continue
        g.add_node(n)
        if n.op == "placeholder":
            g.add_edge(_SOURCE, n)
        for a in n.all_input_nodes:
            if a.op != "get_attr" and a not in side and not (a in travel and order[n] > at):
                g.add_edge(a, n)
    if not nx.has_path(g, _SOURCE, nodes[-1]):
        return False
    idom = nx.immediate_dominators(g, _SOURCE)
    u = idom[nodes[-1]]
    while u != _SOURCE and u is not v:
        u = idom[u]
    return u is v


def _input_dominators(nodes: Sequence[fx.Node], side: set[fx.Node]) -> dict[Any, Any]:
    """Immediate dominators of the data-flow graph fed by the inputs only (scalar ``side`` values' edges left
    out)."""
    g = nx.DiGraph()
    g.add_node(_SOURCE)
    for n in nodes:
        if n.op != "get_attr":
            g.add_node(n)
            g.add_edges_from((a, n) for a in n.all_input_nodes if a.op != "get_attr" and a not in side)
            if n.op == "placeholder":
                g.add_edge(_SOURCE, n)
    return nx.immediate_dominators(g, _SOURCE)


def _dominated(v: fx.Node, n: fx.Node, idom: dict[Any, Any]) -> bool:
    """``n`` dominates ``v``: every path from the inputs to ``v`` passes through ``n``."""
    u = idom.get(v)
    while u is not None and u != _SOURCE:
        if u is n:
            return True
        u = idom.get(u)
    return False


def _read_on(n: fx.Node, at: int, order: dict[fx.Node, int], output: fx.Node) -> bool:
    """``n`` is read on past position ``at`` as a mask or an encoder's output is: by two or more later nodes, or
    by the output (a residual's skip value is read once, by its add)."""
    later = [u for u in n.users if order[u] > at]
    return len(later) >= 2 or output in n.users


def _parameter_free(nodes: Sequence[fx.Node]) -> set[fx.Node]:
    """The inputs and the values computed from them without a parameter or a submodule's call."""
    free: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder" or (n.op in ("call_function", "call_method")
                                     and all(a in free for a in n.all_input_nodes)):
            free.add(n)
    return free


def _stream_cuts(nodes: Sequence[fx.Node], side: set[fx.Node], eligible: Sequence[fx.Node],
                 order: dict[fx.Node, int], found: set[fx.Node], max_side_values: int) -> list[fx.Node]:
    """Cuts whose side values are chosen per cut rather than for the whole graph, for models of two streams such
    as an encoder-decoder: inside the encoder the target tokens (a decoder input) and the encoder's masks travel
    beside its hidden state; inside the decoder the encoder's output and the decoder's masks travel beside the
    decoder's hidden state. No one set of side values serves both, since the encoder's output is the main value in
    one and a side value in the other. A position qualifies when at most ``max_side_values`` tensors besides ``v``
    are live after it, each an input or a value read at least twice (a mask, a bias, the encoder's output), and
    ``v`` dominates the output with those values' later uses left out (:func:`_dominates_after`), and no value
    travelling that a parameter computed is one ``v`` derives from alone (a skip connection; the inputs may be)."""
    # values computed from the inputs by no parameter (masks, shifted target tokens) may travel however often they
    # are read; the main value must have met a parameter (a mask is no stream of its own)
    plain = _parameter_free(nodes)
    out: list[fx.Node] = []
    carried: set[fx.Node] = set()
    idom: dict[Any, Any] | None = None
    for v, live in zip(eligible, _live_sets(nodes, [order[v] for v in eligible])):
        travel = {n for n in live if n is not v and n not in side}
        if v in found:  # a cut of the one set of side values: what it carries tells the streams apart too
            carried |= travel
            continue
        if not travel or len(travel) > max_side_values or v in plain:
            continue
        if not all(_is_tensor(n) and (n in plain or _read_on(n, order[v], order, nodes[-1])) for n in travel):
            continue
        if idom is None:
            idom = _input_dominators(nodes, side)
        if any(n not in plain and _dominated(v, n, idom) for n in travel):  # a skip connection: v derives from n
            continue
        if _dominates_after(nodes, v, travel, side, order):
            out.append(v)
            carried |= travel
    # a second stream is one whose cuts carry another cut's main value (the encoder's output) beside their own, a
    # cut that carries nothing but inputs beside it (the end of the first stream); other models keep the cuts of
    # their one set of side values
    ends = sorted(carried & (found | set(out)), key=lambda n: order[n])
    for x, live in zip(ends, _live_sets(nodes, [order[n] for n in ends])):
        if all(n is x or n in side or n in plain for n in live):
            return out
    return []


def legal_cuts(gm: fx.GraphModule, *, max_side_values: int = MAX_SIDE_VALUES) -> list[Cut]:
    """The legal cuts of a measured GraphModule, in graph order.

    A cut after node ``v`` is legal when ``v`` dominates the output: every path from the inputs to the
    output passes through it, so its output carries everything the rest of the graph needs. Skip
    connections inside a residual block are therefore never cut; the boundaries between blocks are.
    Python scalars (sizes read off tensors) may cross a cut beside ``v``; so may up to ``max_side_values``
    side tensors (inputs or widely used values such as an attention mask) when leaving their edges out of
    the dominance test yields more cuts. Requires :func:`ppll_compile.cost.nodes.measure_graph` to have run.

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
    # values computed from the inputs by no parameter (masks, positions) first: they are what travels beside a
    # stream; a hidden state tried first as a side value would make the mask the main value instead
    plain = _parameter_free(nodes)
    candidates.sort(key=lambda n: (n not in plain, -len(n.users), order[n]))
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
    pool = sorted((c for c in candidates if c.op != "placeholder"), key=lambda n: (-len(n.users), order[n]))
    pool = pool[:_GROUP_POOL]
    for size in range(2, max_side_values + 1):
        for group in itertools.combinations(pool, size):
            if trials.bound(set(group)) <= len(best) or not _reaches_output(nodes, side | set(group)):
                continue
            trial, _ = trials.count(set(group))
            if len(trial) > len(best):
                chosen, best = set(group), trial

    if max_side_values >= MAX_SIDE_VALUES:  # a lower limit asks for the one set of side values only
        stream = _stream_cuts(nodes, side, eligible, order, set(best), max_side_values + STREAM_SIDE_VALUES)
        best = sorted(set(best) | set(stream), key=lambda n: order[n])
    cuts = []
    for v, live in zip(best, _live_sets(nodes, [order[v] for v in best])):
        rest = sorted((n for n in live if n is not v), key=lambda n: order[n])
        cuts.append(Cut(node=v.name, position=order[v], boundary=(v.name, *(n.name for n in rest))))
    return cuts

"""The traced graph of a plan by stage: boxes coloured by stage, cut edges red, big graphs summarised by module."""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..capture.trace import module_path
from ..errors import PlanError, PPLLError
from ..plans.plan import Plan
from .figure import figure, output_path, save

ENGINES = ("auto", "graphviz", "matplotlib")
"""Ways :func:`draw_graph` can lay out a graph; ``auto`` picks graphviz when its ``dot`` program is installed."""
DETAILS = ("auto", "modules", "nodes")
"""What a box of the graph stands for: ``nodes`` one traced node each, ``modules`` consecutive nodes of one module
path and stage (at the deepest depth giving at most ``max_nodes`` boxes), ``auto`` nodes up to ``max_nodes`` of
them, else modules."""
MAX_NODES = 60
"""Boxes a graph picture holds by default: a chain of more is too long to read (ResNet-32's 130 nodes drawn one
per box make a picture some 10,000 pixels tall), so ``detail='auto'`` summarises such graphs by module."""

_STAGE_COLORS = ("#80b1d3", "#fdb462", "#b3de69", "#bebada", "#fb8072", "#8dd3c7", "#fccde5", "#ffed6f",
                 "#bc80bd", "#ccebc5")
_NEUTRAL = "#eeeeee"
_CUT = "#d62728"


@dataclass(frozen=True)
class GraphNode:
    """One box of the graph picture: a traced node, or a group of consecutive nodes in summary mode."""

    id: str
    label: str
    stage: int | None
    """Stage the box belongs to; ``None`` for inputs, outputs and parameters outside every stage."""
    color: str
    members: tuple[str, ...]
    """Names of the traced nodes the box stands for, in graph order."""


@dataclass(frozen=True)
class GraphEdge:
    """A data dependency between two boxes; ``cut`` when it crosses a stage boundary (labelled with its shape)."""

    src: str
    dst: str
    cut: bool
    label: str = ""


@dataclass(frozen=True)
class GraphDescription:
    """The pure content of a graph picture: boxes, edges, stage colours, and whether it is a module summary."""

    nodes: tuple[GraphNode, ...]
    edges: tuple[GraphEdge, ...]
    stage_colors: tuple[str, ...]
    stage_labels: tuple[str, ...]
    title: str
    summary: bool
    """True when consecutive nodes are grouped by module path (``detail='modules'``, or ``auto`` with more than
    ``max_nodes`` nodes)."""
    depth: int | None
    """Module-path depth of the summary groups (``None`` when every node is drawn)."""

    @property
    def cut_edges(self) -> tuple[GraphEdge, ...]:
        return tuple(e for e in self.edges if e.cut)


@dataclass(frozen=True)
class GraphPicture:
    """What :func:`draw_graph` wrote: the file, the engine that laid it out, and the description it drew."""

    path: Path
    engine: str
    description: GraphDescription
    source: str | None = None
    """The DOT source (graphviz engine only)."""


def _tint(color: str, amount: float) -> str:
    """``color`` mixed with white: ``amount`` 1 keeps the colour, 0 gives white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - c) * amount):02x}" for c in rgb)


def _shape(t: Any) -> str:
    return "x".join(map(str, t.shape)) or "int"


def _label(gm: Any, node: Any) -> str:
    """A short two-line label for a traced node: its name and what it calls."""
    if node.op == "placeholder":
        return f"{node.target}\ninput"
    if node.op == "output":
        return "output"
    if node.op == "call_module":
        try:
            return f"{node.target}\n{type(gm.get_submodule(node.target)).__name__}"
        except AttributeError:
            return str(node.target)
    what = f".{node.target}()" if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    return node.name if node.op == "get_attr" or what == node.name else f"{node.name}\n{what}"


@dataclass(frozen=True)
class _Staged:
    """The traced nodes of a graph module with the stage each belongs to and the shapes that label cut edges."""

    gm: Any
    nodes: tuple[Any, ...]
    order: dict[str, int]
    """Position of every node in graph order, by name."""
    stage_of: dict[str, int]
    """Stage of every node a stage lists, by name."""
    shapes: dict[str, str]
    """Boundary shape by boundary tensor name."""
    sole: dict[int, str]
    """Shape of a stage's only boundary tensor, by stage (``pipebd`` boundaries carry the teacher's names)."""
    colors: tuple[str, ...]
    """Colour of every stage."""

    @property
    def edges(self) -> list[tuple[Any, Any]]:
        """Every (producer, consumer) pair, in graph order of the consumers."""
        return [(u, v) for v in self.nodes for u in v.all_input_nodes]

    def is_cut(self, u: Any, v: Any) -> bool:
        """Whether the edge ``u -> v`` goes from a stage to a later one."""
        return u.name in self.stage_of and v.name in self.stage_of and self.stage_of[v.name] > self.stage_of[u.name]

    def shape(self, u: Any) -> str:
        """The boundary shape a cut edge leaving ``u`` is labelled with."""
        return self.shapes.get(u.name) or self.sole.get(self.stage_of[u.name], "?")

    def box(self, members: list[Any], label: str, stage: int | None, id_: str) -> GraphNode:
        """A box for ``members`` in the colour of ``stage`` (neutral outside every stage)."""
        return GraphNode(id=id_, label=label, stage=stage, color=_NEUTRAL if stage is None else self.colors[stage],
                         members=tuple(n.name for n in members))

    def key(self, n: Any, depth: int) -> tuple[str, int | None]:
        """What consecutive nodes share to form one summary box: module path cut to ``depth``, and stage."""
        if n.op == "get_attr" and n.users:  # a parameter goes with its first user
            n = min(n.users, key=lambda u: self.order[u.name])
        if n.op in ("placeholder", "output", "get_attr"):
            return f"<{n.op}>", None
        return ".".join(module_path(n).split(".")[:depth]), self.stage_of.get(n.name)


def _staged(gm: Any, plan: Plan) -> _Staged:
    """The nodes of ``gm`` placed in the stages of ``plan``; a PlanError when the plan names nodes ``gm`` lacks."""
    nodes = tuple(gm.graph.nodes)
    order = {n.name: i for i, n in enumerate(nodes)}
    stage_of = {name: s.index for s in plan.stages for name in s.nodes}
    missing = [name for name in stage_of if name not in order]
    if missing:
        raise PlanError(f"plan node(s) {missing[:5]} are not in the graph; draw the graph module the plan was made "
                        "from (compiled.graph_module)")
    return _Staged(gm=gm, nodes=nodes, order=order, stage_of=stage_of,
                   shapes={t.name: _shape(t) for s in plan.stages for t in s.boundary},
                   sole={s.index: _shape(s.boundary[0]) for s in plan.stages if len(s.boundary) == 1},
                   colors=tuple(_STAGE_COLORS[j % len(_STAGE_COLORS)] for j in range(plan.num_stages)))


def describe_graph(gm: Any, plan: Plan, *, max_nodes: int = MAX_NODES, detail: str = "auto") -> GraphDescription:
    """Boxes, edges and colours for the traced graph ``gm`` of ``plan``, without drawing anything.

    Nodes take the colour of the stage whose ``nodes`` list them (inputs, outputs and parameters a neutral
    grey). An edge is a cut when its producer's stage is earlier than its consumer's; it is labelled with the
    boundary shape. ``detail`` (one of :data:`DETAILS`): ``nodes`` draws a box per node; ``modules`` makes
    consecutive nodes of one stage and one module path (truncated to the deepest depth that gives at most
    ``max_nodes`` groups) one box; ``auto`` (default) is ``nodes`` up to ``max_nodes`` nodes, else ``modules``.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    if detail not in DETAILS:
        raise ValueError(f"detail {detail!r} is not known; details: {', '.join(DETAILS)}")
    staged = _staged(gm, plan)
    stage_labels = tuple(f"stage {s.index}: {s.device}" + (f" x {s.replicas}" if s.replicas > 1 else "")
                         for s in plan.stages)
    teacher = f" (student of {plan.teacher})" if plan.teacher else ""
    title = f"{plan.model}{teacher}: {plan.mode.upper()}, {plan.num_stages} stages, cuts in red"
    common: dict[str, Any] = dict(stage_colors=staged.colors, stage_labels=stage_labels, title=title)
    if detail == "nodes" or (detail == "auto" and len(staged.nodes) <= max_nodes):
        boxes, edges = _box_per_node(staged)
        return GraphDescription(nodes=boxes, edges=edges, summary=False, depth=None, **common)
    runs, depth = _runs(staged, max_nodes)
    boxes, group = _run_boxes(staged, runs, depth)
    return GraphDescription(nodes=boxes, edges=_merged_edges(staged, group), summary=True, depth=depth, **common)


def _box_per_node(staged: _Staged) -> tuple[tuple[GraphNode, ...], tuple[GraphEdge, ...]]:
    """One box per traced node and one edge per data dependency, cuts labelled with their boundary shape."""
    boxes = tuple(staged.box([n], _label(staged.gm, n), staged.stage_of.get(n.name), n.name) for n in staged.nodes)
    edges = tuple(GraphEdge(u.name, v.name, staged.is_cut(u, v), staged.shape(u) if staged.is_cut(u, v) else "")
                  for u, v in staged.edges)
    return boxes, edges


def _runs_at(staged: _Staged, depth: int) -> list[list[Any]]:
    """The nodes in graph order, split into runs of consecutive nodes with one :meth:`_Staged.key` at ``depth``."""
    runs: list[list[Any]] = []
    for n in staged.nodes:
        if runs and staged.key(runs[-1][-1], depth) == staged.key(n, depth):
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _runs(staged: _Staged, max_nodes: int) -> tuple[list[list[Any]], int]:
    """The runs at the deepest module depth that gives at most ``max_nodes`` of them, and that depth."""
    deepest = max(len(module_path(n).split(".")) for n in staged.nodes)
    runs: list[list[Any]] = []
    for depth in range(deepest, -1, -1):
        runs = _runs_at(staged, depth)
        if len(runs) <= max_nodes:
            return runs, depth
    raise ValueError(f"max_nodes={max_nodes} is too small: even one box per stage, input and output gives "
                     f"{len(runs)} boxes; pass max_nodes >= {len(runs)}")


def _run_boxes(staged: _Staged, runs: list[list[Any]], depth: int) -> tuple[tuple[GraphNode, ...], dict[str, str]]:
    """One box per run (``g0``, ``g1``, ...), and the box id of every node."""
    boxes: list[GraphNode] = []
    group: dict[str, str] = {}
    for k, run in enumerate(runs):
        path, stage = staged.key(run[0], depth)
        if len(run) == 1:
            label = _label(staged.gm, run[0])
        elif path == "<placeholder>":
            label = "inputs " + ", ".join(str(n.target) for n in run)
        else:
            label = f"{path or '(forward)'}\n{len(run)} nodes"
        boxes.append(staged.box(run, label, stage, f"g{k}"))
        group.update((n.name, f"g{k}") for n in run)
    return tuple(boxes), group


def _merged_edges(staged: _Staged, group: dict[str, str]) -> tuple[GraphEdge, ...]:
    """One edge per pair of boxes a dependency joins; a cut when any of them is, labelled with its distinct shapes."""
    merged: dict[tuple[str, str], list[str]] = {}
    for u, v in staged.edges:
        a, b = group[u.name], group[v.name]
        if a != b:
            labels = merged.setdefault((a, b), [])
            if staged.is_cut(u, v):
                labels.append(staged.shape(u))
    return tuple(GraphEdge(a, b, bool(lab), " + ".join(dict.fromkeys(lab))) for (a, b), lab in merged.items())


def _unpack(compiled: Any) -> tuple[Any, Plan]:
    if isinstance(compiled, tuple) and len(compiled) == 2:
        return compiled
    if hasattr(compiled, "graph_module") and hasattr(compiled, "plan"):
        return compiled.graph_module, compiled.plan
    raise TypeError(f"draw_graph takes a compiled pipeline (with .graph_module and .plan) or a tuple "
                    f"(graph_module, plan), got {type(compiled).__name__}")


def draw_graph(compiled: Any, path: str | Path, *, max_nodes: int = MAX_NODES, engine: str = "auto",
               detail: str = "auto") -> GraphPicture:
    """Draw the traced graph of a compiled pipeline (or ``(graph_module, plan)``) coloured by stage, cuts in red.

    ``engine``: ``graphviz`` (needs the ``dot`` program), ``matplotlib`` (a layered top-to-bottom layout), or
    ``auto`` (graphviz when the ``dot`` program and the ``graphviz`` Python package, the ``draw`` extra, are
    installed). ``detail``: graphs with more than ``max_nodes`` nodes are
    drawn as a module-level summary (``auto``), or always (``modules``), or never (``nodes``); see
    :func:`describe_graph`.
    """
    path = output_path(path)
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not known; engines: {', '.join(ENGINES)}")
    gm, plan = _unpack(compiled)
    has_dot = shutil.which("dot") is not None
    if engine == "graphviz" and not has_dot:
        raise PPLLError("engine='graphviz' needs the Graphviz `dot` program, which is not on PATH; install Graphviz "
                        "(`apt-get install graphviz` or `brew install graphviz`) or pass engine='matplotlib'")
    desc = describe_graph(gm, plan, max_nodes=max_nodes, detail=detail)
    can_dot = has_dot and importlib.util.find_spec("graphviz") is not None
    if engine == "matplotlib" or (engine == "auto" and not can_dot):
        _graph_matplotlib(desc, path)
        return GraphPicture(path=path, engine="matplotlib", description=desc)
    return GraphPicture(path=path, engine="graphviz", description=desc, source=_graph_graphviz(desc, path))


def _graph_graphviz(desc: GraphDescription, path: Path) -> str:
    """Lay ``desc`` out with graphviz (one cluster per stage), write ``path``, return the DOT source."""
    try:
        import graphviz
    except ImportError:
        raise PPLLError("drawing with graphviz needs the `graphviz` Python package: `pip install "
                        "'ppll-compile[draw]'` (or `pip install graphviz`), or pass engine='matplotlib'") from None
    font = "Helvetica"
    dot = graphviz.Digraph("plan", graph_attr={"rankdir": "TB", "label": desc.title, "labelloc": "t",
                                               "fontname": font, "fontsize": "16", "nodesep": "0.25",
                                               "ranksep": "0.3"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontname": font,
                                      "fontsize": "10", "color": "#666666"},
                           edge_attr={"color": "#666666", "arrowsize": "0.6", "fontname": font, "fontsize": "9"})
    for j, (color, label) in enumerate(zip(desc.stage_colors, desc.stage_labels)):
        with dot.subgraph(name=f"cluster_stage{j}") as c:
            c.attr(label=label, style="rounded,filled", fillcolor=_tint(color, 0.25), color=color, penwidth="2",
                   fontsize="12", labeljust="l")
            for n in desc.nodes:
                if n.stage == j:
                    c.node(n.id, n.label, fillcolor=n.color)
    for n in desc.nodes:
        if n.stage is None:
            dot.node(n.id, n.label, fillcolor=n.color, style="rounded,filled,dashed")
    for e in desc.edges:
        if e.cut:
            dot.edge(e.src, e.dst, label=f" {e.label}", color=_CUT, fontcolor=_CUT, penwidth="2.5", style="bold")
        else:
            dot.edge(e.src, e.dst)
    path.write_bytes(dot.pipe(format=path.suffix[1:].lower()))
    return dot.source


def _layered(desc: GraphDescription) -> dict[str, tuple[float, int]]:
    """(x, row) of every box: the row is the longest path from an input, the x order follows the boxes above."""
    preds: dict[str, list[str]] = {}
    for e in desc.edges:
        preds.setdefault(e.dst, []).append(e.src)
    row: dict[str, int] = {}
    rows: dict[int, list[str]] = {}
    for n in desc.nodes:
        row[n.id] = 1 + max((row[p] for p in preds.get(n.id, ())), default=-1)
        rows.setdefault(row[n.id], []).append(n.id)
    pos: dict[str, tuple[float, int]] = {}
    for r in sorted(rows):
        above = {i: [pos[p][0] for p in preds.get(i, ())] for i in rows[r]}
        ids = sorted(rows[r], key=lambda i: sum(above[i]) / len(above[i]) if above[i] else 0.0)
        pos.update((i, (k - (len(ids) - 1) / 2, r)) for k, i in enumerate(ids))
    return pos


def _graph_matplotlib(desc: GraphDescription, path: Path) -> None:
    """Draw ``desc`` with matplotlib: one row per dependency layer; edges that skip rows go round on the right."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
    from matplotlib.path import Path as Route

    pos = _layered(desc)
    rows = max(r for _, r in pos.values()) + 1
    half = max(max(abs(x) for x, _ in pos.values()) + 0.5, 0.8)
    box_w, box_h = 0.86, 0.5
    fig = figure(2.2 * (2 * half + 0.4), 0.8 * rows)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-half, half + 0.4)
    ax.set_ylim(-rows + 0.5, 0.5)
    ax.axis("off")
    for n in desc.nodes:
        x, r = pos[n.id]
        ax.add_patch(FancyBboxPatch((x - box_w / 2, -r - box_h / 2), box_w, box_h,
                                    boxstyle="round,pad=0,rounding_size=0.08", fc=n.color, ec="#666666",
                                    lw=0.8, ls="--" if n.stage is None else "-", zorder=2))
        lines = [line if len(line) <= 30 else line[:29] + "…" for line in n.label.split("\n")]
        ax.text(x, -r, "\n".join(lines), ha="center", va="center", fontsize=7.5, zorder=3)
    skips = [e for e in desc.edges if pos[e.dst][1] - pos[e.src][1] > 1]
    trunk: dict[str, tuple[float, float]] = {}  # per source of row-skipping edges: its vertical line and gap offset
    for k, src in enumerate(dict.fromkeys(e.src for e in skips)):
        r1, r2 = pos[src][1], max(pos[e.dst][1] for e in skips if e.src == src)
        right = max(x for x, r in pos.values() if r1 <= r <= r2) + box_w / 2 + 0.08 + 0.08 * (k % 3)
        trunk[src] = right, 0.3 + 0.05 * (k % 3)
    labelled: set[tuple[str, str, bool]] = set()  # one label per trunk
    for e in desc.edges:
        (x1, r1), (x2, r2) = pos[e.src], pos[e.dst]
        once = (e.src, e.label, r2 - r1 > 1)
        label = e.label if e.cut and once not in labelled else ""
        labelled.add(once)
        if r2 - r1 > 1:  # down, along the trunk right of every box in between, into the box from above
            right, gap = trunk[e.src]
            route = Route([(x1 + 0.15, -r1 - box_h / 2), (x1 + 0.15, -r1 - gap), (right, -r1 - gap),
                           (right, -r2 + gap), (x2 + 0.15, -r2 + gap), (x2 + 0.15, -r2 + box_h / 2)])
            at, ha = (right + 0.03, -(r1 + r2) / 2), "left"
        else:
            route = Route([(x1, -r1 - box_h / 2), (x2, -r2 + box_h / 2)])
            at, ha = ((x1 + x2) / 2 - 0.04, -(r1 + r2) / 2), "right"
        ax.add_patch(FancyArrowPatch(path=route, arrowstyle="-|>", mutation_scale=9, zorder=1 + e.cut,
                                     color=_CUT if e.cut else "#777777", lw=2.2 if e.cut else 0.8))
        if label:
            ax.text(*at, label, color=_CUT, fontsize=7, ha=ha, va="center", zorder=4,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    handles = [Patch(fc=c, ec="#666666", label=lab) for c, lab in zip(desc.stage_colors, desc.stage_labels)]
    handles += [Patch(fc=_NEUTRAL, ec="#666666", ls="--", label="inputs / output / parameters"),
                Line2D([], [], color=_CUT, lw=2.2, label="cut (boundary shape)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8.5)
    summary = f"\nmodule summary at depth {desc.depth}: boxes group consecutive nodes" if desc.summary else ""
    ax.set_title(desc.title + summary, fontsize=11, fontweight="bold", loc="left")
    save(fig, path)

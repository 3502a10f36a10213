"""Pictures of plans: per-stage cost bars, the traced graph coloured by stage with its cuts, and Gantt charts.

Every public function writes one file, its format chosen by the suffix (``.png``, ``.svg`` or ``.pdf``), and
returns a small frozen description of what it drew. matplotlib and graphviz are imported only when drawing.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlanError, PPLLError
from .plan import Plan, format_flops
from .timeline import KINDS, Timeline
from .trace import module_path

__all__ = ["SUFFIXES", "ENGINES", "CostBars", "GraphNode", "GraphEdge", "GraphDescription", "GraphPicture", "Gantt",
           "cost_bars", "describe_graph", "plot_costs", "draw_graph", "draw_gantt"]

SUFFIXES = (".png", ".svg", ".pdf")
"""File suffixes the pictures can be written as."""
ENGINES = ("auto", "graphviz", "matplotlib")
"""Ways :func:`draw_graph` can lay out a graph; ``auto`` picks graphviz when its ``dot`` program is installed."""

_STAGE_COLORS = ("#80b1d3", "#fdb462", "#b3de69", "#bebada", "#fb8072", "#8dd3c7", "#fccde5", "#ffed6f",
                 "#bc80bd", "#ccebc5")
_NEUTRAL = "#eeeeee"
_CUT = "#d62728"
_SEGMENT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860")
_KIND_COLORS = {"receive": "#d0d0d0", "forward": "#4c72b0", "backward": "#dd8452", "allreduce": "#8172b3",
                "step": "#55a868", "send": "#937860"}


def _output(path: str | Path) -> Path:
    """``path`` as a Path whose suffix names a supported format (its folder created)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        found = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        raise ValueError(f"cannot write {str(path)!r}: it has {found}; the picture format follows the suffix, "
                         f"supported suffixes: {', '.join(SUFFIXES)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure outside pyplot's global state (rendered with Agg or the format's own backend)."""
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height))


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.2, facecolor="white")


# ---- cost bars ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostBars:
    """The stacked cost bars of a plan, in milliseconds; what :func:`plot_costs` drew."""

    labels: tuple[str, ...]
    """x tick label of every stage: ``stage j``, plus `` x r`` for a stage on ``r`` replicas."""
    segments: dict[str, tuple[float, ...]]
    """Segment name -> its height in ms for every stage, stacked bottom to top in this order."""
    bottleneck: int
    """Stage whose bar carries the bottleneck mark."""
    title: str
    subtitle: str
    path: Path | None = None
    """File written (``None`` for :func:`cost_bars`, which draws nothing)."""

    @property
    def totals(self) -> tuple[float, ...]:
        """Height of every stage's bar in ms (its predicted step time)."""
        return tuple(sum(col) for col in zip(*self.segments.values()))


def cost_bars(plan: Plan) -> CostBars:
    """Split every stage's cost into forward, backward, head (teacher), all-reduce and communication.

    The compute cost minus the all-reduce is shared out by FLOPs: the backbone's forward and backward FLOPs and
    the head's (under ``pipebd`` the teacher's forward). Under ``profile="time"`` the compute is a measured total,
    so this split is by FLOP shares of it, not a measurement of each part.
    """
    names = (("student forward", "student backward", "teacher forward") if plan.mode == "pipebd"
             else ("backbone forward", "backbone backward", "aux head"))
    columns: list[tuple[float, ...]] = []
    for s in plan.stages:
        sync = min(plan.allreduce_cost(s), s.cost - s.comm_cost)
        work = s.cost - s.comm_cost - sync
        flops = (s.flops_fwd, s.flops_bwd, s.aux_flops)
        shares = [f / sum(flops) for f in flops] if sum(flops) > 0 else [1.0, 0.0, 0.0]
        columns.append(tuple(x * 1e3 for x in (*(work * f for f in shares), sync, s.comm_cost)))
    segments = dict(zip((*names, "gradient all-reduce", "communication"), zip(*columns)))
    labels = tuple(f"stage {s.index}" + (f" x {s.replicas}" if s.replicas > 1 else "") for s in plan.stages)
    teacher = f" from teacher {plan.teacher}" if plan.teacher else ""
    devices = f" on {plan.world_size} devices" if plan.world_size != plan.num_stages else ""
    title = (f"{plan.model}{teacher}: {plan.mode.upper()}, K={plan.num_stages} stages{devices}, "
             f"predicted speedup {plan.predicted_speedup:.2f}x")
    if plan.profile == "time":
        subtitle = "profile 'time': measured compute, split into parts by FLOP shares"
    else:
        subtitle = f"profile '{plan.profile}': FLOPs at {format_flops(plan.flops_per_second)}/s per device"
    return CostBars(labels=labels, segments=segments, bottleneck=plan.bottleneck_stage, title=title,
                    subtitle=subtitle + f", links {plan.link_bandwidth / 2**30:.1f} GiB/s")


def plot_costs(plan: Plan, path: str | Path) -> CostBars:
    """Draw each stage's predicted step time as a stacked bar (ms) and mark the bottleneck stage.

    Segments: backbone forward, backbone backward, aux head (``pipebd``: student forward/backward and teacher
    forward), gradient all-reduce (replicated stages) and communication. Under ``profile="time"`` the compute
    is split by FLOP shares of a measured total. Returns the :class:`CostBars` drawn; ``bottleneck`` is read
    back from the hatched bar.
    """
    path = _output(path)
    bars = cost_bars(plan)
    fig = _figure(max(6.0, 1.1 * len(bars.labels) + 2.5), 4.8)
    ax = fig.add_subplot()
    x = range(len(bars.labels))
    bottom = [0.0] * len(bars.labels)
    for (name, heights), color in zip(bars.segments.items(), _SEGMENT_COLORS):
        if not any(heights):
            continue
        ax.bar(x, heights, bottom=bottom, width=0.6, color=color, label=name, edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    top = max(bars.totals) or 1.0
    b = bars.bottleneck
    ax.bar([b], [bars.totals[b]], width=0.6, fill=False, hatch="///", edgecolor="black", linewidth=1.6,
           label="bottleneck")
    for i, total in enumerate(bars.totals):
        text = f"{total:.3g} ms" + ("\nbottleneck" if i == b else "")
        ax.annotate(text, (i, total), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8.5, fontweight="bold" if i == b else "normal",
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none"))
    ax.axhline(plan.ideal_cost * 1e3, color="#555555", linestyle="--", linewidth=1, label="ideal (mean)")
    ax.set_xticks(list(x), bars.labels)
    ax.set_xlim(-0.6, len(bars.labels) - 0.4)
    ax.set_ylim(0, top * 1.22)
    ax.set_ylabel("time per batch (ms)")
    ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(bars.title, fontsize=11, fontweight="bold")
    ax.set_title(bars.subtitle, fontsize=8.5, color="#444444")
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] == "ideal (mean)")
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False, fontsize=8.5)
    marked = [round(p.get_x() + p.get_width() / 2) for p in ax.patches if p.get_hatch()]
    _save(fig, path)
    return dataclasses.replace(bars, path=path, bottleneck=marked[0] if len(marked) == 1 else -1,
                               labels=tuple(t.get_text() for t in ax.get_xticklabels()))


# ---- graph -------------------------------------------------------------------------------------------------

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
    """True when consecutive nodes are grouped by module path (the graph had more than ``max_nodes`` nodes)."""
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


def describe_graph(gm: Any, plan: Plan, *, max_nodes: int = 150) -> GraphDescription:
    """Boxes, edges and colours for the traced graph ``gm`` of ``plan``, without drawing anything.

    Nodes take the colour of the stage whose ``nodes`` list them (inputs, outputs and parameters a neutral
    grey). An edge is a cut when its producer's stage is earlier than its consumer's; it is labelled with the
    boundary shape. With more than ``max_nodes`` nodes, consecutive nodes of one stage and one module path
    (truncated to the deepest depth that gives at most ``max_nodes`` groups) become one box.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    nodes = list(gm.graph.nodes)
    order = {n.name: i for i, n in enumerate(nodes)}
    stage_of = {name: s.index for s in plan.stages for name in s.nodes}
    missing = [name for name in stage_of if name not in order]
    if missing:
        raise PlanError(f"plan node(s) {missing[:5]} are not in the graph; draw the graph module the plan was made "
                        "from (compiled.graph_module)")
    shapes = {t.name: _shape(t) for s in plan.stages for t in s.boundary}
    sole = {s.index: _shape(s.boundary[0]) for s in plan.stages if len(s.boundary) == 1}  # pipebd: teacher names
    colors = tuple(_STAGE_COLORS[j % len(_STAGE_COLORS)] for j in range(plan.num_stages))
    stage_labels = tuple(f"stage {s.index}: {s.device}" + (f" x {s.replicas}" if s.replicas > 1 else "")
                         for s in plan.stages)
    teacher = f" (student of {plan.teacher})" if plan.teacher else ""
    title = f"{plan.model}{teacher}: {plan.mode.upper()}, {plan.num_stages} stages, cuts in red"
    node_edges = [(u, v) for v in nodes for u in v.all_input_nodes]

    def is_cut(u: Any, v: Any) -> bool:
        return u.name in stage_of and v.name in stage_of and stage_of[v.name] > stage_of[u.name]

    def shape(u: Any) -> str:
        return shapes.get(u.name) or sole.get(stage_of[u.name], "?")

    def box(members: list[Any], label: str, stage: int | None, id_: str) -> GraphNode:
        return GraphNode(id=id_, label=label, stage=stage, color=_NEUTRAL if stage is None else colors[stage],
                         members=tuple(n.name for n in members))

    common = dict(stage_colors=colors, stage_labels=stage_labels, title=title)
    if len(nodes) <= max_nodes:
        boxes = tuple(box([n], _label(gm, n), stage_of.get(n.name), n.name) for n in nodes)
        edges = tuple(GraphEdge(u.name, v.name, is_cut(u, v), shape(u) if is_cut(u, v) else "")
                      for u, v in node_edges)
        return GraphDescription(nodes=boxes, edges=edges, summary=False, depth=None, **common)

    def key(n: Any, depth: int) -> tuple[str, int | None]:
        if n.op == "get_attr" and n.users:  # a parameter goes with its first user
            n = min(n.users, key=lambda u: order[u.name])
        if n.op in ("placeholder", "output", "get_attr"):
            return f"<{n.op}>", None
        return ".".join(module_path(n).split(".")[:depth]), stage_of.get(n.name)

    deepest = max(len(module_path(n).split(".")) for n in nodes)
    for depth in range(deepest, -1, -1):
        runs: list[list[Any]] = []
        for n in nodes:
            if runs and key(runs[-1][-1], depth) == key(n, depth):
                runs[-1].append(n)
            else:
                runs.append([n])
        if len(runs) <= max_nodes:
            break
    else:
        raise ValueError(f"max_nodes={max_nodes} is too small: even one box per stage, input and output gives "
                         f"{len(runs)} boxes; pass max_nodes >= {len(runs)}")
    boxes_list: list[GraphNode] = []
    group: dict[str, str] = {}
    for k, run in enumerate(runs):
        path, stage = key(run[0], depth)
        if len(run) == 1:
            label = _label(gm, run[0])
        elif path == "<placeholder>":
            label = "inputs " + ", ".join(str(n.target) for n in run)
        else:
            label = f"{path or '(forward)'}\n{len(run)} nodes"
        boxes_list.append(box(run, label, stage, f"g{k}"))
        group.update((n.name, f"g{k}") for n in run)
    merged: dict[tuple[str, str], list[str]] = {}
    for u, v in node_edges:
        a, b = group[u.name], group[v.name]
        if a != b:
            labels = merged.setdefault((a, b), [])
            if is_cut(u, v):
                labels.append(shape(u))
    edges = tuple(GraphEdge(a, b, bool(lab), " + ".join(dict.fromkeys(lab))) for (a, b), lab in merged.items())
    return GraphDescription(nodes=tuple(boxes_list), edges=edges, summary=True, depth=depth, **common)


def _unpack(compiled: Any) -> tuple[Any, Plan]:
    if isinstance(compiled, tuple) and len(compiled) == 2:
        return compiled
    if hasattr(compiled, "graph_module") and hasattr(compiled, "plan"):
        return compiled.graph_module, compiled.plan
    raise TypeError(f"draw_graph takes a compiled pipeline (with .graph_module and .plan) or a tuple "
                    f"(graph_module, plan), got {type(compiled).__name__}")


def draw_graph(compiled: Any, path: str | Path, *, max_nodes: int = 150, engine: str = "auto") -> GraphPicture:
    """Draw the traced graph of a compiled pipeline (or ``(graph_module, plan)``) coloured by stage, cuts in red.

    ``engine``: ``graphviz`` (needs the ``dot`` program), ``matplotlib`` (a layered top-to-bottom layout), or
    ``auto`` (graphviz when ``dot`` is installed). Graphs with more than ``max_nodes`` nodes are drawn as a
    module-level summary (see :func:`describe_graph`).
    """
    path = _output(path)
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not known; engines: {', '.join(ENGINES)}")
    gm, plan = _unpack(compiled)
    has_dot = shutil.which("dot") is not None
    if engine == "graphviz" and not has_dot:
        raise PPLLError("engine='graphviz' needs the Graphviz `dot` program, which is not on PATH; install Graphviz "
                        "(`apt-get install graphviz` or `brew install graphviz`) or pass engine='matplotlib'")
    desc = describe_graph(gm, plan, max_nodes=max_nodes)
    if engine == "matplotlib" or (engine == "auto" and not has_dot):
        _graph_matplotlib(desc, path)
        return GraphPicture(path=path, engine="matplotlib", description=desc)
    return GraphPicture(path=path, engine="graphviz", description=desc, source=_graph_graphviz(desc, path))


def _graph_graphviz(desc: GraphDescription, path: Path) -> str:
    """Lay ``desc`` out with graphviz (one cluster per stage), write ``path``, return the DOT source."""
    try:
        import graphviz
    except ImportError:
        raise PPLLError("drawing with graphviz needs the `graphviz` Python package; `pip install graphviz` or pass "
                        "engine='matplotlib'") from None
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
    fig = _figure(2.2 * (2 * half + 0.4), 0.8 * rows)
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
    _save(fig, path)


# ---- gantt -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gantt:
    """What :func:`draw_gantt` drew: its lanes, how many bars, which kinds and batches."""

    path: Path
    lanes: tuple[tuple[int, int], ...]
    """Every (stage, replica), top to bottom."""
    bars: int
    """Number of bars drawn (one per event shown)."""
    kinds: tuple[str, ...]
    """Span kinds shown, in :data:`~ppll_compile.timeline.KINDS` order (the legend)."""
    batches: tuple[int, ...]
    """Batch indices shown."""
    title: str


def draw_gantt(timeline: Timeline, path: str | Path, *, title: str | None = None,
               batches: int | None = None) -> Gantt:
    """Draw a timeline as one lane per (stage, replica) with a bar per span, coloured by kind, x in ms.

    ``batches`` limits the picture to the first ``batches`` batch indices. The title always says whether the
    timeline was simulated or measured.
    """
    from matplotlib.patches import Patch

    path = _output(path)
    if not timeline.events:
        raise ValueError("the timeline has no events; record one with trace=True or simulate a plan first")
    if batches is not None and batches < 1:
        raise ValueError(f"batches must be a positive number of batches to show, got {batches}")
    every = sorted({e.batch for e in timeline.events})
    shown = tuple(every[:batches] if batches is not None else every)
    events = [e for e in timeline.events if e.batch <= shown[-1]]
    lanes = tuple(sorted({(e.stage, e.replica) for e in events}))
    replicated = {s for s, r in lanes if r > 0}
    present = {e.kind for e in events}
    kinds = tuple(k for k in (*KINDS, *sorted(present - set(KINDS))) if k in present)
    model = timeline.meta.get("model")
    head = title or (f"{timeline.source.capitalize()} timeline" + (f" of {model}" if model else ""))
    if timeline.source.lower() not in head.lower():
        head += f" ({timeline.source})"
    if len(shown) < len(every):
        head += f", first {len(shown)} of {len(every)} batches"
    fig = _figure(10.0, 0.5 * len(lanes) + 1.5)
    ax = fig.add_subplot()
    span = max(max(e.end for e in events) * 1e3, 1e-9)
    bars = 0
    for y, lane in enumerate(lanes):
        mine = [e for e in events if (e.stage, e.replica) == lane]
        for kind in kinds:
            spans = [e for e in mine if e.kind == kind]
            if spans:
                bars += len(ax.barh([y] * len(spans), [e.duration * 1e3 for e in spans],
                                    left=[e.start * 1e3 for e in spans], height=0.7, edgecolor="white",
                                    linewidth=0.4, color=_KIND_COLORS.get(kind, "#999999")))
        for e in mine:
            if e.kind == "forward" and e.duration * 1e3 / span * 550 > 4.5 * len(str(e.batch)) + 3:  # ~550 pt wide
                ax.text((e.start + e.duration / 2) * 1e3, y, str(e.batch), ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(lanes)),
                  [f"stage {s}" + (f" / replica {r}" if s in replicated else "") for s, r in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(head, fontsize=11, fontweight="bold")
    handles = [Patch(color=_KIND_COLORS.get(k, "#999999"), label=k) for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8.5)
    _save(fig, path)
    return Gantt(path=path, lanes=lanes, bars=bars, kinds=kinds, batches=shown, title=head)

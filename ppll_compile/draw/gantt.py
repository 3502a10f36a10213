"""Gantt charts: a simulated or measured timeline drawn as one lane of spans per stage replica."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..plans.timeline import KINDS, Timeline
from .figure import figure, output_path, save

_KIND_COLORS = {"receive": "#d0d0d0", "forward": "#4c72b0", "backward": "#dd8452", "allreduce": "#8172b3",
                "step": "#55a868", "send": "#937860"}


@dataclass(frozen=True)
class Gantt:
    """What :func:`draw_gantt` drew: its lanes, how many bars, which kinds and batches."""

    path: Path
    lanes: tuple[tuple[int, int], ...]
    """Every (stage, replica), top to bottom."""
    bars: int
    """Number of bars drawn (one per event shown)."""
    kinds: tuple[str, ...]
    """Span kinds shown, in :data:`~ppll_compile.plans.timeline.KINDS` order (the legend)."""
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

    path = output_path(path)
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
    fig = figure(10.0, 0.5 * len(lanes) + 1.5)
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
    save(fig, path)
    return Gantt(path=path, lanes=lanes, bars=bars, kinds=kinds, batches=shown, title=head)

"""Stacked cost bars: each stage's predicted step time split into forward, backward, head, optimizer step,
all-reduce and sends."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..plans.plan import Plan
from ..plans.units import format_flops
from .figure import figure, output_path, save

_SEGMENT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")


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
    """Split every stage's cost into forward, backward, head (teacher), optimizer step, all-reduce and
    communication.

    The compute cost minus the optimizer step and the all-reduce is shared out by FLOPs: the backbone's forward
    and backward FLOPs and the head's (under ``pipebd`` the teacher's forward). Under ``profile="time"`` the
    compute is a measured total, so this split is by FLOP shares of it, not a measurement of each part.
    """
    names = (("student forward", "student backward", "teacher forward") if plan.mode == "pipebd"
             else ("backbone forward", "backbone backward", "aux head"))
    columns: list[tuple[float, ...]] = []
    for s in plan.stages:
        sync = min(plan.allreduce_cost(s), s.cost - s.comm_cost)
        step = min(s.step_cost, s.cost - s.comm_cost - sync)
        work = s.cost - s.comm_cost - sync - step
        flops = (s.flops_fwd, s.flops_bwd, s.aux_flops)
        shares = [f / sum(flops) for f in flops] if sum(flops) > 0 else [1.0, 0.0, 0.0]
        columns.append(tuple(x * 1e3 for x in (*(work * f for f in shares), step, sync, s.comm_cost)))
    segments = dict(zip((*names, "optimizer step", "gradient all-reduce", "communication"), zip(*columns)))
    labels = tuple(f"stage {s.index}" + (f" x {s.replicas}" if s.replicas > 1 else "") for s in plan.stages)
    teacher = f" from teacher {plan.teacher}" if plan.teacher else ""
    devices = f" on {plan.world_size} devices" if plan.world_size != plan.num_stages else ""
    title = (f"{plan.model}{teacher}: {plan.mode.upper()}, K={plan.num_stages} stages{devices}, "
             f"predicted speedup {plan.predicted_speedup:.2f}x")
    if plan.profile == "time":
        subtitle = "profile 'time': measured compute, split into parts by FLOP shares"
    elif plan.profile == "roofline":
        device = plan.calibration.get("device", "the device")
        subtitle = f"profile 'roofline': seconds on {device}, split by FLOP shares"
    else:
        subtitle = f"profile '{plan.profile}': FLOPs at {format_flops(plan.flops_per_second)}/s per device"
    return CostBars(labels=labels, segments=segments, bottleneck=plan.bottleneck_stage, title=title,
                    subtitle=subtitle + f", links {plan.link_bandwidth / 2**30:.1f} GiB/s")


def plot_costs(plan: Plan, path: str | Path) -> CostBars:
    """Draw each stage's predicted step time as a stacked bar (ms) and mark the bottleneck stage.

    Segments: backbone forward, backbone backward, aux head (``pipebd``: student forward/backward and teacher
    forward), optimizer step, gradient all-reduce (replicated stages) and communication. Under ``profile="time"``
    the compute is split by FLOP shares of a measured total. Returns the :class:`CostBars` drawn; ``bottleneck`` is read
    back from the hatched bar.
    """
    path = output_path(path)
    bars = cost_bars(plan)
    fig = figure(max(6.0, 1.1 * len(bars.labels) + 2.5), 4.8)
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
    save(fig, path)
    return dataclasses.replace(bars, path=path, bottleneck=marked[0] if len(marked) == 1 else -1,
                               labels=tuple(t.get_text() for t in ax.get_xticklabels()))

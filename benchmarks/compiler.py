"""Compile time against model size, phase by phase, and the exact partitioner's own speed.

``ppll_compile.plan`` (no lowering) for 4 stages at batch 64, FLOP profile, ``auto`` heads, on torchvision ResNets
and ViTs (224x224 inputs) and deep MLPs (``nn.Sequential`` of ``Linear(64, 64)`` + ``ReLU``). Each phase is the time
``ppll_compile.phases.record_phases`` reports for that call: ``trace`` (torch.fx), ``cost`` (FLOPs and memory of
every node on fake tensors), ``cuts`` (the legal cuts), ``heads`` (the heads' measurement) and ``partition`` (the
partitioner's solve); the total is the whole call. Medians over 7 rounds that plan every model once in turn, after
warm-up plans of two small models. Then the exact partitioner alone on 10,000 random segments into 64 stages (heads,
links, device speeds and a binding memory cap). ``--quick``: resnet18, resnet50, vit_b_16 and MLPs of 100 and 1,000
layers, 3 rounds.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch import nn

import ppll_compile
from ppll_compile import partitioners
from ppll_compile.capture.trace import trace
from ppll_compile.phases import PHASES, record_phases

from .report import Section, standalone

__all__ = ["PHASES", "section", "compile_scaling", "partitioner_time", "main"]

STAGES = 4
BATCH = 64
RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
VITS = ("vit_b_16", "vit_l_16")
MLP_LAYERS = (100, 500, 1000, 2000, 5000)
QUICK = {"resnet": ("resnet18", "resnet50"), "vit": ("vit_b_16",), "mlp": (100, 1000)}
FULL = {"resnet": RESNETS, "vit": VITS, "mlp": MLP_LAYERS}
FAMILIES = {"resnet": "torchvision ResNet", "vit": "torchvision ViT", "mlp": "MLP (Linear(64, 64) + ReLU)"}


def _mlp(layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*blocks)


def _models(plan: dict[str, tuple]) -> Iterator[tuple[str, str, Callable[[], nn.Module], tuple[torch.Tensor, ...]]]:
    """(family, name, builder, example inputs) of every model in ``plan``, smallest first within a family."""
    image = (torch.randn(1, 3, 224, 224),)
    for name in plan["resnet"] + plan["vit"]:
        family = "resnet" if name.startswith("resnet") else "vit"
        yield family, name, getattr(torchvision.models, name), image
    for layers in plan["mlp"]:
        yield "mlp", f"mlp-{layers}", lambda layers=layers: _mlp(layers), (torch.randn(1, 64),)


def _plan_once(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[dict[str, float], int, int]:
    """Seconds per phase and in total of one ``plan()``, the traced graph's node count and its legal cuts."""
    with record_phases() as seconds, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback of a machine without GPUs
        start = time.perf_counter()
        plan = ppll_compile.plan(model, STAGES, example_inputs=inputs, batch_size=BATCH, profile="flops")
        total = time.perf_counter() - start
    nodes = len(trace(model, example_inputs=inputs).graph.nodes)
    return {**seconds, "total": total}, nodes, len(plan.legal_cuts)


def compile_scaling(plan: dict[str, tuple], repeat: int) -> list[dict[str, Any]]:
    """One row per model: node count, legal cuts, and the median seconds of every phase and of the whole plan.

    Every round plans every model once, in turn, so that a burst of load on the machine does not favour one.
    """
    torch.manual_seed(0)
    models = [(family, name, build(), inputs) for family, name, build, inputs in _models(plan)]
    # first use of fake tensors, the FLOP counter, convolution and batch-norm kernels, and the policy files
    _plan_once(_mlp(STAGES), (torch.randn(1, 64),))  # enough legal cuts for STAGES stages
    _plan_once(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)),
               (torch.randn(1, 3, 32, 32),))
    runs: dict[str, list[tuple[dict[str, float], int, int]]] = {name: [] for _, name, _, _ in models}
    for i in range(repeat):
        for _, name, model, inputs in models:
            runs[name].append(_plan_once(model, inputs))
        print(f"  round {i + 1}/{repeat}: " + ", ".join(f"{name} {r[-1][0]['total']:.2f} s"
                                                      for name, r in runs.items()), flush=True)
    rows = []
    for family, name, _, _ in models:
        row: dict[str, Any] = {"family": family, "model": name, "nodes": runs[name][0][1],
                               "legal_cuts": runs[name][0][2]}
        row |= {f"{p}_s": statistics.median(r[0][p] for r in runs[name]) for p in (*PHASES, "total")}
        row["runs_total_s"] = [r[0]["total"] for r in runs[name]]
        rows.append(row)
    return rows


def partitioner_time(repeat: int) -> dict[str, Any]:
    """The exact solver on 10,000 segments into 64 stages with heads, links, speeds and a binding cap."""
    rng = np.random.default_rng(0)
    n, k = 10_000, 64
    compute = rng.uniform(0.1, 1.0, n)
    memory = rng.uniform(1.0, 2.0, n)
    problem = partitioners.Problem(compute=compute, head=rng.uniform(0, 0.5, n), comm=rng.uniform(0, 0.2, n),
                                   memory=memory, head_memory=rng.uniform(0, 1, n),
                                   speeds=rng.uniform(0.5, 1.5, k), memory_limit=2.0 * memory.sum() / k)
    partitioners.solve(problem, k)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        partitioners.solve(problem, k)
        times.append(time.perf_counter() - start)
    return {"segments": n, "stages": k, "repeat": repeat, "seconds": statistics.median(times), "runs_s": times}


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"resnet": "o", "vit": "s", "mlp": "^"}
    colors = {"total": "black", "trace": "#1f77b4", "cost": "#d62728", "cuts": "#9467bd", "heads": "#ff7f0e",
              "partition": "#2ca02c"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), sharex=True)
    for family, marker in markers.items():
        fam = sorted((r for r in rows if r["family"] == family), key=lambda r: r["nodes"])
        if not fam:
            continue
        nodes = [r["nodes"] for r in fam]
        left.plot(nodes, [r["total_s"] for r in fam], marker=marker, color="black", label=FAMILIES[family])
        for r in fam:
            left.annotate(r["model"], (r["nodes"], r["total_s"]), fontsize=7, textcoords="offset points",
                          xytext=(-6, -3) if family == "vit" else (4, -9), ha="right" if family == "vit" else "left")
        for phase in PHASES:
            right.plot(nodes, [max(r[f"{phase}_s"], 1e-5) for r in fam], marker=marker, color=colors[phase],
                       linewidth=0.8, markersize=5)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes in the traced graph")
        ax.grid(True, which="major", alpha=0.3)
    left.set_ylabel("seconds")
    left.set_title(f"plan() into {STAGES} stages: total")
    right.set_title("by phase")
    left.legend(fontsize=8, loc="upper left")
    handles = [plt.Line2D([], [], color=colors[p], label=p) for p in PHASES]
    handles += [plt.Line2D([], [], color="gray", marker=m, linestyle="", label=f) for f, m in markers.items()
                if any(r["family"] == f for r in rows)]
    right.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(r: dict[str, Any]) -> str:
    lines = [f"`plan()` into {STAGES} stages at batch {BATCH} (FLOP profile, `auto` heads, no lowering); each "
             f"phase is the time inside the compiler's own function for it, the total the whole call (also the "
             f"per-segment sums and the Plan); medians of {r['repeat']} interleaved rounds after a warm-up.", "",
             "| model | nodes | legal cuts | trace s | cost s | cuts s | heads s | partition s | total s | ms/node |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["scaling"]:
        phases = " | ".join(f"{row[f'{p}_s']:.3f}" for p in PHASES)
        lines.append(f"| {row['model']} | {row['nodes']} | {row['legal_cuts']} | {phases} | {row['total_s']:.2f} | "
                     f"{1e3 * row['total_s'] / row['nodes']:.2f} |")
    p = r["partitioner"]
    lines += ["", f"Exact partitioner, {p['segments']:,} segments into {p['stages']} stages (heads, links, device "
              f"speeds, a binding memory cap): {p['seconds'] * 1e3:.1f} ms (median of {p['repeat']}).", ""]
    return "\n".join(lines)


def section(*, quick: bool, out: Path) -> Section:
    """Compile time against model size, phase by phase, and the exact partitioner on 10,000 segments."""
    repeat = 3 if quick else 7
    results: dict[str, Any] = {"stages": STAGES, "batch": BATCH, "repeat": repeat, "threads": torch.get_num_threads(),
                               "scaling": compile_scaling(QUICK if quick else FULL, repeat),
                               "partitioner": partitioner_time(repeat)}
    _plot(results["scaling"], out / "compile_scaling.png")
    return Section(key="compiler", title="Compile time", results=results, markdown=_markdown(results),
                   figures=["compile_scaling.png"])


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

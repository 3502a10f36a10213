"""Partition quality: each partitioner's predicted balance on three models, and ResNet-32's measured stage balance.

For ResNet-32 (CIFAR, ``dgl`` heads, batch 64), torchvision resnet50 and vit_b_16 (224x224, batch 64, FLOPs
profile) and K stages, every partitioner's plan gives a predicted bottleneck, imbalance (bottleneck / mean stage
cost) and speedup. ResNet-32 is small enough to train here, so each of its plans is also run: every stage's
training step (forward, local loss, backward, optimizer step) is timed alone in the sequential runtime on one
thread, and the measured max/mean set next to the predicted one. Its exact plan is made twice, from FLOP counts and
from times measured on this machine (``profile="time"``), to show what measuring buys. K = 2, 4, 8; ``--quick``:
K = 2, no time profile (the cost model's section measures one), fewer timed steps and no vit_b_16.
"""

from __future__ import annotations

import random
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torchvision

import ppll_compile

from .launch import load_example, one_thread
from .report import Section, standalone
from .runtime import sgd, stage_messages

__all__ = ["PARTITIONERS", "section", "predicted", "measured_balance", "main"]

PARTITIONERS = ("exact", "uniform", "greedy", "params")
BATCH = 64
TORCHVISION = ("resnet50", "vit_b_16")


def _summary(model: str, k: int, partitioner: str, profile: str, plan: ppll_compile.Plan, seconds: float) -> dict:
    costs = [s.cost for s in plan.stages]
    return {"model": model, "k": k, "partitioner": partitioner, "profile": profile, "cuts": list(plan.cuts),
            "plan_s": seconds, "stage_ms": [1e3 * c for c in costs], "bottleneck_ms": 1e3 * plan.bottleneck_cost,
            "imbalance": plan.imbalance, "predicted_speedup": plan.predicted_speedup}


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback of a machine without GPUs
        out = fn()
    return out, time.perf_counter() - start


def _resnet32(k: int, partitioner: str, profile: str) -> tuple[ppll_compile.CompiledPipeline, float]:
    """ResNet-32 compiled into ``k`` stages with ``dgl`` heads, and the seconds compiling took."""
    example = load_example("resnet32")
    torch.manual_seed(0)
    model = example.build_model(10)
    return _timed(lambda: ppll_compile.compile(model, k, example_inputs=example.example_inputs(), policy="dgl",
                                               partitioner=partitioner, profile=profile))


def predicted(name: str, ks: tuple[int, ...]) -> list[dict]:
    """Every partitioner's plan of torchvision model ``name`` (224x224, batch 64, FLOPs profile) at each K."""
    model = getattr(torchvision.models, name)()
    x = torch.randn(1, 3, 224, 224)
    rows = []
    for k in ks:
        for p in PARTITIONERS:
            try:
                plan, seconds = _timed(lambda: ppll_compile.plan(model, k, example_inputs=(x,), batch_size=BATCH,
                                                                 partitioner=p))
            except ppll_compile.PPLLError as e:
                rows.append({"model": name, "k": k, "partitioner": p, "profile": "flops", "error": str(e)})
                continue
            rows.append(_summary(name, k, p, "flops", plan, seconds))
    return rows


def measured_balance(pipelines: list[ppll_compile.CompiledPipeline], *, rounds: int,
                     batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[list[list[float]]]:
    """Per pipeline and stage, the seconds of ``rounds`` training steps, each stage timed alone on the same batch
    (``batch``, or 64 random 3x32x32 images).

    Every round times one step of every stage of every pipeline, in a fresh random order, so a burst of load on
    the machine falls on a random stage instead of on one plan or one position.
    """
    g = torch.Generator().manual_seed(0)
    x, y = batch or (torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
    setups = []
    for compiled in pipelines:
        trainer = compiled.trainer(optimizer=sgd)
        msgs = stage_messages(trainer, x, y)
        for r, msg in zip(trainer.runners, msgs):
            r.train_step(msg)  # warm-up
        setups.append((trainer, msgs))
    jobs = [(i, j) for i, (trainer, _) in enumerate(setups) for j in range(len(trainer.runners))]
    samples: dict[tuple[int, int], list[float]] = {job: [] for job in jobs}
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(jobs)
        for i, j in jobs:
            trainer, msgs = setups[i]
            start = time.perf_counter()
            trainer.runners[j].train_step(msgs[j])
            samples[i, j].append(time.perf_counter() - start)
    for trainer, _ in setups:
        trainer.close()
    return [[samples[i, j] for j in range(len(trainer.runners))] for i, (trainer, _) in enumerate(setups)]


def _resnet32_rows(ks: tuple[int, ...], rounds: int, timed: bool = True) -> list[dict]:
    """ResNet-32 plans (every partitioner by FLOPs, ``exact`` also by time unless not ``timed``) with their measured
    stage times."""
    rows, pipelines = [], []
    for k in ks:
        for p, profile in [(p, "flops") for p in PARTITIONERS] + ([("exact", "time")] if timed else []):
            try:
                compiled, seconds = _resnet32(k, p, profile)
            except ppll_compile.PPLLError as e:
                rows.append({"model": "resnet32", "k": k, "partitioner": p, "profile": profile, "error": str(e)})
                continue
            rows.append(_summary("resnet32", k, p, profile, compiled.plan, seconds))
            pipelines.append((len(rows) - 1, compiled))
    times = measured_balance([c for _, c in pipelines], rounds=rounds)
    for (i, _), runs in zip(pipelines, times):
        t = [statistics.median(s) for s in runs]
        rows[i]["samples_ms"] = [[1e3 * v for v in s] for s in runs]
        mean = statistics.mean(t)
        rows[i]["measured_ms"] = [1e3 * s for s in t]
        rows[i]["measured_max_over_mean"] = max(t) / mean
        rows[i]["measured_sum_over_max"] = sum(t) / max(t)
        rows[i]["measured_bottleneck_stage"] = t.index(max(t))
        rows[i]["predicted_bottleneck_stage"] = rows[i]["stage_ms"].index(max(rows[i]["stage_ms"]))
    return rows


def _spread(rows: list[dict]) -> float | None:
    """Median over all measured stages of the interquartile range of its step times over their median."""
    out = []
    for r in rows:
        for s in r.get("samples_ms", []):
            q1, _, q3 = statistics.quantiles(s, n=4)
            out.append((q3 - q1) / statistics.median(s))
    return statistics.median(out) if out else None


def _label(r: dict) -> str:
    return r["partitioner"] + (" (time)" if r["profile"] == "time" else "")


def _plot(rows: list[dict], ks: tuple[int, ...], models: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 9))
    labels = list(PARTITIONERS) + ["exact (time)"]
    groups = [(m, k) for m in models for k in ks]
    width = 0.8 / len(labels)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, lab in enumerate(labels):
        xs, ys = [], []
        for g, (m, k) in enumerate(groups):
            hit = [r for r in rows if r["model"] == m and r["k"] == k and _label(r) == lab and "error" not in r]
            if hit:
                xs.append(g - 0.4 + (j + 0.5) * width)
                ys.append(hit[0]["imbalance"])
        if xs:
            ax1.bar(xs, ys, width, label=lab, color=colors[j % len(colors)], hatch="//" if "time" in lab else None)
    ax1.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax1.set_xticks(range(len(groups)), [f"{m}\nK={k}" for m, k in groups], fontsize=8)
    ax1.set_ylabel("predicted imbalance (bottleneck / mean)")
    ax1.set_title(f"Predicted imbalance per partitioner (batch {BATCH}; FLOPs profile unless marked time)")
    ax1.legend(fontsize=8, ncol=len(labels))

    measured = [r for r in rows if "measured_max_over_mean" in r]
    xs = range(len(measured))
    ax2.bar([x - 0.2 for x in xs], [r["imbalance"] for r in measured], 0.4, label="predicted max/mean")
    ax2.bar([x + 0.2 for x in xs], [r["measured_max_over_mean"] for r in measured], 0.4,
            label="measured max/mean (per-stage step time, 1 thread)")
    ax2.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax2.set_xticks(list(xs), [f"K={r['k']}\n{_label(r)}" for r in measured], fontsize=8)
    ax2.set_ylabel("max / mean stage time")
    ax2.set_title(f"ResNet-32 (dgl, batch {BATCH}): measured vs predicted stage balance")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(res: dict) -> str:
    lines = [f"Batch {BATCH}. ResNet-32: `examples/resnet32.py`, `dgl` heads, 3x32x32 inputs; resnet50 and vit_b_16: "
             "torchvision, 3x224x224 inputs, `auto` heads. Profile `flops`: stage cost = FLOPs at "
             f"{res['flops_per_second'] / 1e12:g} TFLOP/s (the default nominal device); `time`: forward+backward "
             "times measured on this CPU with one thread.", "",
             "Predicted, from the plan: **bottleneck** = the slowest stage's step time (ms), **imbalance** = "
             "bottleneck / mean stage time (1.0 is perfect), **speedup** = the plan's sequential cost (every stage "
             "one after another on one device) / bottleneck, **plan s** = seconds the "
             "compiler took.", "",
             "| model | K | partitioner | profile | bottleneck (ms) | imbalance | speedup | plan s | cuts after |",
             "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in res["plans"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['k']} | {r['partitioner']} | {r['profile']} | error: {r['error']} "
                         "| | | | |")
            continue
        lines.append(f"| {r['model']} | {r['k']} | {r['partitioner']} | {r['profile']} | {r['bottleneck_ms']:.2f} | "
                     f"{r['imbalance']:.3f} | {r['predicted_speedup']:.2f}x | {r['plan_s']:.1f} | "
                     f"{', '.join(r['cuts'])} |")
    lines += ["", f"ResNet-32, measured: each stage's training step (block + aux head forward, local loss, backward, "
              f"SGD momentum step) timed alone in the sequential runtime on one thread, batch {BATCH}; median of "
              f"{res['rounds']} steps, one per round, each round timing every stage of every plan once in a random "
              "order. **stage times**: measured ms per stage; **measured max/mean** and **predicted max/mean**: "
              "slowest stage over the mean stage; **measured sum/max**: the speedup a pipeline of these stages could "
              "reach (compare the predicted speedup); **slowest stage**: measured / predicted index."
              + ("" if res["spread"] is None else f" A stage's step times varied by {100 * res['spread']:.0f}% (median "
                 "over stages of interquartile range / median)."), "",
              "| K | partitioner | profile | stage times (ms) | measured max/mean | predicted max/mean "
              "| measured sum/max | predicted speedup | slowest stage |", "|---:|---|---|---|---:|---:|---:|---:|---|"]
    for r in res["plans"]:
        if "measured_ms" not in r:
            continue
        times = ", ".join(f"{t:.1f}" for t in r["measured_ms"])
        lines.append(f"| {r['k']} | {r['partitioner']} | {r['profile']} | {times} | "
                     f"{r['measured_max_over_mean']:.3f} | {r['imbalance']:.3f} | {r['measured_sum_over_max']:.2f}x | "
                     f"{r['predicted_speedup']:.2f}x | {r['measured_bottleneck_stage']} / "
                     f"{r['predicted_bottleneck_stage']} |")
    return "\n".join(lines) + "\n"


def section(*, quick: bool, out: Path) -> Section:
    """Plan every model with every partitioner at each K, run ResNet-32's plans, plot and tabulate."""
    ks = (2,) if quick else (2, 4, 8)
    rounds = 4 if quick else 12
    models = ["resnet32", *(TORCHVISION[:1] if quick else TORCHVISION)]
    start = time.perf_counter()
    with one_thread():
        rows = _resnet32_rows(ks, rounds, timed=not quick)
        for name in models[1:]:
            rows += predicted(name, ks)
    res: dict[str, Any] = {"batch": BATCH, "ks": list(ks), "rounds": rounds, "threads": 1,
                           "flops_per_second": ppll_compile.PlanOptions().flops_per_second, "models": models,
                           "plans": rows, "spread": _spread(rows), "seconds": time.perf_counter() - start}
    _plot(rows, ks, models, Path(out) / "partition_quality.png")
    return Section(key="quality", title="Partition quality: predicted and measured balance", results=res,
                   markdown=_markdown(res), figures=["partition_quality.png"])


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

"""The cost model against the clock: each stage's predicted training-step time under every profile vs measured.

For ResNet-32 (CIFAR), torchvision resnet18 at 32x32, the small ViT and torchvision resnet50 at 224x224 with a
small batch, at K = 2 and 4, each profile (``flops``: counted FLOPs at the nominal 10 TFLOP/s; ``roofline``, the
default: every operator's FLOPs and bytes over this machine's calibrated figures, compute operators timed at
their shapes, plus the optimizer step; ``time``: measured whole candidate stages) makes a plan for SGD with
momentum. Every stage of every plan is then trained alone in the sequential runtime on one thread (block, aux
head, loss, backward, optimizer step), interleaved round by round in a random order, and its median step time
set against the plan's predicted ``compute_cost``. Per plan: the measured bottleneck and max/mean. Targets: the
roofline plan's measured bottleneck within 10% of the time plan's, and roofline predictions within 15% of
measured. Also: plan time for ResNet-32 and vit_b_16 with the calibration cached. ``--quick``: ResNet-32 only,
at K = 2, fewer rounds, its plan time only.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torchvision

import ppll_compile

from .launch import load_example, one_thread
from .quality import measured_balance
from .report import Section, standalone

__all__ = ["MODELS", "section", "main"]

PROFILES = ("flops", "roofline", "time")
MODELS = {
    # name: (builder, input shape with batch, policy)
    "resnet32": (lambda: load_example("resnet32").build_model(10), (64, 3, 32, 32), "dgl"),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (32, 3, 32, 32), "dgl"),
    "vit_small": (lambda: load_example("vit_small").build_model(10), (64, 3, 32, 32), "vit"),
    "resnet50": (lambda: torchvision.models.resnet50(num_classes=10), (8, 3, 224, 224), "dgl"),
}


def _quietly(fn: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback
        return fn()


def _plans(name: str, ks: tuple[int, ...]) -> tuple[list[dict], list[ppll_compile.CompiledPipeline], tuple]:
    """Every profile's plan of ``name`` at each K, compiled, with the seconds planning took."""
    build, shape, policy = MODELS[name]
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g))
    rows, pipelines = [], []
    for k in ks:
        for profile in PROFILES:
            start = time.perf_counter()
            compiled = _quietly(lambda: ppll_compile.compile(model, k, example_inputs=(batch[0],), policy=policy,
                                                             profile=profile, optimizer="momentum"))
            plan = compiled.plan
            rows.append({"model": name, "k": k, "profile": profile, "cuts": list(plan.cuts),
                         "plan_s": time.perf_counter() - start,
                         "predicted_ms": [1e3 * s.compute_cost for s in plan.stages],
                         "step_ms": [1e3 * s.step_cost for s in plan.stages],
                         "notes": [n for n in plan.notes if n.startswith(("costs are", "costs measured", "time"))]})
            pipelines.append(compiled)
    return rows, pipelines, batch


def _measure(rows: list[dict], pipelines: list[ppll_compile.CompiledPipeline], batch: tuple, rounds: int) -> None:
    times = measured_balance(pipelines, rounds=rounds, batch=batch)
    for row, runs in zip(rows, times):
        t = [statistics.median(s) for s in runs]
        row["measured_ms"] = [1e3 * v for v in t]
        row["ratio"] = [m / p for m, p in zip(row["measured_ms"], row["predicted_ms"])]
        row["measured_bottleneck_ms"] = 1e3 * max(t)
        row["measured_max_over_mean"] = max(t) / statistics.mean(t)
        row["predicted_max_over_mean"] = max(row["predicted_ms"]) / statistics.mean(row["predicted_ms"])


def _plan_seconds(quick: bool) -> list[dict]:
    """Seconds a second ``plan`` call takes (the calibration and operator times cached by the first); ``quick``:
    ResNet-32's only."""
    out = []
    models = (("resnet32", lambda: load_example("resnet32").build_model(10), torch.randn(64, 3, 32, 32), "dgl"),
              ("vit_b_16", torchvision.models.vit_b_16, torch.randn(32, 3, 224, 224), "auto"))
    for name, build, x, policy in models[:1] if quick else models:
        model = build()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            _quietly(lambda: ppll_compile.plan(model, 4, example_inputs=(x,), policy=policy, optimizer="momentum"))
            times.append(time.perf_counter() - start)
        out.append({"model": name, "first_s": times[0], "cached_s": times[1]})
    return out


def _markdown(res: dict) -> str:
    lines = ["Each stage trained alone (block, aux head, loss, backward, SGD momentum step) in the sequential "
             f"runtime on one thread, median of {res['rounds']} interleaved rounds; **predicted** is the plan's "
             "`compute_cost`. **ratio** = measured / predicted per stage (1.00 is exact; the `flops` profile "
             "assumes a nominal 10 TFLOP/s device, so its ratios show how far that is from this CPU).", "",
             "| model | K | profile | cuts | predicted ms | measured ms | ratio | measured max/mean | "
             "measured bottleneck ms | plan s |", "|---|---:|---|---|---|---|---|---:|---:|---:|"]
    for r in res["plans"]:
        lines.append(f"| {r['model']} | {r['k']} | {r['profile']} | {', '.join(r['cuts'])} | "
                     f"{', '.join(f'{v:.2f}' for v in r['predicted_ms'])} | "
                     f"{', '.join(f'{v:.1f}' for v in r['measured_ms'])} | "
                     f"{', '.join(f'{v:.2f}' for v in r['ratio'])} | {r['measured_max_over_mean']:.3f} | "
                     f"{r['measured_bottleneck_ms']:.1f} | {r['plan_s']:.1f} |")
    lines += ["", "Roofline against time (measured bottleneck of the roofline plan / of the time plan; target <= "
              "1.10) and the roofline's prediction error (largest |measured / predicted - 1| over the stages; target "
              "<= 0.15):", "", "| model | K | roofline / time bottleneck | roofline worst stage error |",
              "|---|---:|---:|---:|"]
    for s in res["summary"]:
        lines.append(f"| {s['model']} | {s['k']} | {s['roofline_over_time']:.3f} | {s['roofline_error']:.3f} |")
    lines += ["", "Plan time with the calibration cached (first call: calibration and operator timing included):", "",
              "| model | first call s | cached s |", "|---|---:|---:|"]
    lines += [f"| {p['model']} | {p['first_s']:.2f} | {p['cached_s']:.2f} |" for p in res["plan_seconds"]]
    return "\n".join(lines) + "\n"


def section(*, quick: bool, out: Path) -> Section:
    """Plan every model under every profile, time every stage, compare."""
    ks = (2,) if quick else (2, 4)
    rounds = 3 if quick else 9
    models = ["resnet32"] if quick else list(MODELS)
    start = time.perf_counter()
    rows: list[dict] = []
    with one_thread():
        for name in models:
            plans, pipelines, batch = _plans(name, ks)
            _measure(plans, pipelines, batch, rounds)
            rows += plans
        plan_seconds = _plan_seconds(quick)
    summary = []
    for name in models:
        for k in ks:
            by = {r["profile"]: r for r in rows if r["model"] == name and r["k"] == k}
            summary.append({"model": name, "k": k,
                            "roofline_over_time": by["roofline"]["measured_bottleneck_ms"]
                            / by["time"]["measured_bottleneck_ms"],
                            "roofline_error": max(abs(x - 1) for x in by["roofline"]["ratio"])})
    res: dict[str, Any] = {"ks": list(ks), "rounds": rounds, "threads": 1, "plans": rows, "summary": summary,
                           "plan_seconds": plan_seconds, "seconds": time.perf_counter() - start}
    return Section(key="costmodel", title="Cost model: predicted vs measured stage times per profile",
                   results=res, markdown=_markdown(res))


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure the compiler itself: compile time, partitioner time and partition quality against baselines."""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
import torchvision

import partitioners
import ppll_compile

from .report import environment, write

__all__ = ["main"]

BASELINES = ("exact", "uniform", "greedy", "params")


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compile_time(repeat: int) -> dict:
    """vit_b_16 at batch 64 into 4 stages, FLOPs profile: trace + measure + heads + partition + lower."""
    model = torchvision.models.vit_b_16()
    x = torch.randn(1, 3, 224, 224)
    run = lambda: ppll_compile.compile(model, 4, example_inputs=(x,), batch_size=64)  # noqa: E731
    run()  # warm-up: first use of fake tensors, flop counter and policy files
    return {"model": "vit_b_16", "batch": 64, "stages": 4, "seconds": _median_time(run, repeat)}


def partitioner_time(repeat: int) -> dict:
    """The exact solver on 10,000 segments into 64 stages with heads, links, speeds and a binding cap."""
    rng = np.random.default_rng(0)
    n, k = 10_000, 64
    compute = rng.uniform(0.1, 1.0, n)
    memory = rng.uniform(1.0, 2.0, n)
    problem = partitioners.Problem(compute=compute, head=rng.uniform(0, 0.5, n), comm=rng.uniform(0, 0.2, n),
                                   memory=memory, head_memory=rng.uniform(0, 1, n),
                                   speeds=rng.uniform(0.5, 1.5, k), memory_limit=2.0 * memory.sum() / k)
    return {"segments": n, "stages": k, "seconds": _median_time(lambda: partitioners.solve(problem, k), repeat)}


def imbalance(models: list[str]) -> list[dict]:
    """Plan imbalance (bottleneck / ideal) and bottleneck of every partitioner at 4 stages."""
    rows = []
    for name in models:
        model = getattr(torchvision.models, name)()
        x = torch.randn(1, 3, 224, 224)
        for method in BASELINES:
            p = ppll_compile.plan(model, 4, example_inputs=(x,), batch_size=64, partitioner=method)
            rows.append({"model": name, "partitioner": method, "imbalance": p.imbalance,
                         "bottleneck_ms": p.bottleneck_cost * 1e3, "predicted_speedup": p.predicted_speedup})
    return rows


def _markdown(res: dict) -> str:
    lines = [f"Measured {res['date']} on {res['machine']} (torch {res['torch']}).", "",
             "| figure | value |", "|---|---|",
             f"| compile vit_b_16 (batch 64, 4 stages, FLOPs profile) | {res['compile']['seconds']:.2f} s |",
             f"| exact partitioner, 10,000 segments into 64 stages | {res['partitioner']['seconds'] * 1e3:.1f} ms |",
             "", "| model | partitioner | imbalance | bottleneck (ms) | predicted speedup |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['partitioner']} | {r['imbalance']:.3f} | {r['bottleneck_ms']:.2f} | "
              f"{r['predicted_speedup']:.2f}x |" for r in res["imbalance"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="results", help="folder for compiler.json and compiler.md")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions (median reported)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # the CPU-fallback warning on machines without GPUs
    res = {
        **environment(f"{torch.get_num_threads()} threads"),
        "compile": compile_time(args.repeat),
        "partitioner": partitioner_time(args.repeat),
        "imbalance": imbalance(["resnet50", "vit_b_16"]),
    }
    write(args.out, "compiler", res, _markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure Pipe-BD against the DNA baseline on 2 processes, and the share of relaying, decoupling and replicas."""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ppll_compile

from .launch import load_example, one_thread, spawn
from .report import Section, standalone

__all__ = ["main", "section", "compare"]

BATCH = 32
EXAMPLE = "pipebd_mobilenet"
PLANS = {"two-stages": {"replicas": False}, "as-planned": {"replicas": True}, "one-stage-x2": {"replicas": (2,)}}
"""The plans compared, by their ``replicas`` option for 2 devices."""
RUNS = {
    "dna": ("dna", "two-stages", {}),
    "relay": ("distributed", "two-stages", {"decoupled": False}),
    "relay+decoupled": ("distributed", "two-stages", {}),
    "pipebd": ("distributed", "as-planned", {}),
    "replicas-only": ("distributed", "one-stage-x2", {}),
}
"""Name: (runtime, plan, trainer options); every run uses 2 processes, one thread each."""


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _compiled(**options: Any) -> Any:
    torch.manual_seed(0)
    module = load_example(EXAMPLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU fallback
        return ppll_compile.compile(module.build_model(), teacher=module.build_teacher(),
                                    example_inputs=(torch.randn(BATCH, 3, 32, 32),), **options)


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, 3, 32, 32, generator=g) for _ in range(n)]


def _worker(rank: int, world: int, runtime: str, plan: str, options: dict, steps: int, warmup: int) -> dict:
    trainer = _compiled(plan=plan).trainer(optimizer=_sgd, runtime=runtime, **options)
    data = _batches(steps + warmup) if trainer.reads_data else [None] * (steps + warmup)
    for x in data[:warmup]:
        trainer.step(x)
    trainer.finish()
    dist.barrier()
    start = time.perf_counter()
    for x in data[warmup:]:
        trainer.step(x)
    trainer.finish()
    dist.barrier()
    rate = steps * BATCH / (time.perf_counter() - start)
    trainer.close()
    return {"samples_per_s": rate} if rank == 0 else {}


def _sequential(plan: str, steps: int, warmup: int) -> float:
    trainer = _compiled(plan=plan).trainer(optimizer=_sgd)
    data = _batches(steps + warmup)
    for x in data[:warmup]:
        trainer.step(x)
    start = time.perf_counter()
    for x in data[warmup:]:
        trainer.step(x)
    return steps * BATCH / (time.perf_counter() - start)


def compare(*, steps: int, warmup: int, rounds: int, folder: Path) -> dict:
    """Samples/s of each run in :data:`RUNS` on 2 processes, plus one process running every block in turn.

    The plans of :data:`PLANS` are measured by time on this machine once (``profile="time"``: the teacher
    forward and student forward/backward of every block, at the whole batch and at half of it), saved, and
    re-applied in every process. Each round runs every configuration once, in turn, so that a burst of load
    on the machine does not favour one; the figures are medians over the rounds.
    """
    with one_thread():
        paths, layouts, predicted = {}, {}, {}
        for name, options in PLANS.items():
            p = _compiled(gpus=2, profile="time", **options).plan
            paths[name] = str(p.save(folder / f"plan-pipebd-{name}.json"))
            layouts[name] = [[list(s.blocks), s.replicas] for s in p.stages]
            predicted[name] = BATCH / p.bottleneck_cost
        runs: dict[str, list[float]] = {name: [] for name in ("sequential", *RUNS)}
        for _ in range(rounds):
            runs["sequential"].append(_sequential(paths["two-stages"], steps, warmup))
            for name, (runtime, plan, options) in RUNS.items():
                runs[name].append(spawn(_worker, 2, (runtime, paths[plan], options, steps, warmup),
                                        timeout=900)["samples_per_s"])
    out: dict[str, Any] = {name: statistics.median(v) for name, v in runs.items()}
    out |= {"runs": runs, "layouts": layouts, "predicted_samples_per_s": predicted}
    dna = out["dna"]
    out["ratios"] = {"pipebd/dna": out["pipebd"] / dna, "relay/dna": out["relay"] / dna,
                     "relay+decoupled/dna": out["relay+decoupled"] / dna,
                     "decoupled/relay": out["relay+decoupled"] / out["relay"],
                     "pipebd/relay+decoupled": out["pipebd"] / out["relay+decoupled"]}
    return out


def _plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["sequential", *RUNS]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    bars = ax.bar(names, [r[n] for n in names], color=["#999999", "#d62728", "#ff7f0e", "#2ca02c", "#1f77b4",
                                                        "#9467bd"])
    for bar, name in zip(bars, names):
        ax.annotate(f"{r[name] / r['dna']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("samples / s")
    ax.set_title(f"Pipe-BD on 2 processes ({EXAMPLE}, batch {BATCH}); ratios over DNA")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(r: dict) -> str:
    layouts, predicted = r["layouts"], r["predicted_samples_per_s"]
    rows = [("sequential (1 process, teacher once, every block in turn)", r["sequential"], None),
            ("DNA baseline (2 processes data-parallel, teacher re-run per block)", r["dna"], None),
            ("teacher relaying only (2 stages, a barrier after every batch)", r["relay"], None),
            (f"relaying + decoupled updates, 2 stages {layouts['two-stages']}", r["relay+decoupled"], "two-stages"),
            (f"Pipe-BD as planned: relaying + decoupled + replicas as chosen {layouts['as-planned']}", r["pipebd"],
             "as-planned"),
            (f"replicas only: one stage on both processes {layouts['one-stage-x2']}", r["replicas-only"],
             "one-stage-x2")]
    lines = [f"{EXAMPLE}, batch {BATCH}, 2 processes x 1 thread, gloo; {r['steps']} timed steps, median of "
             f"{r['rounds']} interleaved rounds; layouts are [blocks, replicas] per stage.", "",
             "| run | samples/s | vs DNA | planned samples/s |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {rate:.1f} | {rate / r['dna']:.2f}x | {f'{predicted[plan]:.0f}' if plan else '-'} |"
              for name, rate, plan in rows]
    ratios = r["ratios"]
    lines += ["", f"decoupled updates over relaying alone: {ratios['decoupled/relay']:.2f}x; "
              f"replicas as chosen over relaying + decoupled: {ratios['pipebd/relay+decoupled']:.2f}x", ""]
    return "\n".join(lines)


def section(*, quick: bool, out: Path) -> Section:
    """Pipe-BD against the DNA baseline, and the share of each technique."""
    steps, warmup, rounds = (6, 2, 1) if quick else (24, 3, 5)
    results = {"batch": BATCH, "steps": steps, "rounds": rounds,
               **compare(steps=steps, warmup=warmup, rounds=rounds, folder=out)}
    _plot(results, out / "distill.png")
    return Section(key="distill", title="Pipe-BD against the DNA baseline", results=results,
                   markdown=_markdown(results), figures=["distill.png"])


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure Pipe-BD against the 2-process baselines of blockwise distillation, and the share of relaying,
decoupling and replicas.

The baselines, each on 2 processes (one thread each, gloo):

- ``dna``: data-parallel blockwise distillation, the teacher re-run per block (``runtime="dna"``): for each
  batch, every block in turn, the teacher run from the input up to that block; the data read once per batch.
- ``dna-per-block``: DNA as published (``runtime="dna-per-block"``): each block trained over the whole data
  before the next, the data read again per block, the teacher run from the input up to that block.
- ``ddp-teacher-once``: DDP with the teacher run once: one stage holding every block, replicated on both
  processes (Pipe-BD's sequential single stage x 2); each process runs the whole teacher once per batch on its
  half and trains every student block on it, gradients all-reduced. Rank 0 reads each batch and sends the other
  process its half.

The headline is Pipe-BD as planned against the fastest of these in the same run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ppll_compile

from .launch import load_example, one_thread, spawn
from .report import Section, standalone

__all__ = ["main", "section", "compare", "RUNS", "BASELINES"]

BATCH = 32
EXAMPLE = "pipebd_mobilenet"
PLANS = {"two-stages": {"replicas": False}, "as-planned": {"replicas": True}, "one-stage-x2": {"replicas": (2,)}}
"""The plans compared, by their ``replicas`` option for 2 devices."""
RUNS = {
    "dna": ("dna", "two-stages", {}),
    "dna-per-block": ("dna-per-block", "two-stages", {}),
    "ddp-teacher-once": ("distributed", "one-stage-x2", {}),
    "relay": ("distributed", "two-stages", {"decoupled": False}),
    "relay+decoupled": ("distributed", "two-stages", {}),
    "pipebd": ("distributed", "as-planned", {}),
}
"""Name: (runtime, plan, trainer options); every run uses 2 processes, one thread each. The DNA runtimes train
every block on each process whatever the plan's stages."""
BASELINES = ("dna", "dna-per-block", "ddp-teacher-once")
"""The runs Pipe-BD is measured against; the others show the share of each technique."""
LABELS = {
    "sequential": "sequential (1 process, teacher once, every block in turn)",
    "dna": "baseline: data-parallel blockwise distillation, teacher re-run per block (runtime dna)",
    "dna-per-block": "baseline: DNA as published, block after block over the data, data re-read and teacher re-run "
                     "per block (runtime dna-per-block)",
    "ddp-teacher-once": "baseline: DDP with the teacher run once, one stage of every block on both processes",
    "relay": "teacher relaying only (decoupled=False), 2 stages",
    "relay+decoupled": "teacher relaying + decoupled updates, 2 stages",
    "pipebd": "Pipe-BD as planned: relaying + decoupled updates + replicas as chosen",
}
"""What each row of the table is."""
LAYOUT_OF = {"ddp-teacher-once": "one-stage-x2", "relay+decoupled": "two-stages", "pipebd": "as-planned"}
"""The rows whose plan's layout and predicted throughput the table shows."""


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


def _train(trainer: Any, runtime: str, data: list[torch.Tensor | None]) -> None:
    """Train on ``data``: batch by batch, or (``dna-per-block``, which needs the whole data) one more ``fit`` epoch
    (``epochs`` counts from the start of training)."""
    if runtime == "dna-per-block":
        trainer.fit([(x, None) for x in data], epochs=trainer.epoch + 1, progress=False)
        return
    for x in data:
        trainer.step(x)
    trainer.finish()


def _worker(rank: int, world: int, runtime: str, plan: str, options: dict, steps: int, warmup: int) -> dict:
    trainer = _compiled(plan=plan).trainer(optimizer=_sgd, runtime=runtime, **options)
    data = _batches(steps + warmup) if trainer.reads_data else [None] * (steps + warmup)
    _train(trainer, runtime, data[:warmup])
    dist.barrier()
    start = time.perf_counter()
    _train(trainer, runtime, data[warmup:])
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


def compare(*, steps: int, warmup: int, rounds: int, profile: str = "time") -> dict:
    """Samples/s of each run in :data:`RUNS` on 2 processes, plus one process running every block in turn.

    The plans of :data:`PLANS` are measured by time on this machine once (``profile="time"``: the teacher forward
    and student forward/backward of every block, at the whole batch and at half of it; or priced by another
    ``profile``), saved, and re-applied in every process. Each round runs every configuration once, in turn, so that
    a burst of load on the machine does not favour one; the figures are medians over the rounds. ``ratios`` holds
    Pipe-BD against the strongest baseline (``pipebd/best-baseline``, the fastest of :data:`BASELINES`) and against
    each.
    """
    with one_thread(), tempfile.TemporaryDirectory() as folder:
        paths, layouts, predicted = {}, {}, {}
        for name, options in PLANS.items():
            p = _compiled(gpus=2, profile=profile, **options).plan
            paths[name] = str(p.save(Path(folder) / f"plan-pipebd-{name}.json"))
            layouts[name] = [[list(s.blocks), s.replicas] for s in p.stages]
            predicted[name] = BATCH / p.bottleneck_cost
        runs: dict[str, list[float]] = {name: [] for name in ("sequential", *RUNS)}
        failures: list[str] = []
        for _ in range(rounds):
            runs["sequential"].append(_sequential(paths["two-stages"], steps, warmup))
            for name, (runtime, plan, options) in RUNS.items():
                for attempt in (1, 2):  # a rank that dies (e.g. aborts in gloo) gets one retry, counted
                    try:
                        done = spawn(_worker, 2, (runtime, paths[plan], options, steps, warmup), timeout=900)
                        break
                    except RuntimeError as e:
                        failures.append(f"{name}: {e}")
                        if attempt == 2:
                            raise RuntimeError(f"run {name!r} ({runtime}, plan {plan}, {options}) failed twice: "
                                               f"{failures[-2:]}") from e
                runs[name].append(done["samples_per_s"])
    out: dict[str, Any] = {name: statistics.median(v) for name, v in runs.items()}
    best = max(BASELINES, key=lambda name: out[name])
    out |= {"runs": runs, "layouts": layouts, "predicted_samples_per_s": predicted, "best_baseline": best,
            "failed_attempts": failures}
    out["ratios"] = {"pipebd/best-baseline": out["pipebd"] / out[best],
                     **{f"pipebd/{name}": out["pipebd"] / out[name] for name in BASELINES},
                     "decoupled/relay": out["relay+decoupled"] / out["relay"],
                     "pipebd/relay+decoupled": out["pipebd"] / out["relay+decoupled"]}
    return out


def _plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["sequential", *RUNS]
    best = r["best_baseline"]
    colors = {"sequential": "#999999", "dna": "#d62728", "dna-per-block": "#8c564b", "ddp-teacher-once": "#9467bd",
              "relay": "#ff7f0e", "relay+decoupled": "#2ca02c", "pipebd": "#1f77b4"}
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    bars = ax.bar(names, [r[n] for n in names], color=[colors[n] for n in names])
    for bar, name in zip(bars, names):
        ax.annotate(f"{r[name] / r[best]:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("samples / s")
    ax.set_title(f"Pipe-BD on 2 processes ({EXAMPLE}, batch {BATCH}); ratios over the strongest baseline ({best})",
                 fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(r: dict) -> str:
    layouts, predicted, ratios, best = r["layouts"], r["predicted_samples_per_s"], r["ratios"], r["best_baseline"]
    lines = [f"{EXAMPLE}, batch {BATCH}, 2 processes x 1 thread, gloo; {r['steps']} timed steps, median of "
             f"{r['rounds']} interleaved rounds; layouts are [blocks, replicas] per stage.", "",
             f"**Pipe-BD as planned: {r['pipebd']:.1f} samples/s, {ratios['pipebd/best-baseline']:.2f}x the strongest "
             f"2-process baseline in this run ({best}, {r[best]:.1f} samples/s)**; against each baseline: "
             + ", ".join(f"{name} {ratios[f'pipebd/{name}']:.2f}x" for name in BASELINES) + ".", "",
             f"| run | samples/s | vs strongest baseline ({best}) | layout | planned samples/s |",
             "|---|---:|---:|---|---:|"]
    for name in ("sequential", *RUNS):
        plan = LAYOUT_OF.get(name)
        layout = f"{layouts[plan]}" if plan else "-"
        lines.append(f"| {LABELS[name]} | {r[name]:.1f} | {r[name] / r[best]:.2f}x | {layout} | "
                     f"{f'{predicted[plan]:.0f}' if plan else '-'} |")
    lines += ["", "Baselines: *dna* trains every block on each batch in turn, re-running the teacher from the input "
              "for each block (data read once per batch); *dna-per-block* is DNA's published schedule, each block "
              "over the whole data before the next (the data read again per block); *ddp-teacher-once* runs the "
              "teacher once per batch on each process's half and trains every block (rank 0 reads each batch and "
              "sends the other process its half). All three are data-parallel over both processes.", "",
              f"Technique shares: decoupled updates over relaying alone {ratios['decoupled/relay']:.2f}x; replicas "
              f"as chosen over relaying + decoupled {ratios['pipebd/relay+decoupled']:.2f}x"
              + (" (the planner chose no replicas here: the same layout, 1.00x up to noise)."
                 if layouts["as-planned"] == layouts["two-stages"] else "."), ""]
    if r["failed_attempts"]:
        lines += [f"Runs retried after a rank died: {'; '.join(r['failed_attempts'])}.", ""]
    return "\n".join(lines)


def section(*, quick: bool, out: Path) -> Section:
    """Pipe-BD against the strongest 2-process baseline, and the share of each technique."""
    steps, warmup, rounds = (3, 1, 1) if quick else (24, 3, 5)
    profile = "roofline" if quick else "time"  # quick: plans priced, not timed
    results = {"batch": BATCH, "steps": steps, "rounds": rounds, "labels": LABELS, "profile": profile,
               **compare(steps=steps, warmup=warmup, rounds=rounds, profile=profile)}
    _plot(results, out / "distill.png")
    return Section(key="distill", title="Pipe-BD against the 2-process baselines", results=results,
                   markdown=_markdown(results), figures=["distill.png"])


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

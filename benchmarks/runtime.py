"""Throughput of the PPLL runtimes side by side with E2E backprop, sequential local learning and
torch.distributed.pipelining (GPipe, 1F1B); the simulator's prediction against each; memory per stage."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ppll_compile
from ppll_compile.allocator import keep_freed_memory
from ppll_compile.draw import draw_gantt
from ppll_compile.plans.plan import format_bytes

from .launch import load_example, one_thread, spawn, timed_steps
from .pipelining import best_pipelining
from .report import Section, standalone

__all__ = ["main", "section", "throughput", "calibration", "stage_memory", "stage_messages", "gloo_bandwidth", "sgd"]

BATCH = 64
POLICY = {"resnet32": "dgl", "resnet18_cifar": "dgl", "vit_small": "vit"}
RUNTIMES = ("e2e", "sequential", "threads", "distributed")
CORES = os.cpu_count() or 1
"""Cores the simulated stages share (the pipelines here run on this machine's CPU)."""
LOCAL_LINK = 1e13
"""Bytes/s the simulator assumes between threads of one process (a queue hands over a reference)."""


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum, the optimizer of every PPLL throughput and balance measurement."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _compiled(model: str, k: int, seed: int = 0, **options: Any) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(seed)
    module = load_example(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU fallback
        return ppll_compile.compile(module.build_model(10), k, example_inputs=module.example_inputs(),
                                    policy=POLICY[model], **options)


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(n)]


def _e2e(model: str, data: list, warmup: int) -> float:
    """Plain end-to-end backprop on one thread: the single-device reference."""
    keep_freed_memory()  # as every runtime does, so that the comparison is fair
    torch.manual_seed(0)
    net = load_example(model).build_model(10)
    opt = sgd(list(net.parameters()))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()

    for x, y in data[:warmup]:
        step(x, y)
    start = time.perf_counter()
    for x, y in data[warmup:]:
        step(x, y)
    return (len(data) - warmup) * BATCH / (time.perf_counter() - start)


def _distributed_worker(rank: int, world: int, model: str, steps: int, warmup: int, plan: str) -> dict:
    trainer = _compiled(model, world, plan=plan).trainer(optimizer=sgd, runtime="distributed")
    data = _batches(steps + warmup) if rank == 0 else [(None, None)] * (steps + warmup)
    with trainer:
        for x, y in data[:warmup]:
            trainer.step(x, y)
        trainer.finish()
        dist.barrier()
        start = time.perf_counter()
        for x, y in data[warmup:]:
            trainer.step(x, y)
        trainer.finish()
        dist.barrier()
        elapsed = time.perf_counter() - start
    return {"samples_per_s": steps * BATCH / elapsed} if rank == 0 else {}


def _bandwidth_worker(rank: int, world: int, nbytes: int, repeat: int) -> dict:
    t = torch.zeros(nbytes // 4)
    for i in range(repeat + 1):
        if i == 1:
            dist.barrier()
            start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
    dist.barrier()
    return {"bytes_per_s": repeat * nbytes / (time.perf_counter() - start)} if rank == 0 else {}


def gloo_bandwidth(nbytes: int = 4 << 20, repeat: int = 20) -> float:
    """Bytes per second of a blocking gloo send between two processes on this machine."""
    return spawn(_bandwidth_worker, 2, (nbytes, repeat), timeout=120)["bytes_per_s"]


def throughput(model: str, k: int, *, steps: int, warmup: int, rounds: int, microbatches: tuple[int, ...],
               folder: Path, bandwidth: float) -> dict:
    """Samples/s of E2E, sequential local learning, PPLL threads and distributed, and the best torch schedule,
    next to the simulator's prediction for the pipelined runtimes.

    Every pipeline (ours and torch's) uses the same cuts: the default (roofline) plan for SGD with momentum,
    saved once and re-applied in every process. Each round runs every configuration once, in turn, so that a
    burst of load on the machine does not favour one; figures are medians.
    """
    with one_thread():
        plan_obj = _compiled(model, k, optimizer="momentum").plan
        plan = str(plan_obj.save(folder / f"plan-{model}-{k}.json"))
        data = _batches(steps + warmup)
        runs: dict[str, list[float]] = {name: [] for name in RUNTIMES}
        for _ in range(rounds):
            runs["e2e"].append(_e2e(model, data, warmup))
            runs["sequential"].append(timed_steps(_compiled(model, k, plan=plan).trainer(optimizer=sgd), data,
                                                 warmup))
            runs["threads"].append(timed_steps(_compiled(model, k, plan=plan).trainer(
                optimizer=sgd, runtime="threads", threads_per_stage=1), data, warmup))
            runs["distributed"].append(spawn(_distributed_worker, k, (model, steps, warmup, plan),
                                             timeout=300 + 20 * (steps + warmup))["samples_per_s"])
    out: dict[str, Any] = {name: statistics.median(v) for name, v in runs.items()}
    out |= {"runs": runs, "cuts": list(plan_obj.cuts), "stage_ms": [s.cost * 1e3 for s in plan_obj.stages]}
    torch_runs = best_pipelining(model, microbatch_counts=microbatches, steps=steps, warmup=warmup, world=k,
                                 plan=plan)
    out["torch"] = {s: torch_runs[s] for s in ("gpipe", "1f1b") if s in torch_runs}
    out["torch_all"] = torch_runs["all"]
    best = max(out["torch"].values(), key=lambda r: r["samples_per_s"])["samples_per_s"]
    n = steps + warmup
    out["predicted"] = {
        "sequential": plan_obj.batch_size / plan_obj.sequential_cost,
        "threads": ppll_compile.simulate(plan_obj, steps=n, link_bandwidth=LOCAL_LINK, cores=CORES).throughput,
        "distributed": ppll_compile.simulate(plan_obj, steps=n, link_bandwidth=bandwidth, cores=CORES).throughput,
    }
    out["ratios"] = {
        "threads/sequential": out["threads"] / out["sequential"],
        "distributed/sequential": out["distributed"] / out["sequential"],
        "threads/best_torch": out["threads"] / best,
        "distributed/best_torch": out["distributed"] / best,
    }
    return out


def _traced_timeline(model: str, k: int, plan: str, steps: int) -> Any:
    """The measured timeline of ``steps`` batches in the threads runtime."""
    with one_thread():
        with _compiled(model, k, plan=plan).trainer(optimizer=sgd, runtime="threads", threads_per_stage=1,
                                                    trace=True) as trainer:
            for x, y in _batches(steps):
                trainer.step(x, y)
            trainer.finish()
            return trainer.timeline()


def calibration(model: str, k: int, plan: str, *, steps: int, warmup: int) -> tuple[dict, Any]:
    """Where the simulator's error comes from: a traced threads run's per-stage compute time per batch against
    the plan's stage costs, and the simulation fed with the measured times against the traced throughput.

    Returns the figures and the timeline.
    """
    timeline = _traced_timeline(model, k, plan, steps + warmup)
    compute = ("forward", "backward", "step")
    busy = [statistics.median(sum(e.duration for e in timeline.events if e.stage == j and e.batch == b
                                  and e.kind in compute) for b in range(warmup, steps + warmup)) for j in range(k)]
    ends = sorted(e.end for e in timeline.events if e.stage == k - 1 and e.kind == "step")
    half = (steps + warmup) // 2
    traced = BATCH * (len(ends) - half) / (ends[-1] - ends[half - 1])  # the simulator's steady-state window
    planned = ppll_compile.Plan.load(plan)
    measured_plan = dataclasses.replace(planned, stages=tuple(
        dataclasses.replace(s, compute_cost=t, cost=t + s.comm_cost) for s, t in zip(planned.stages, busy)))
    return {"stage_ms_planned": [s.cost * 1e3 for s in planned.stages], "stage_ms_measured": [t * 1e3 for t in busy],
            "traced": traced,
            "simulated": ppll_compile.simulate(planned, steps=steps + warmup, link_bandwidth=LOCAL_LINK,
                                               cores=CORES).throughput,
            "simulated_from_measured": ppll_compile.simulate(measured_plan, steps=steps + warmup,
                                                             link_bandwidth=LOCAL_LINK).throughput}, timeline


def stage_messages(trainer: Any, x: torch.Tensor, y: torch.Tensor) -> list[Any]:
    """The message each stage receives for batch (x, y), made by running the stages before it."""
    msgs = [trainer.message(x, y)]
    for r in trainer.runners[:-1]:
        msgs.append(r.train_step(msgs[-1])[0])
    return msgs


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def stage_memory(model: str, k: int) -> list[dict]:
    """Per stage: live bytes of parameters, gradients, optimizer state and saved activations vs the plan's figure."""
    compiled = _compiled(model, k, optimizer="momentum")
    trainer = compiled.trainer(optimizer=sgd)
    msgs = stage_messages(trainer, *_batches(1)[0])
    rows = []
    for r, msg, sp in zip(trainer.runners, msgs, compiled.plan.stages):
        r.train_step(msg)  # gradients and momentum buffers exist from here on
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out, loss = r.forward_loss(msg)
        params = r.params
        state = [v for s in r.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        measured = (_storage_bytes(params) + _storage_bytes(p.grad for p in params) + _storage_bytes(state)
                    + _storage_bytes(saved))
        del loss, out
        rows.append({"stage": r.index, "measured_bytes": measured, "planned_bytes": sp.memory_bytes,
                     "measured/planned": measured / sp.memory_bytes})
    return rows


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    names = [*RUNTIMES, "gpipe", "1f1b"]
    fig, ax = plt.subplots(figsize=(3.6 + 1.9 * len(keys), 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [results[key][name] if name in RUNTIMES else results[key]["torch"].get(name, {}).get(
            "samples_per_s", 0.0) for key in keys]
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(keys))], values, width,
               label=name if name in RUNTIMES else f"torch {name} (best mb)")
    for j, key in enumerate(keys):
        for name, offset in (("sequential", 1), ("threads", 2), ("distributed", 3)):
            ax.plot(j + (offset - (len(names) - 1) / 2) * width, results[key]["predicted"][name], "k_",
                    markersize=14, markeredgewidth=2)
    ax.plot([], [], "k_", markersize=14, markeredgewidth=2, label="simulated (plan)")
    ax.set_xticks(range(len(keys)), [k.replace("-", ", K=") for k in keys])
    ax.set_ylabel("samples / s")
    ax.set_title(f"Training throughput, batch {BATCH}, one thread per stage")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(*, quick: bool, out: Path) -> Section:
    """Throughput of every runtime for ResNet-32, resnet18 at 32x32 and the small ViT at K=2, and ResNet-32 at K=4
    (``quick``: ResNet-32 at K=2, a few steps): at least 40 steps, so that filling the pipeline does not cap the
    ratios."""
    steps, warmup, rounds = (4, 2, 1) if quick else (40, 5, 3)
    counts = (2,) if quick else (1, 2, 4, 8)
    configs = [("resnet32", 2)] if quick else [(m, 2) for m in POLICY] + [("resnet32", 4)]
    bandwidth = gloo_bandwidth()
    results = {f"{m}-{k}": throughput(m, k, steps=steps, warmup=warmup, rounds=rounds, microbatches=counts,
                                      folder=out, bandwidth=bandwidth) for m, k in configs}
    _plot(results, out / "throughput.png")
    figures = ["throughput.png"]
    timelines = {}
    for m, k in configs:
        results[f"{m}-{k}"]["calibration"], timelines[f"{m}-{k}"] = calibration(
            m, k, str(out / f"plan-{m}-{k}.json"), steps=steps, warmup=warmup)
    timeline = timelines["resnet32-2"]
    timeline.save(out / "trace-resnet32-2.json")
    simulated = ppll_compile.simulate(ppll_compile.Plan.load(out / "plan-resnet32-2.json"), steps=len(
        {e.batch for e in timeline.events}), link_bandwidth=LOCAL_LINK).timeline
    draw_gantt(timeline, out / "gantt_measured.png", title="ResNet-32, K=2, threads runtime: measured", batches=6)
    draw_gantt(simulated, out / "gantt_simulated.png", title="ResNet-32, K=2: simulated from the plan", batches=6)
    figures += ["gantt_measured.png", "gantt_simulated.png"]
    memory = stage_memory("resnet32", 4)
    res = {"batch": BATCH, "steps": steps, "warmup": warmup, "rounds": rounds, "gloo_bytes_per_s": bandwidth,
           "throughput": results, "memory": memory}
    return Section(key="throughput", title="Throughput: PPLL against E2E, sequential local learning and "
                   "torch.distributed.pipelining", results=res, markdown=_markdown(res), figures=figures)


def _markdown(res: dict) -> str:
    lines = [f"Batch {res['batch']}, {res['steps']} timed steps after {res['warmup']} warm-up steps, median of "
             f"{res['rounds']} interleaved rounds; one thread per stage (per rank), SGD momentum; policies "
             f"{', '.join(f'{m} {p}' for m, p in POLICY.items())}. Every pipeline (ours and torch's) uses the same "
             f"cuts, the default (roofline) plan for SGD with momentum on this machine. K=4 runs 4 stages on 2 "
             f"cores, so it shows correctness and overheads, not parallel speed. Samples/s:", "",
             "| model | K | E2E 1 core | sequential LL | PPLL threads | PPLL distributed | best torch pipelining "
             "| threads/seq | dist/seq | threads/torch | dist/torch |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for key, t in res["throughput"].items():
        model, k = key.rsplit("-", 1)
        name, best = max(t["torch"].items(), key=lambda kv: kv[1]["samples_per_s"])
        r = t["ratios"]
        lines.append(f"| {model} | {k} | {t['e2e']:.1f} | {t['sequential']:.1f} | {t['threads']:.1f} | "
                     f"{t['distributed']:.1f} | {best['samples_per_s']:.1f} ({name}, {best['microbatches']} mb) | "
                     f"{r['threads/sequential']:.2f}x | {r['distributed/sequential']:.2f}x | "
                     f"{r['threads/best_torch']:.2f}x | {r['distributed/best_torch']:.2f}x |")
    lines += ["", f"Simulated from each plan (`ppll_compile.simulate` with the roofline costs alone, the stages "
              f"sharing this machine's {CORES} cores; distributed with the measured gloo bandwidth "
              f"{res['gloo_bytes_per_s'] / 1e9:.2f} GB/s) against measured, samples/s:", "",
              "| model | K | runtime | simulated | measured | measured/simulated |", "|---|---|---|---:|---:|---:|"]
    for key, t in res["throughput"].items():
        model, k = key.rsplit("-", 1)
        for name in ("sequential", "threads", "distributed"):
            p = t["predicted"][name]
            lines.append(f"| {model} | {k} | {name} | {p:.1f} | {t[name]:.1f} | {t[name] / p:.2f} |")
    lines += ["", "Where the difference comes from: a traced run of the threads runtime gives each stage's compute "
              "(forward, backward, optimizer step) per batch while the stages run together, against the plan's "
              "stage cost, measured with each stage alone; the simulator fed with the measured times is then "
              "compared with the traced run's own throughput (steady state, samples/s):", "",
              "| model | K | plan's stage ms | measured stage ms | simulated | simulated from measured | traced | "
              "traced/simulated from measured |", "|---|---|---|---|---:|---:|---:|---:|"]
    for key, t in res["throughput"].items():
        model, k = key.rsplit("-", 1)
        c = t["calibration"]
        lines.append(f"| {model} | {k} | {', '.join(f'{v:.0f}' for v in c['stage_ms_planned'])} | "
                     f"{', '.join(f'{v:.0f}' for v in c['stage_ms_measured'])} | {c['simulated']:.1f} | "
                     f"{c['simulated_from_measured']:.1f} | {c['traced']:.1f} | "
                     f"{c['traced'] / c['simulated_from_measured']:.2f} |")
    lines += ["", "Every torch.distributed.pipelining run (samples/s by schedule and microbatch count):", "",
              "| model | K | schedule | microbatches | samples/s | note |", "|---|---|---|---:|---:|---|"]
    for key, t in res["throughput"].items():
        model, k = key.rsplit("-", 1)
        for row in t["torch_all"]:
            rate = "-" if row["samples_per_s"] is None else f"{row['samples_per_s']:.1f}"
            lines.append(f"| {model} | {k} | {row['schedule']} | {row['microbatches']} | {rate} | "
                         f"{row.get('skipped', '')} |")
    lines += ["", "Cuts: " + "; ".join(f"{key}: {', '.join(t['cuts'])}" for key, t in res["throughput"].items()),
              "", "Memory per stage, ResNet-32, K=4 (live parameters, gradients, optimizer state and saved "
              "activations vs the plan):", "", "| stage | measured | planned | measured/planned |",
              "|---|---:|---:|---:|"]
    for m in res["memory"]:
        lines.append(f"| {m['stage']} | {format_bytes(m['measured_bytes'])} | {format_bytes(m['planned_bytes'])} "
                     f"| {m['measured/planned']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure the PPLL runtimes against sequential local learning and torch.distributed.pipelining, stage balance and memory."""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ppll_compile
from ppll_compile.plan import format_bytes

from .launch import load_example, spawn
from .pipelining import best_pipelining
from .report import environment, write

__all__ = ["main", "throughput", "stage_balance", "stage_memory"]

BATCH = 64
POLICY = {"resnet32": "dgl", "vit_small": "vit"}


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
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


def _timed_fit(trainer: Any, data: list, warmup: int) -> float:
    """Samples per second of ``trainer`` over ``data`` after ``warmup`` batches, pipeline drained at both ends."""
    for x, y in data[:warmup]:
        trainer.step(x, y)
    trainer.finish()
    start = time.perf_counter()
    for x, y in data[warmup:]:
        trainer.step(x, y)
    trainer.finish()
    return (len(data) - warmup) * BATCH / (time.perf_counter() - start)


def _e2e(model: str, data: list, warmup: int) -> float:
    """Plain end-to-end backprop on one thread: the single-device reference."""
    torch.manual_seed(0)
    net = load_example(model).build_model(10)
    opt = _sgd(list(net.parameters()))

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


def _distributed_worker(rank: int, world: int, model: str, steps: int, warmup: int, rounds: int,
                        plan: str) -> dict:
    compiled = _compiled(model, world, plan=plan)
    trainer = compiled.trainer(optimizer=_sgd, runtime="distributed")
    data = _batches(steps + warmup) if rank == 0 else [(None, None)] * (steps + warmup)
    for x, y in data[:warmup]:
        trainer.step(x, y)
    trainer.finish()
    rates = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for x, y in data[warmup:]:
            trainer.step(x, y)
        trainer.finish()
        dist.barrier()
        rates.append(steps * BATCH / (time.perf_counter() - start))
    trainer.close()
    return {"samples_per_s": statistics.median(rates)} if rank == 0 else {}


def throughput(model: str, *, k: int = 2, steps: int, warmup: int, rounds: int,
               microbatches: tuple[int, ...], folder: Path) -> dict:
    """Samples/s of E2E, sequential local learning, PPLL threads and distributed, and the best torch schedule.

    Every pipeline (ours and torch's) uses the same cuts: a plan measured by time on this machine
    (``profile="time"``), saved once and re-applied in every process. The one-process figures are medians of
    ``rounds`` alternating runs, so a burst of load on the machine does not favour one of them.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = str(_compiled(model, k, profile="time").plan.save(folder / f"plan-{model}-{k}.json"))
        data = _batches(steps + warmup)
        runs: dict[str, list[float]] = {"e2e": [], "sequential": [], "threads": []}
        for _ in range(rounds):
            runs["e2e"].append(_e2e(model, data, warmup))
            runs["sequential"].append(_timed_fit(_compiled(model, k, plan=plan).trainer(optimizer=_sgd), data,
                                                 warmup))
            runs["threads"].append(_timed_fit(_compiled(model, k, plan=plan).trainer(
                optimizer=_sgd, runtime="threads", threads_per_stage=1), data, warmup))
        out: dict[str, Any] = {name: statistics.median(v) for name, v in runs.items()}
    finally:
        torch.set_num_threads(threads)
    out["cuts"] = list(ppll_compile.Plan.load(plan).cuts)
    out["distributed"] = spawn(_distributed_worker, k, (model, steps, warmup, rounds, plan),
                               timeout=300 + 20 * (steps * rounds + warmup))["samples_per_s"]
    torch_best = best_pipelining(model, microbatch_counts=microbatches, steps=steps, warmup=warmup, world=k,
                                 plan=plan)
    out["torch"] = {s: torch_best[s] for s in ("gpipe", "1f1b") if s in torch_best}
    best = max(out["torch"].values(), key=lambda r: r["samples_per_s"])
    out["ratios"] = {
        "threads/sequential": out["threads"] / out["sequential"],
        "distributed/sequential": out["distributed"] / out["sequential"],
        "threads/best_torch": out["threads"] / best["samples_per_s"],
        "distributed/best_torch": out["distributed"] / best["samples_per_s"],
    }
    return out


def _stage_messages(trainer: Any, x: torch.Tensor, y: torch.Tensor) -> list[Any]:
    """The message each stage receives for batch (x, y), made by running the stages before it."""
    msgs = [trainer._message(x, y, "train")]
    for r in trainer.runners[:-1]:
        msgs.append(r.train_step(msgs[-1])[0])
    return msgs


def stage_balance(model: str, k: int, partitioner: str, repeat: int, profile: str = "flops") -> dict:
    """Each stage's measured step time (block + head, forward, backward, optimizer), timed alone; max/mean."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compiled = _compiled(model, k, partitioner=partitioner, profile=profile)
        trainer = compiled.trainer(optimizer=_sgd)
        msgs = _stage_messages(trainer, *_batches(1)[0])
        times = []
        for r, msg in zip(trainer.runners, msgs):
            r.train_step(msg)  # warm-up
            samples = []
            for _ in range(repeat):
                start = time.perf_counter()
                r.train_step(msg)
                samples.append(time.perf_counter() - start)
            times.append(statistics.median(samples))
    finally:
        torch.set_num_threads(threads)
    predicted = [s.cost for s in compiled.plan.stages]
    return {"partitioner": partitioner, "profile": profile, "cuts": list(compiled.plan.cuts), "seconds": times,
            "max_over_mean": max(times) / statistics.mean(times),
            "predicted_max_over_mean": max(predicted) / statistics.mean(predicted)}


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def stage_memory(model: str, k: int) -> list[dict]:
    """Per stage: live bytes of parameters, gradients, optimizer state and saved activations vs the plan's figure."""
    compiled = _compiled(model, k)
    trainer = compiled.trainer(optimizer=_sgd)
    msgs = _stage_messages(trainer, *_batches(1)[0])
    rows = []
    for r, msg, sp in zip(trainer.runners, msgs, compiled.plan.stages):
        r.train_step(msg)  # gradients and momentum buffers exist from here on
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            values, target, raw = r._receive(msg)
            out = r.stage(*values)
            loss = r.loss(out, target, raw)
        params = r.params
        state = [v for s in r.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        measured = (_storage_bytes(params) + _storage_bytes(p.grad for p in params) + _storage_bytes(state)
                    + _storage_bytes(saved))
        del loss, out
        rows.append({"stage": r.index, "measured_bytes": measured, "planned_bytes": sp.memory_bytes,
                     "measured/planned": measured / sp.memory_bytes})
    return rows


def _markdown(res: dict) -> str:
    lines = [f"Measured {res['date']} on {res['machine']} (torch {res['torch']}); batch {BATCH}, "
             f"{res['steps']} timed steps (one-process figures: median of 3 alternating runs), one thread per "
             f"stage, SGD momentum; policies {', '.join(f'{m} {p}' for m, p in POLICY.items())}; every pipeline "
             f"(ours and torch's) uses the same cuts, planned with profile=\"time\" on this machine.", "",
             "| model | E2E 1 dev | sequential LL | PPLL threads | PPLL distributed | best torch pipelining "
             "| threads/seq | dist/seq | dist/torch |", "|---|---|---|---|---|---|---|---|---|"]
    for name, t in res["throughput"].items():
        best = max(t["torch"].items(), key=lambda kv: kv[1]["samples_per_s"])
        r = t["ratios"]
        lines.append(f"| {name} | {t['e2e']:.1f} | {t['sequential']:.1f} | {t['threads']:.1f} | "
                     f"{t['distributed']:.1f} | {best[1]['samples_per_s']:.1f} ({best[0]}, "
                     f"{best[1]['microbatches']} mb) | {r['threads/sequential']:.2f}x | "
                     f"{r['distributed/sequential']:.2f}x | {r['distributed/best_torch']:.2f}x |")
    lines += [""] + [f"{name} cut after {', '.join(t['cuts'])}." for name, t in res["throughput"].items()]
    lines += ["", "Per-stage step time, ResNet-32, K=4, dgl (measured alone in the sequential runtime):", "",
              "| partitioner | profile | stage times (ms) | measured max/mean | predicted max/mean |",
              "|---|---|---|---|---|"]
    for b in res["balance"]:
        times = ", ".join(f"{1e3 * s:.1f}" for s in b["seconds"])
        lines.append(f"| {b['partitioner']} | {b['profile']} | {times} | {b['max_over_mean']:.3f} | "
                     f"{b['predicted_max_over_mean']:.3f} |")
    lines += ["", "Memory per stage, ResNet-32, K=4 (live parameters, gradients, optimizer state and saved "
              "activations vs the plan):", "", "| stage | measured | planned | measured/planned |",
              "|---|---|---|---|"]
    for m in res["memory"]:
        lines.append(f"| {m['stage']} | {format_bytes(m['measured_bytes'])} | {format_bytes(m['planned_bytes'])} "
                     f"| {m['measured/planned']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet32", "vit_small"], choices=list(POLICY))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="few steps, microbatch counts 2 and 4 only")
    parser.add_argument("--out", default="results", help="folder for runtime.json and runtime.md")
    args = parser.parse_args(argv)
    steps = args.steps or (5 if args.quick else 20)
    warmup = 2 if args.quick else 4
    counts = (2, 4) if args.quick else (1, 2, 4, 8)
    rounds = 1 if args.quick else 3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        **environment("1 thread per stage"), "steps": steps,
        "throughput": {m: throughput(m, steps=steps, warmup=warmup, rounds=rounds, microbatches=counts,
                                     folder=out) for m in args.models},
        "balance": [stage_balance("resnet32", 4, p, repeat=5 if args.quick else 15, profile=f)
                    for p, f in (("exact", "flops"), ("exact", "time"), ("uniform", "flops"))],
        "memory": stage_memory("resnet32", 4),
    }
    write(out, "runtime", res, _markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

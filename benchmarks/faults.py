"""Minor page faults per step and samples/s of ResNet-18 in 2 stages with the allocator setting off
(``PPLL_MALLOC=default``) and on, under the sequential, threads and distributed runtimes; and the step time of
SGD with momentum in its three implementations (for-loop, foreach, fused) on the second stage."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ppll_compile
from ppll_compile.allocator import ENV, SETTINGS

from .launch import one_thread, spawn
from .report import Section, standalone
from .runtime import stage_messages

__all__ = ["StageFaults", "main", "measure", "optimizer_step_times", "section"]

BATCH = 32
SIZE = 32
RUNTIMES = ("sequential", "threads", "distributed")
SETTINGS_COMPARED = ("default", "keep")
"""The values of ``PPLL_MALLOC`` compared: glibc's defaults (before) and the allocator setting (after)."""
OPTIMIZERS = {"foreach=False": {"foreach": False}, "foreach=True": {"foreach": True}, "fused=True": {"fused": True}}
"""SGD(momentum=0.9) implementations whose step time on the second stage is measured."""


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, torch's default implementation (foreach on CPU)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _compiled(plan: str | None = None) -> ppll_compile.CompiledPipeline:
    import torchvision

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU fallback
        return ppll_compile.compile(torchvision.models.resnet18(num_classes=10), 2,
                                    example_inputs=(torch.randn(BATCH, 3, SIZE, SIZE),), policy="dgl", plan=plan)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 3, SIZE, SIZE, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(n)]


def _thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _process_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class StageFaults:
    """Minor faults of the thread that runs each stage, read after every optimizer step (a torch step hook).

    A stage's count for a step is the thread's faults since the thread's previous reading: under ``threads``
    and ``distributed`` its whole step; under ``sequential`` (every stage in one thread) the work since the
    stage before it stepped.
    """

    def __init__(self, trainer: Any) -> None:
        self._events: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self._lock = threading.Lock()
        for r in trainer.runners:
            for o in r.optimizers:
                o.register_step_post_hook(self._hook(r.index))

    def _hook(self, stage: int) -> Any:
        def read(*_: Any) -> None:
            with self._lock:
                self._events[threading.get_native_id()].append((stage, _thread_faults()))
        return read

    def clear(self) -> None:
        """Forget the readings so far (the warm-up steps)."""
        with self._lock:
            self._events.clear()

    def per_step(self) -> dict[int, float]:
        """Per stage, its mean faults per step since :meth:`clear` (a mean: glibc's trims come in bursts that a
        median would hide)."""
        counts: dict[int, list[int]] = defaultdict(list)
        for events in self._events.values():
            for (_, before), (stage, after) in pairwise(events):
                counts[stage].append(after - before)
        return {stage: statistics.fmean(c) for stage, c in sorted(counts.items())}


def _train(trainer: Any, data: list, faults: StageFaults) -> tuple[float, float]:
    """Samples/s and process faults per step over ``data`` (the pipeline drained at the end)."""
    faults.clear()
    f0, t0 = _process_faults(), time.perf_counter()
    for x, y in data:
        trainer.step(x, y)
    trainer.finish()
    return BATCH * len(data) / (time.perf_counter() - t0), (_process_faults() - f0) / len(data)


def optimizer_step_times(trainer: Any, repeat: int) -> dict[str, float | None]:
    """Milliseconds of one ``step()`` of SGD(momentum=0.9) on the second stage's gradients, per implementation
    (median of ``repeat``, the variants taking turns); ``None`` where this torch lacks one."""
    x, y = _batches(1)[0]
    r = trainer.runners[1]
    _, loss = r.forward_loss(stage_messages(trainer, x, y)[1])
    loss.backward()
    params = [p for p in r.params if p.grad is not None]
    opts: dict[str, torch.optim.Optimizer | None] = {}
    for name, kw in OPTIMIZERS.items():
        try:
            opts[name] = torch.optim.SGD(params, lr=1e-4, momentum=0.9, **kw)
        except (RuntimeError, ValueError):
            opts[name] = None
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(repeat + 3):  # the first steps make the momentum buffers
        for name, o in opts.items():
            if o is None:
                continue
            t0 = time.perf_counter()
            o.step()
            if i >= 3:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) if t else None for name, t in times.items()}


def _local(runtime: str, plan: str, steps: int, warmup: int, repeat: int) -> dict:
    """One measurement in this process (``sequential`` or ``threads``), one torch thread per stage."""
    with one_thread():
        trainer = _compiled(plan).trainer(optimizer=sgd, runtime=runtime, threads_per_stage=1)
        faults = StageFaults(trainer)
        data = _batches(steps + warmup)
        with trainer:
            _train(trainer, data[:warmup], faults)
            rate, process = _train(trainer, data[warmup:], faults)
            out = {"samples_per_s": rate, "stage_faults": faults.per_step(), "process_faults": process}
            if runtime == "sequential" and repeat:
                out["optimizer_ms"] = optimizer_step_times(trainer, repeat)
    return out


def _rank(rank: int, world: int, plan: str, steps: int, warmup: int) -> dict:
    """One rank of the ``distributed`` measurement: its stage's faults per step; rank 0 also the samples/s, timed
    between barriers as :mod:`benchmarks.runtime` times this runtime."""
    trainer = _compiled(plan).trainer(optimizer=sgd, runtime="distributed")
    faults = StageFaults(trainer)
    data = _batches(steps + warmup) if trainer.reads_data else [(None, None)] * (steps + warmup)
    with trainer:
        for x, y in data[:warmup]:
            trainer.step(x, y)
        trainer.finish()
        dist.barrier()
        faults.clear()
        f0, t0 = _process_faults(), time.perf_counter()
        for x, y in data[warmup:]:
            trainer.step(x, y)
        trainer.finish()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        process = (_process_faults() - f0) / steps
    out: dict[str, Any] = {f"stage_faults_{rank}": faults.per_step(), f"process_faults_{rank}": process}
    return out | ({"samples_per_s": steps * BATCH / elapsed} if rank == 0 else {})


def _distributed(plan: str, steps: int, warmup: int) -> dict:
    """The ``distributed`` measurement on 2 spawned ranks (gloo, one thread each)."""
    done = spawn(_rank, 2, (plan, steps, warmup), timeout=300 + 20 * (steps + warmup))
    stages: dict[int, float] = {}
    for r in range(2):
        stages |= done[f"stage_faults_{r}"]
    return {"samples_per_s": done["samples_per_s"], "stage_faults": stages,
            "process_faults": sum(done[f"process_faults_{r}"] for r in range(2))}


def _measure_here(runtime: str, plan: str, steps: int, warmup: int, repeat: int) -> dict:
    if runtime == "distributed":
        return _distributed(plan, steps, warmup)
    return _local(runtime, plan, steps, warmup, repeat)


def measure(runtime: str, setting: str, plan: str, *, steps: int, warmup: int, repeat: int = 0) -> dict:
    """One measurement in a fresh process (the allocator's state is per process) with ``PPLL_MALLOC=setting``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env[ENV] = setting
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "benchmarks.faults", "--worker", runtime, "--plan", plan, "--steps", str(steps),
           "--warmup", str(warmup), "--repeat", str(repeat)]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{runtime} with {ENV}={setting} failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["stage_faults"] = {int(k): v for k, v in out["stage_faults"].items()}
    return out


def compare(*, steps: int, warmup: int, rounds: int, repeat: int) -> dict:
    """Every runtime with the setting off and on, in interleaved rounds (the order of the two alternating);
    medians over the rounds. The default plan of ResNet-18 for 2 devices, made once and re-applied everywhere."""
    with tempfile.TemporaryDirectory() as folder:
        plan_obj = _compiled().plan
        plan = str(plan_obj.save(Path(folder) / "plan-resnet18-2.json"))
        runs: dict[str, dict[str, list[dict]]] = {rt: {s: [] for s in SETTINGS_COMPARED} for rt in RUNTIMES}
        for i in range(rounds):
            for rt in RUNTIMES:
                for s in SETTINGS_COMPARED[:: 1 if i % 2 == 0 else -1]:
                    runs[rt][s].append(measure(rt, s, plan, steps=steps, warmup=warmup, repeat=repeat))
    results: dict[str, Any] = {}
    for rt in RUNTIMES:
        results[rt] = {}
        for s, got in runs[rt].items():
            stages = sorted({k for g in got for k in g["stage_faults"]})
            results[rt][s] = {
                "samples_per_s": statistics.median(g["samples_per_s"] for g in got),
                "stage_faults": [statistics.median(g["stage_faults"][k] for g in got) for k in stages],
                "process_faults": statistics.median(g["process_faults"] for g in got),
                "runs": [{"samples_per_s": g["samples_per_s"], "stage_faults": [g["stage_faults"][k] for k in stages],
                          "process_faults": g["process_faults"]} for g in got]}
        results[rt]["speedup"] = results[rt]["keep"]["samples_per_s"] / results[rt]["default"]["samples_per_s"]
    optimizer = {s: {name: statistics.median(v for g in runs["sequential"][s] if (v := g["optimizer_ms"][name])
                                             is not None) if any(g["optimizer_ms"][name] is not None
                                                                 for g in runs["sequential"][s]) else None
                     for name in OPTIMIZERS} for s in SETTINGS_COMPARED}
    return {"batch": BATCH, "size": SIZE, "steps": steps, "warmup": warmup, "rounds": rounds,
            "optimizer_repeat": repeat, "cuts": list(plan_obj.cuts), "settings": dict(SETTINGS),
            "runtimes": results, "optimizer_ms": optimizer}


def _markdown(res: dict) -> str:
    lines = [f"torchvision ResNet-18 (10 classes), {res['size']}x{res['size']} inputs, batch {res['batch']}, 2 stages "
             f"(default plan, cuts {', '.join(res['cuts'])}), policy dgl, SGD momentum 0.9; one torch thread per "
             f"stage; {res['steps']} timed steps after {res['warmup']}, median of {res['rounds']} interleaved rounds, "
             f"each run in a fresh process. *Before*: `PPLL_MALLOC=default` (glibc's defaults); *after*: the "
             f"allocator setting ({', '.join(f'{k}={v >> 20} MiB' for k, v in res['settings'].items())}). Minor "
             f"page faults per step (mean over the timed steps) of the thread running each stage (read after "
             f"each optimizer step), of the whole process (all ranks under distributed), and samples/s:", "",
             "| runtime | allocator | faults/step stage 0 | faults/step stage 1 | faults/step process | samples/s "
             "| after/before |", "|---|---|---:|---:|---:|---:|---:|"]
    for rt, r in res["runtimes"].items():
        for s in SETTINGS_COMPARED:
            f = r[s]["stage_faults"]
            ratio = f"{r['speedup']:.2f}x" if s == "keep" else ""
            lines.append(f"| {rt} | {'before' if s == 'default' else 'after'} | "
                         + " | ".join(f"{v:,.0f}" for v in f) + f" | {r[s]['process_faults']:,.0f} | "
                         f"{r[s]['samples_per_s']:.1f} | {ratio} |")
    lines += ["", f"Optimizer step of the second stage, SGD(momentum=0.9), ms (median of {res['optimizer_repeat']} "
              f"steps per round, the implementations taking turns):", "",
              "| implementation | before | after |", "|---|---:|---:|"]
    for name in OPTIMIZERS:
        cells = [res["optimizer_ms"][s][name] for s in SETTINGS_COMPARED]
        lines.append(f"| `{name}` | " + " | ".join("n/a" if c is None else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def section(*, quick: bool, out: Path) -> Section:
    """Faults and throughput before and after the allocator setting, and SGD's step time per implementation."""
    steps, warmup, rounds, repeat = (6, 2, 1, 5) if quick else (40, 10, 3, 30)
    res = compare(steps=steps, warmup=warmup, rounds=rounds, repeat=repeat)
    return Section(key="faults", title="Page faults per step: glibc's defaults against the allocator setting",
                   results=res, markdown=_markdown(res))


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=RUNTIMES, required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=0)
    a = parser.parse_args(argv)
    print(json.dumps(_measure_here(a.worker, a.plan, a.steps, a.warmup, a.repeat)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return _worker(argv)
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

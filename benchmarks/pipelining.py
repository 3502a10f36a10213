"""The end-to-end-backprop baseline: torch.distributed.pipelining (GPipe and 1F1B) on the compiler's split."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import ppll_compile

from .launch import load_example, spawn

__all__ = ["best_pipelining", "pipelining_throughput"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
class _CopyInputs(nn.Module):
    """Run ``stage`` on copies of its inputs, so that in-place ops at its start leave the received leaves alone."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.stage(*(x.clone() for x in inputs))


def _worker(rank: int, world: int, model: str, schedule: str, microbatches: int, steps: int, warmup: int,
            batch: int, seed: int, plan: str | None) -> dict:
    """One pipeline rank: build and split the model, train ``warmup + steps`` steps, report time and loss."""
    torch.manual_seed(seed)
    module = load_example(model)
    net = module.build_model(num_classes=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compiler's CPU-fallback warning
        compiled = ppll_compile.compile(net, world, example_inputs=module.example_inputs(), plan=plan)
    # Stage i>0 takes the previous stage's boundary tuple as positional args, and PipelineStage sends a
    # 1-tuple output as one tensor, so the Stage modules plug in directly; shapes are inferred at runtime.
    submodule = compiled.stages[rank]
    # PipelineStage hands a later stage its input as a leaf that requires grad; a stage that starts with an
    # in-place op (a ReLU after a cut at a residual add) needs a copy of it first
    stage = PipelineStage(submodule if rank == 0 else _CopyInputs(submodule), rank, world, torch.device("cpu"))
    sched = SCHEDULES[schedule](stage, microbatches, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(submodule.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    losses: list[torch.Tensor] = []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses.clear()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    out = {}
    if rank == 0:
        out["samples_per_s"] = steps * batch / elapsed
    if rank == world - 1:
        out["loss"] = torch.stack(losses).mean().item()
    return out


def _run(model: str, schedule: str, microbatches: int, *, steps: int, warmup: int, batch: int, world: int,
         seed: int, timeout: float, plan: str | None = None) -> dict:
    """Launch ``world`` spawned ranks; kill them all if one fails or they outlive ``timeout`` seconds."""
    out = spawn(_worker, world, (model, schedule, microbatches, steps, warmup, batch, seed, plan), timeout=timeout)
    if not math.isfinite(out["loss"]):
        raise RuntimeError(f"{model} {schedule} x{microbatches}: loss {out['loss']}")
    return out


def pipelining_throughput(model: str, schedule: str, microbatches: int, *, steps: int = 10, warmup: int = 3,
                          batch: int = 64, world: int = 2, seed: int = 0, plan: str | None = None) -> float:
    """Samples per second of full training steps of ``model`` on ``world`` CPU ranks with ``schedule``."""
    return _run(model, schedule, microbatches, steps=steps, warmup=warmup, batch=batch, world=world, seed=seed,
                timeout=180 + 30 * (steps + warmup), plan=plan)["samples_per_s"]


def best_pipelining(model: str, *, microbatch_counts: tuple[int, ...] = (1, 2, 4, 8), steps: int = 10,
                    warmup: int = 3, batch: int = 64, world: int = 2, plan: str | None = None) -> dict:
    """Both schedules at every valid microbatch count; the best count per schedule and all rows.

    ``plan`` (a saved plan's path) fixes the split; by default the compiler's FLOP plan chooses it.
    """
    rows, best = [], {}
    for schedule in SCHEDULES:
        for m in microbatch_counts:
            row = {"model": model, "schedule": schedule, "microbatches": m, "samples_per_s": None, "loss": None}
            if batch % m:
                row["skipped"] = f"{m} microbatches do not divide batch {batch}"
            elif schedule == "1f1b" and m < world:
                row["skipped"] = f"1F1B needs microbatches >= stages ({world})"
            else:
                out = _run(model, schedule, m, steps=steps, warmup=warmup, batch=batch, world=world, seed=0,
                           timeout=180 + 30 * (steps + warmup), plan=plan)
                row.update(samples_per_s=out["samples_per_s"], loss=out["loss"])
                if schedule not in best or row["samples_per_s"] > best[schedule]["samples_per_s"]:
                    best[schedule] = {"microbatches": m, "samples_per_s": row["samples_per_s"]}
            rows.append(row)
    return {**best, "all": rows}

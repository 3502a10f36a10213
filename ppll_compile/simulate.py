"""Plan-time schedule simulator: a deterministic discrete-event model of how the runtimes execute a plan.

The model, per batch ``b = 0 .. steps-1`` and stage ``j`` (all times in seconds from 0):

- *Work per batch.* A stage's :attr:`~ppll_compile.plan.StagePlan.compute_cost` is its per-replica compute plus
  the ring all-reduce of its gradients, ``sync = 2 (r-1)/r * sync_bytes / plan.link_bandwidth`` with ``r`` its
  replicas and ``sync_bytes`` its backbone gradient bytes (plus ``4 * head.param_count`` for a PPLL stage that
  is not the last). Compute alone, ``compute_cost - sync``, is split into forward and backward by FLOP shares
  (forward: backbone + head forward FLOPs, under Pipe-BD the teacher's forward FLOPs ``aux_flops`` too; all of
  it forward when the stage counts no FLOPs). At the simulated bandwidth ``B`` the all-reduce takes
  ``2 (r-1)/r * sync_bytes / B`` and the send ``boundary bytes / B / r`` (0 for the last stage), so at the
  plan's bandwidth a stage's work per batch is its ``cost``. The optimizer step is not modelled: the plan
  does not cost it.
- *Receive.* Batch ``b`` arrives at stage 0 at once (the caller is infinitely fast); with ``decoupled=False``
  (a barrier after every batch) only when every stage has finished batch ``b-1``. It arrives at stage
  ``j+1`` when stage ``j``'s send of it ends. ``start[j][b] = max(arrival, end[j][b-1])`` (FIFO).
- *Compute.* Forward, backward, then the all-reduce when ``r > 1``: ``done = start + forward + backward + sync``.
  The replicas of a stage work in lockstep on slices of the same batch, so every replica lane gets the same
  spans.
- *Send.* The queue to stage ``j+1`` holds ``queue_depth`` batches: the put of batch ``b`` waits until stage
  ``j+1`` has started batch ``b - queue_depth`` (*blocked*), then the transfer keeps stage ``j`` busy for
  ``send`` seconds: ``end[j][b] = max(done, start[j+1][b - queue_depth]) + send``. The last stage ends a batch
  when it is done computing it.

These equations are the event schedule of the system, evaluated batch by batch in stage order (every time
they read belongs to an earlier batch or an earlier stage).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .plan import Plan, StagePlan, format_bytes
from .timeline import Event, Timeline

__all__ = ["simulate", "Simulation", "StageSimulation"]


@dataclass(frozen=True, kw_only=True)
class StageSimulation:
    """One stage's share of a simulated run: what its (every) replica spent its time on."""

    index: int
    """Stage index."""
    replicas: int
    """Replicas of the stage (each has the same spans)."""
    cost: float
    """Seconds of own work per batch: forward + backward + all-reduce + send (the plan's ``cost`` at its bandwidth)."""
    compute: float
    """Seconds spent in forward and backward, over all batches."""
    allreduce: float
    """Seconds spent all-reducing gradients (0 for one replica), over all batches."""
    send: float
    """Seconds spent transferring outputs to the next stage (0 for the last stage), over all batches."""
    blocked: float
    """Seconds spent waiting for room in the queue to the next stage, over all batches."""
    idle: float
    """Seconds spent waiting for input over ``[0, makespan]``, warm-up and drain included."""
    utilisation: float
    """``(compute + allreduce) / makespan`` (0 when the makespan is 0)."""


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """The simulated schedule of a plan: throughput, warm-up, per-stage time shares and the timeline."""

    steps: int
    """Batches simulated."""
    queue_depth: int
    """Batches each queue between neighbouring stages holds."""
    link_bandwidth: float
    """Bytes per second of the links (sends and all-reduces)."""
    decoupled: bool
    """Whether stages run without a barrier between batches (``False``: stage 0 waits for the whole pipeline)."""
    batch_size: int
    """Samples per batch (the plan's)."""
    makespan: float
    """Seconds until the last stage finishes the last batch."""
    step_time: float
    """Steady-state seconds per batch: the last stage's mean finish interval over the second half of the batches
    (the makespan when ``steps == 1``)."""
    throughput: float
    """Samples per second: ``batch_size / step_time`` (infinite when the step time is 0)."""
    warmup: float
    """Seconds until the last stage finishes batch 0."""
    predicted: float
    """The plan's own estimate in samples per second, ``batch_size / plan.bottleneck_cost``, for reference."""
    stages: tuple[StageSimulation, ...]
    """Per-stage results, in pipeline order."""
    timeline: Timeline
    """Every span of every (stage, replica) lane and batch; source ``simulated``."""

    def to_dict(self) -> dict[str, Any]:
        """The results as JSON-able data, without the timeline's spans (infinite rates become ``None``)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("timeline", "stages")}
        d["throughput"], d["predicted"] = _finite(self.throughput), _finite(self.predicted)
        d["stages"] = [asdict(s) for s in self.stages]
        return d

    def table(self) -> str:
        """Per-stage time shares as an aligned text table, then a summary line."""
        header = ["stage", "replicas", "busy ms", "send ms", "blocked ms", "idle ms", "util %"]
        rows = [[str(s.index), str(s.replicas), f"{(s.compute + s.allreduce) * 1e3:.3f}", f"{s.send * 1e3:.3f}",
                 f"{s.blocked * 1e3:.3f}", f"{s.idle * 1e3:.3f}", f"{s.utilisation * 100:.1f}"] for s in self.stages]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in [header, ["-" * w for w in widths], *rows]]
        lines.append(f"throughput {self.throughput:.1f} samples/s (plan predicts {self.predicted:.1f})  step time "
                     f"{self.step_time * 1e3:.3f} ms  warm-up {self.warmup * 1e3:.3f} ms  makespan "
                     f"{self.makespan * 1e3:.3f} ms  {self.steps} steps  queue depth {self.queue_depth}  bandwidth "
                     f"{format_bytes(self.link_bandwidth)}/s  {'decoupled' if self.decoupled else 'barrier per batch'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True, kw_only=True)
class _Work:
    """Seconds one stage replica spends on each part of one batch."""

    forward: float
    """Forward share of the compute."""
    backward: float
    """Backward share of the compute."""
    allreduce: float
    """Ring all-reduce of the gradients at the simulated bandwidth."""
    send: float
    """Transfer of this replica's slice of the boundary at the simulated bandwidth."""


def simulate(plan: Plan, *, steps: int = 64, queue_depth: int = 2, link_bandwidth: float | None = None,
             decoupled: bool = True) -> Simulation:
    """Simulate ``steps`` batches through ``plan`` with FIFO queues of ``queue_depth`` (model: module docstring).

    ``link_bandwidth`` (bytes/s) replaces the plan's for sends and all-reduces; ``decoupled=False`` puts a
    barrier after every batch (no pipelining).
    """
    bandwidth = _check(plan, steps, queue_depth, link_bandwidth)
    work = [_work(plan, s, bandwidth) for s in plan.stages]
    n = len(work)
    start = [[0.0] * steps for _ in range(n)]
    end = [[0.0] * steps for _ in range(n)]
    blocked, idle = [0.0] * n, [0.0] * n
    events: list[Event] = []
    for b in range(steps):
        for j, w in enumerate(work):
            if j > 0:
                arrival = end[j - 1][b]
            else:
                arrival = 0.0 if decoupled or b == 0 else max(end[k][b - 1] for k in range(n))
            free = end[j][b - 1] if b > 0 else 0.0
            begin = start[j][b] = max(arrival, free)
            forward = begin + w.forward
            backward = forward + w.backward
            done = backward + w.allreduce
            room = start[j + 1][b - queue_depth] if j < n - 1 and b >= queue_depth else 0.0
            put = max(done, room)
            end[j][b] = put + w.send if j < n - 1 else done
            blocked[j] += put - done
            idle[j] += begin - free
            spans = [("receive", free, begin)] if begin > free else []
            spans += [("forward", begin, forward), ("backward", forward, backward)]
            spans += [("allreduce", backward, done)] if plan.stages[j].replicas > 1 else []
            spans += [("send", done, end[j][b])] if j < n - 1 else []
            events += [Event(stage=j, replica=r, batch=b, kind=kind, start=t0, end=t1)
                       for r in range(plan.stages[j].replicas) for kind, t0, t1 in spans]
    makespan = end[-1][-1]
    last = end[-1]
    half = steps // 2
    step_time = makespan if steps == 1 else (last[-1] - last[half - 1]) / (steps - half)
    results = tuple(StageSimulation(
        index=j, replicas=s.replicas, cost=w.forward + w.backward + w.allreduce + w.send,
        compute=steps * (w.forward + w.backward), allreduce=steps * w.allreduce, send=steps * w.send,
        blocked=blocked[j], idle=idle[j] + makespan - end[j][-1],
        utilisation=steps * (w.forward + w.backward + w.allreduce) / makespan if makespan > 0 else 0.0)
        for j, (s, w) in enumerate(zip(plan.stages, work)))
    timeline = Timeline.of(events, source="simulated", model=plan.model, mode=plan.mode, batch_size=plan.batch_size,
                           steps=steps, queue_depth=queue_depth, link_bandwidth=bandwidth, decoupled=decoupled)
    return Simulation(
        steps=steps, queue_depth=queue_depth, link_bandwidth=bandwidth, decoupled=decoupled,
        batch_size=plan.batch_size, makespan=makespan, step_time=step_time,
        throughput=_rate(plan.batch_size, step_time), warmup=last[0],
        predicted=_rate(plan.batch_size, plan.bottleneck_cost), stages=results, timeline=timeline)


def _work(plan: Plan, stage: StagePlan, bandwidth: float) -> _Work:
    """Forward, backward, all-reduce and send seconds of one replica of ``stage`` per batch (module docstring)."""
    compute = max(0.0, stage.compute_cost - plan.allreduce_cost(stage))
    if plan.mode == "ppll":
        fwd = stage.flops_fwd + stage.head.flops_fwd
        total = fwd + stage.flops_bwd + stage.head.flops_bwd
    else:
        fwd = stage.aux_flops + stage.flops_fwd
        total = fwd + stage.flops_bwd
    forward = compute * fwd / total if total > 0 else compute
    send = 0.0 if stage.is_last else sum(t.bytes for t in stage.boundary) / bandwidth / stage.replicas
    return _Work(forward=forward, backward=compute - forward, allreduce=plan.allreduce_cost(stage, bandwidth),
                 send=send)


def _check(plan: Any, steps: Any, queue_depth: Any, link_bandwidth: Any) -> float:
    """Validate the arguments of :func:`simulate`; the bandwidth to simulate."""
    if not isinstance(plan, Plan):
        raise TypeError(f"simulate() takes a Plan, got {type(plan).__name__} (make one with "
                        f"ppll_compile.plan(model, gpus, example_inputs=...) or Plan.load(path))")
    for name, value, hint in (("steps", steps, "the number of batches to simulate, e.g. steps=64"),
                              ("queue_depth", queue_depth, "batches per queue; the runtimes' default is 2")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
            raise error(f"{name} must be an int >= 1, got {value!r} ({hint})")
    if link_bandwidth is None:
        return float(plan.link_bandwidth)
    number = isinstance(link_bandwidth, (int, float)) and not isinstance(link_bandwidth, bool)
    if not (number and math.isfinite(link_bandwidth) and link_bandwidth > 0):
        raise (ValueError if number else TypeError)(
            f"link_bandwidth must be a positive finite number of bytes per second, got {link_bandwidth!r} "
            f"(e.g. 25e9, or None for the plan's {plan.link_bandwidth:g})")
    return float(link_bandwidth)


def _rate(samples: int, seconds: float) -> float:
    return samples / seconds if seconds > 0 else math.inf


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None

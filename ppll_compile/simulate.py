"""Plan-time schedule simulator: a deterministic discrete-event model of how the runtimes execute a plan.

The model, per batch ``b = 0 .. steps-1`` and stage ``j`` (all times in seconds from 0):

- *Work per batch.* A stage's :attr:`~ppll_compile.plan.StagePlan.compute_cost` is its per-replica compute plus
  the ring all-reduce of its gradients, ``sync = 2 (r-1)/r * sync_bytes / plan.link_bandwidth`` with ``r`` its
  replicas and ``sync_bytes`` its backbone gradient bytes (plus ``4 * head.param_count`` for a PPLL stage that
  is not the last). Compute alone, ``compute_cost - sync``, is split by FLOP shares into ``early`` (the forward
  until the stage's output exists: PPLL the block's forward ``flops_fwd``, Pipe-BD the teacher blocks'
  ``aux_flops``), ``late`` (the rest of the forward: PPLL the head and loss, Pipe-BD the student blocks and
  loss) and the backward; a stage that counts no FLOPs is all ``early``. At the simulated bandwidth ``B`` the
  all-reduce takes ``2 (r-1)/r * sync_bytes / B`` and the send ``boundary bytes / B / r`` (0 for the last
  stage), so at the plan's bandwidth a stage's work per batch is its ``cost``. The optimizer step takes no
  time: the plan does not cost it.
- *Receive.* Batch ``b`` is at stage 0 at once (the caller is infinitely fast); it arrives at stage ``j+1``
  when stage ``j``'s send of it ends. ``start[j][b] = max(arrival, end[j][b-1])`` (FIFO).
- *Early forwarding.* The output exists at ``out = start + early``. The queue to stage ``j+1`` holds
  ``queue_depth`` batches: it has room for batch ``b`` once stage ``j+1`` has started batch ``b - queue_depth``
  (``room``). If ``room <= out`` the stage sends at once, a transfer that keeps it busy ``send`` seconds, then
  runs the rest: ``done = out + send + late + backward + sync``. Otherwise the send is *deferred*, as the
  threads runtime does (it never waits for room in the middle of a step): ``done = start + early + late +
  backward + sync``, then the put waits for room (*blocked*) and the transfer follows,
  ``end[j][b] = max(done, room) + send``. The batch arrives at stage ``j+1`` when the send ends. The last
  stage sends nothing. The replicas of a stage work in lockstep on slices of the same batch, so every replica
  lane gets the same spans.
- *Barrier* (``decoupled=False``). Every stage's optimizer step on batch ``b`` waits until every stage is
  ``done`` with it: ``end[j][b] = max_k done[k][b]``. The stages still overlap within a batch (early sends), and
  a send is never deferred: a stage starts batch ``b`` after the barrier of ``b-1``, by which stage ``j+1`` has
  started batch ``b-1``, so the queue has room. Without the barrier (``decoupled=True``), ``end[j][b] = done``
  unless the send was deferred.

These equations are the event schedule of the system, evaluated batch by batch in stage order (every time
they read belongs to an earlier batch, an earlier stage, or, for the barrier, the same batch's ``done``).

The timeline has a ``receive`` span for a wait for input, ``forward`` spans (two around an early send when the
forward has a rest: ``start .. out`` and after the send), ``backward``, ``allreduce`` (replicated stages) and
``send`` (a deferred one from ``done``, waiting for room included). The wait at the barrier has no span, as in
a runtime's trace (the runtimes wait between the ``backward`` and ``step`` spans): it is a gap in the lane,
counted in :attr:`StageSimulation.barrier`.
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
    """Seconds a deferred send spent waiting for room in the queue to the next stage, over all batches."""
    barrier: float
    """Seconds spent waiting at the barrier before the optimizer step (``decoupled=False``; else 0), over all
    batches."""
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
    """Whether every stage steps without waiting for the others (``False``: a barrier of all the stages before
    every optimizer step; the stages still overlap within a batch)."""
    batch_size: int
    """Samples per batch (the plan's)."""
    makespan: float
    """Seconds until every stage has finished the last batch."""
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
        header = ["stage", "replicas", "busy ms", "send ms", "blocked ms", "barrier ms", "idle ms", "util %"]
        rows = [[str(s.index), str(s.replicas), f"{(s.compute + s.allreduce) * 1e3:.3f}", f"{s.send * 1e3:.3f}",
                 f"{s.blocked * 1e3:.3f}", f"{s.barrier * 1e3:.3f}", f"{s.idle * 1e3:.3f}",
                 f"{s.utilisation * 100:.1f}"] for s in self.stages]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in [header, ["-" * w for w in widths], *rows]]
        lines.append(f"throughput {self.throughput:.1f} samples/s (plan predicts {self.predicted:.1f})  step time "
                     f"{self.step_time * 1e3:.3f} ms  warm-up {self.warmup * 1e3:.3f} ms  makespan "
                     f"{self.makespan * 1e3:.3f} ms  {self.steps} steps  queue depth {self.queue_depth}  bandwidth "
                     f"{format_bytes(self.link_bandwidth)}/s  "
                     f"{'decoupled' if self.decoupled else 'barrier before each step'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True, kw_only=True)
class _Work:
    """Seconds one stage replica spends on each part of one batch."""

    early: float
    """The forward until the output exists (PPLL: the block; Pipe-BD: the teacher blocks)."""
    late: float
    """The rest of the forward (PPLL: the head and loss; Pipe-BD: the student blocks and loss)."""
    backward: float
    """Backward share of the compute."""
    allreduce: float
    """Ring all-reduce of the gradients at the simulated bandwidth."""
    send: float
    """Transfer of this replica's slice of the boundary at the simulated bandwidth."""

    @property
    def forward(self) -> float:
        return self.early + self.late


def simulate(plan: Plan, *, steps: int = 64, queue_depth: int = 2, link_bandwidth: float | None = None,
             decoupled: bool = True) -> Simulation:
    """Simulate ``steps`` batches through ``plan`` with FIFO queues of ``queue_depth`` (model: module docstring).

    Every stage sends its output on as soon as its forward made it (early forwarding) when the queue has room,
    else once its work on the batch is done. ``link_bandwidth`` (bytes/s) replaces the plan's for sends and
    all-reduces; ``decoupled=False`` puts a barrier of all the stages before every optimizer step (the stages
    still overlap within a batch; Pipe-BD's teacher relaying without decoupled updates).
    """
    bandwidth = _check(plan, steps, queue_depth, link_bandwidth)
    work = [_work(plan, s, bandwidth) for s in plan.stages]
    n = len(work)
    start = [[0.0] * steps for _ in range(n)]
    end = [[0.0] * steps for _ in range(n)]
    blocked, barrier, idle = [0.0] * n, [0.0] * n, [0.0] * n
    events: list[Event] = []
    for b in range(steps):
        arrival = 0.0  # of batch b at stage j: at once at stage 0, then when stage j-1's send of it ends
        done = [0.0] * n
        lanes: list[list[tuple[str, float, float]]] = [[] for _ in range(n)]
        for j, w in enumerate(work):
            spans = lanes[j]
            free = end[j][b - 1] if b > 0 else 0.0
            begin = start[j][b] = max(arrival, free)
            idle[j] += begin - free
            spans += [("receive", free, begin)] if begin > free else []
            out = begin + w.early
            room = start[j + 1][b - queue_depth] if j < n - 1 and b >= queue_depth else 0.0
            early = j < n - 1 and room <= out
            if early:
                arrival = t = out + w.send
                spans += [("forward", begin, out), ("send", out, t)]
                spans += [("forward", t, t + w.late)] if w.late > 0 else []
                t += w.late
            else:
                t = begin + w.forward
                spans.append(("forward", begin, t))
            spans.append(("backward", t, t + w.backward))
            spans += [("allreduce", t + w.backward, t + w.backward + w.allreduce)] if plan.stages[j].replicas > 1 \
                else []
            done[j] = end[j][b] = t + w.backward + w.allreduce
            if j < n - 1 and not early:
                # never with the barrier: stage j began batch b after the barrier of b-1, by which stage j+1 had
                # started b-1 >= b - queue_depth, so room <= start[j][b] <= out
                assert decoupled, "a deferred send under the barrier would deadlock"
                put = max(done[j], room)
                blocked[j] += put - done[j]
                arrival = end[j][b] = put + w.send
                spans.append(("send", done[j], arrival))
        if not decoupled:
            step = max(done)  # every stage's optimizer step on batch b waits for every stage's backward on it
            for j in range(n):
                barrier[j] += step - done[j]
                end[j][b] = step
        events += [Event(stage=j, replica=r, batch=b, kind=kind, start=t0, end=t1)
                   for j in range(n) for r in range(plan.stages[j].replicas) for kind, t0, t1 in lanes[j]]
    makespan = max(e[-1] for e in end)
    last = end[-1]
    half = steps // 2
    step_time = makespan if steps == 1 else (last[-1] - last[half - 1]) / (steps - half)
    results = tuple(StageSimulation(
        index=j, replicas=s.replicas, cost=w.forward + w.backward + w.allreduce + w.send,
        compute=steps * (w.forward + w.backward), allreduce=steps * w.allreduce, send=steps * w.send,
        blocked=blocked[j], barrier=barrier[j], idle=idle[j] + makespan - end[j][-1],
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
    """Early and late forward, backward, all-reduce and send seconds of one replica of ``stage`` per batch
    (module docstring)."""
    compute = max(0.0, stage.compute_cost - plan.allreduce_cost(stage))
    if plan.mode == "ppll":
        first, fwd = stage.flops_fwd, stage.flops_fwd + stage.head.flops_fwd
        total = fwd + stage.flops_bwd + stage.head.flops_bwd
    else:
        first, fwd = stage.aux_flops, stage.aux_flops + stage.flops_fwd
        total = fwd + stage.flops_bwd
    early = compute * first / total if total > 0 else compute
    forward = compute * fwd / total if total > 0 else compute
    send = 0.0 if stage.is_last else sum(t.bytes for t in stage.boundary) / bandwidth / stage.replicas
    return _Work(early=early, late=forward - early, backward=compute - forward,
                 allreduce=plan.allreduce_cost(stage, bandwidth), send=send)


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

"""Plan-time schedule simulator: a deterministic discrete-event model of how the runtimes execute a plan.

The model, per batch ``b = 0 .. steps-1`` and stage ``j`` (all times in seconds from 0):

- *Work per batch.* A stage's :attr:`~ppll_compile.plans.plan.StagePlan.compute_cost` is its per-replica compute plus
  the ring all-reduce of its gradients, ``sync = 2 (r-1)/r * sync_bytes / plan.link_bandwidth`` with ``r`` its
  replicas and ``sync_bytes`` its backbone gradient bytes (plus ``4 * head.param_count`` for a PPLL stage that
  is not the last). Compute alone, ``compute_cost - sync``, holds the optimizer ``step``
  (:attr:`~ppll_compile.plans.plan.StagePlan.step_cost`, at most the compute; 0 in plans that do not cost it); the
  rest is split by FLOP shares into ``early`` (the forward until the stage's output exists: PPLL the block's
  forward ``flops_fwd``, Pipe-BD the teacher blocks' ``aux_flops``), ``late`` (the rest of the forward: PPLL
  the head and loss, Pipe-BD the student blocks and loss) and the backward; a stage that counts no FLOPs is
  all ``early``; a checkpointed stage's ``recompute_cost`` is taken out first and added to its backward, where it
  runs. At the simulated bandwidth ``B`` the all-reduce takes ``2 (r-1)/r * sync_bytes / B`` and the
  send ``boundary bytes / B / r`` (0 for the last stage), so at the plan's bandwidth a stage's work per batch
  is its ``cost``. The parts run in the runtimes' order: forward, backward, all-reduce, (barrier), step.
- *Receive.* Batch ``b`` is at stage 0 at once (the caller is infinitely fast); it arrives at stage ``j+1``
  when stage ``j``'s send of it ends. ``start[j][b] = max(arrival, end[j][b-1])`` (FIFO).
- *Early forwarding.* The output exists at ``out = start + early``. The queue to stage ``j+1`` holds
  ``queue_depth`` batches: it has room for batch ``b`` once stage ``j+1`` has started batch ``b - queue_depth``
  (``room``). If ``room <= out`` the stage sends at once, a transfer that keeps it busy ``send`` seconds, then
  runs the rest: ``done = out + send + late + backward + sync`` and ``end[j][b] = done + step``. Otherwise the
  send is *deferred*, as the threads runtime does (it never waits for room in the middle of a step):
  ``done = start + early + late + backward + sync``, the step follows, then the put waits for room
  (*blocked*) and the transfer follows, ``end[j][b] = max(done + step, room) + send``. The batch arrives at
  stage ``j+1`` when the send ends. The last stage sends nothing. The replicas of a stage work in lockstep on
  slices of the same batch, so every replica lane gets the same spans.
- *Barrier* (``decoupled=False``). Every stage's optimizer step on batch ``b`` waits until every stage is
  ``done`` with it: ``end[j][b] = max_k done[k][b] + step[j]``. The stages still overlap within a batch (early
  sends), and a send is never deferred: a stage starts batch ``b`` after the barrier of ``b-1``, by which stage
  ``j+1`` has started batch ``b-1``, so the queue has room. Without the barrier (``decoupled=True``),
  ``end[j][b] = done + step`` unless the send was deferred.

These equations are the event schedule of the system, evaluated batch by batch in stage order (every time
they read belongs to an earlier batch, an earlier stage, or, for the barrier, the same batch's ``done``).
They hold when every stage replica has a processor of its own, as the plan's costs assume.

*Sharing* (``cores=N``). The stage replicas then run on the processors their devices have: every replica of a
stage on ``cpu`` is one thread of work (one worker thread per stage under ``threads``, one process per replica
under ``distributed``), and all of them share the ``N`` CPU cores; the stages on one accelerator (the same
``cuda:i``; ``cuda`` is ``cuda:0``) share that device as one processor; stages on distinct devices share
nothing. The plan names only the first replica's device, so the other replicas of an accelerator stage are
taken to have devices of their own, as the default placement gives them. A thread is *busy* while it computes
(``forward``, ``backward``, ``step``) and, on the CPU, while it transfers (``send``, ``allreduce``: gloo and the
threads runtime's copy work on the CPU); on an accelerator a transfer keeps its stage busy but leaves the
device to the others (links and copy engines move the bytes). Waiting (for input, for room in a queue, at the
barrier) takes no processor. When ``busy`` threads share ``P`` processors and ``busy > P``, each progresses
at rate ``P / busy`` (processor sharing), else at full rate; the replicas of a stage move together. Then the
batch-by-batch equations no longer hold (a stage's speed depends on what the others do at that moment), and
the same rules run as an event-driven simulation over time: whenever a span begins or ends, the busy counts
and so every running span's rate change. When no device holds more threads than processors, sharing never
slows anything and the equations give the result.

*Results.* Besides samples per second (and tokens per second when the main input is a token sequence), the
result gives the *bubble*, ``1 - sum(busy) / (stages * makespan)`` with a stage's busy seconds its compute,
all-reduce and send, and of it the *fill/drain* share, the waits before each stage's first batch and after its
last; the memory each device holds, the plan's per-stage ``memory_bytes`` once per replica, split by part
(:func:`~ppll_compile.plans.report.memory_split`); each stage's head share of its work; and the plan's model FLOPs
utilisation (:mod:`ppll_compile.plans.report`). For ``S`` equal stages whose output is ready only when their work
on a batch is done and costs nothing to send, over ``n`` batches, the bubble is all fill and drain,
``(S - 1) / (n + S - 1)``.

The timeline has a ``receive`` span for a wait for input, ``forward`` spans (two around an early send when the
forward has a rest: ``start .. out`` and after the send), ``backward``, ``allreduce`` (replicated stages),
``step`` (when it takes time) and ``send`` (a deferred one from the end of the step, waiting for room
included). The wait at the barrier has no span, as in a runtime's trace (the runtimes wait between the
``backward`` and ``step`` spans): it is a gap in the lane, counted in :attr:`StageSimulation.barrier`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..plans.plan import Plan, StagePlan
from ..plans.report import MemorySplit, head_share, memory_split, mfu, model_flops, peak_flops
from ..plans.schedule import rules
from ..plans.timeline import Event, Timeline
from ..plans.units import format_bytes
from .equations import Lanes, Pool, Work, equations
from .sharing import processor_sharing


@dataclass(frozen=True, kw_only=True)
class StageSimulation:
    """One stage's share of a simulated run: what its (every) replica spent its time on."""

    index: int
    """Stage index."""
    replicas: int
    """Replicas of the stage (each has the same spans)."""
    cost: float
    """Seconds of own work per batch: forward + backward + all-reduce + step + send (the plan's ``cost`` at its
    bandwidth), on a processor of its own."""
    compute: float
    """Seconds spent in forward, backward and optimizer step, over all batches (longer than the work when the
    stage shares its processors)."""
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
    speed: float = 1.0
    """Mean speed while busy: the stage's own work over the seconds its compute, all-reduce and send spans took
    (1 unless it shared its processors with more busy threads than they have)."""
    fill: float = 0.0
    """Seconds before the stage started batch 0 (waiting for the pipeline to fill)."""
    drain: float = 0.0
    """Seconds from the stage's end of the last batch to the makespan (waiting for the others to drain)."""
    memory: int = 0
    """Bytes each of the stage's devices holds: the plan's :attr:`~ppll_compile.plans.plan.StagePlan.memory_bytes`
    (every replica holds the whole stage at the planned batch, as the plan's memory cap counts it)."""
    split: MemorySplit = MemorySplit()
    """:attr:`memory` by part: weights, gradients, optimizer state, activations, head, logits
    (:func:`~ppll_compile.plans.report.memory_split`)."""
    head_share: float = 0.0
    """The share of the stage's work per batch its head (the last stage: its loss) takes, ``head_cost / cost`` of
    the plan's stage (:func:`~ppll_compile.plans.report.head_share`; 0 in plans that do not record it)."""


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
    (the makespan when ``steps == 1``). When stages shared processors, the window ends with the last batch the last
    stage finished before the first stage finished its last one: the drain after it runs faster."""
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
    cores: int | None = None
    """CPU cores the replicas of the ``cpu`` stages shared (``None``: every stage replica had a processor of its
    own, nothing shared)."""
    shared: str = ""
    """Which stages shared fewer processors than they have threads, and how fast they ran then, e.g. ``4 stages
    share 2 CPU cores: ...``; ``""`` when nothing was shared."""
    sequence_length: int | None = None
    """Tokens per sample: the length of the plan's main input when it is a token sequence (an integer tensor of
    shape ``(batch, length)``); ``None`` otherwise."""
    token_throughput: float | None = None
    """Tokens per second: ``throughput * sequence_length`` (``None`` when the input is not a token sequence)."""
    bubble: float = 0.0
    """The share of the stages' time spent waiting: ``1 - sum(busy) / (stages * makespan)``, where a stage's busy
    seconds are its compute, all-reduce and send (the rest of ``[0, makespan]`` it waits for input, for room in
    a queue or at the barrier); 0 when the makespan is 0. Replicas of a stage count once (they move together)."""
    fill_drain: float = 0.0
    """Of :attr:`bubble`, the share spent filling and draining the pipeline: ``sum(fill + drain) / (stages *
    makespan)`` (the rest, ``bubble - fill_drain``, is waiting between batches in steady state)."""
    device_memory: tuple[int, ...] = ()
    """Bytes each device holds, stage by stage and replica by replica (a stage's :attr:`StageSimulation.memory`
    once per replica)."""
    peak_memory: int = 0
    """The most bytes any one device holds: ``max(device_memory)``."""
    model_flops: int = 0
    """FLOPs of the model's own layers per batch: every stage's backbone forward and backward, heads and the loss
    excluded (:func:`~ppll_compile.plans.report.model_flops`)."""
    peak_flops: float | None = None
    """FLOP/s of one device at its peak in the plan's precision (:func:`~ppll_compile.plans.report.peak_flops`);
    ``None`` when the plan records none."""
    mfu: float | None = None
    """Model FLOPs utilisation: ``model_flops / (step_time * devices * peak_flops)``, ``devices`` the plan's
    ``world_size``; ``None`` without a peak or a positive step time."""

    def to_dict(self) -> dict[str, Any]:
        """The results as JSON-able data, without the timeline's spans (infinite rates become ``None``)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("timeline", "stages")}
        d["throughput"], d["predicted"] = _finite(self.throughput), _finite(self.predicted)
        d["token_throughput"] = None if self.token_throughput is None else _finite(self.token_throughput)
        d["mfu"] = None if self.mfu is None else _finite(self.mfu)
        d["device_memory"] = list(self.device_memory)
        d["stages"] = [asdict(s) for s in self.stages]
        return d

    def table(self) -> str:
        """Per-stage time shares as an aligned text table, then a summary line (and, when stages shared
        processors, a line saying which, with a column of their mean speed while busy)."""
        header = ["stage", "replicas", "busy ms", "send ms", "blocked ms", "barrier ms", "idle ms", "util %",
                  "head %"]
        rows = [[str(s.index), str(s.replicas), f"{(s.compute + s.allreduce) * 1e3:.3f}", f"{s.send * 1e3:.3f}",
                 f"{s.blocked * 1e3:.3f}", f"{s.barrier * 1e3:.3f}", f"{s.idle * 1e3:.3f}",
                 f"{s.utilisation * 100:.1f}", f"{s.head_share * 100:.1f}"] for s in self.stages]
        if self.shared:
            header.append("speed %")
            for row, s in zip(rows, self.stages):
                row.append(f"{s.speed * 100:.1f}")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in [header, ["-" * w for w in widths], *rows]]
        mfu = "" if self.mfu is None else f"  MFU {self.mfu * 100:.3g}%"
        tokens = "" if self.token_throughput is None else f", {self.token_throughput:.1f} tokens/s"
        lines.append(f"throughput {self.throughput:.1f} samples/s (plan predicts {self.predicted:.1f}){tokens}  step "
                     f"time {self.step_time * 1e3:.3f} ms  warm-up {self.warmup * 1e3:.3f} ms  makespan "
                     f"{self.makespan * 1e3:.3f} ms  bubble {self.bubble * 100:.1f}% (fill/drain "
                     f"{self.fill_drain * 100:.1f}%){mfu}  peak memory {format_bytes(self.peak_memory)} per device  "
                     f"{self.steps} steps  queue depth {self.queue_depth}  bandwidth "
                     f"{format_bytes(self.link_bandwidth)}/s  "
                     f"{'decoupled' if self.decoupled else 'barrier before each step'}")
        lines += [f"shared: {self.shared}"] if self.shared else []
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def simulate(plan: Plan, *, steps: int = 64, queue_depth: int = 2, link_bandwidth: float | None = None,
             decoupled: bool = True, cores: int | None = None) -> Simulation:
    """Simulate ``steps`` batches through ``plan`` with FIFO queues of ``queue_depth`` (model: module docstring).

    Every stage sends its output on as soon as its forward made it (early forwarding) when the queue has room,
    else once its work on the batch is done. ``link_bandwidth`` (bytes/s) replaces the plan's for sends and
    all-reduces; ``decoupled=False`` puts a barrier of all the stages before every optimizer step (the stages
    still overlap within a batch; Pipe-BD's teacher relaying without decoupled updates).

    ``cores`` models the processors the stages run on: the replicas of the ``cpu`` stages share ``cores`` CPU
    cores (one thread each; e.g. ``cores=os.cpu_count()`` for this machine), the stages on one accelerator
    share it, and a busy thread runs at ``processors / busy`` speed while more threads are busy than there are
    processors. ``None`` (the default) gives every stage replica a processor of its own, as the plan's costs
    assume: nothing is shared and the result does not depend on the machine that simulates.
    """
    bandwidth = _check(plan, steps, queue_depth, link_bandwidth, cores)
    work = [_work(plan, s, bandwidth if link_bandwidth is not None else None) for s in plan.stages]
    pools = [p for p in _pools(plan, cores) if p.oversubscribed]
    stage_rules = rules(plan.num_stages, queue="fifo", depth=queue_depth, decoupled=decoupled)
    if pools:
        schedule = processor_sharing(work, stage_rules, pools, steps)
    else:
        schedule = equations(work, stage_rules, steps)
    return _result(plan, work, schedule, pools, steps=steps, queue_depth=queue_depth, bandwidth=bandwidth,
                   decoupled=decoupled, cores=cores)


def _result(plan: Plan, work: list[Work], schedule: Lanes, pools: list[Pool], *, steps: int,
            queue_depth: int, bandwidth: float, decoupled: bool, cores: int | None) -> Simulation:
    """The :class:`Simulation` of ``schedule``."""
    end = schedule.end
    makespan = max(e[-1] for e in end)
    last = end[-1]
    half = steps // 2
    # on shared processors the drain runs faster (the stages that finished leave their share to the others):
    # the window ends with the last batch the last stage finished before the first stage had finished them all
    upto = max((b for b in range(half, steps) if last[b] <= end[0][-1]), default=steps - 1) if pools else steps - 1
    step_time = makespan if steps == 1 else (last[upto] - last[half - 1]) / (upto + 1 - half)
    fill = [sum((t1 - t0 for b, kind, t0, t1 in lane if b == 0 and kind == "receive"), 0.0)
            for lane in schedule.lanes]
    results = tuple(StageSimulation(
        index=j, replicas=s.replicas, cost=w.forward + w.backward + w.allreduce + w.step + w.send,
        compute=schedule.compute[j], allreduce=schedule.allreduce[j], send=schedule.send[j],
        blocked=schedule.blocked[j], barrier=schedule.barrier[j], idle=schedule.idle[j] + makespan - end[j][-1],
        utilisation=schedule.busy[j] / makespan if makespan > 0 else 0.0, speed=schedule.speed[j],
        fill=fill[j], drain=makespan - end[j][-1], memory=s.memory_bytes, split=memory_split(s),
        head_share=head_share(s))
        for j, (s, w) in enumerate(zip(plan.stages, work)))
    length = _sequence_length(plan)
    peak = peak_flops(plan)
    throughput = _rate(plan.batch_size, step_time)
    area = plan.num_stages * makespan
    busy = sum(s.compute + s.allreduce + s.send for s in results)
    memory = tuple(s.memory for s in results for _ in range(s.replicas))
    events = [Event(stage=j, replica=r, batch=b, kind=kind, start=t0, end=t1)
              for j, lane in enumerate(schedule.lanes) for r in range(plan.stages[j].replicas)
              for b, kind, t0, t1 in lane]
    shared = "; ".join(p.describe(plan.num_stages) for p in pools)
    timeline = Timeline.of(events, source="simulated", model=plan.model, mode=plan.mode, batch_size=plan.batch_size,
                           steps=steps, queue_depth=queue_depth, link_bandwidth=bandwidth, decoupled=decoupled,
                           cores=cores)
    return Simulation(
        steps=steps, queue_depth=queue_depth, link_bandwidth=bandwidth, decoupled=decoupled,
        batch_size=plan.batch_size, makespan=makespan, step_time=step_time, throughput=throughput, warmup=last[0],
        predicted=_rate(plan.batch_size, plan.bottleneck_cost), stages=results, timeline=timeline, cores=cores,
        shared=shared, sequence_length=length, token_throughput=None if length is None else throughput * length,
        bubble=max(0.0, 1 - busy / area) if area > 0 else 0.0,
        fill_drain=sum(s.fill + s.drain for s in results) / area if area > 0 else 0.0,
        device_memory=memory, peak_memory=max(memory), model_flops=model_flops(plan),
        peak_flops=None if peak is None else peak[0], mfu=mfu(plan, step_time))


_INTEGER_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


def _sequence_length(plan: Plan) -> int | None:
    """Tokens per sample of ``plan``: the length of its main (first) input when that is a token sequence, an
    integer tensor of shape ``(batch_size, length)``; ``None`` otherwise."""
    if not plan.inputs:
        return None
    main = plan.inputs[0]
    if main.dtype in _INTEGER_DTYPES and len(main.shape) == 2 and main.shape[0] == plan.batch_size:
        return main.shape[1]
    return None


def _pools(plan: Plan, cores: int | None) -> list[Pool]:
    """The processors the stages share (none when ``cores`` is ``None``): the CPU, and each accelerator."""
    if cores is None:
        return []
    groups: dict[str, list[int]] = {}
    for s in plan.stages:
        groups.setdefault(_device_key(s.device), []).append(s.index)
    return [Pool(device=d, processors=cores if d == "cpu" else 1, stages=tuple(js),
                  threads=sum(plan.stages[j].replicas for j in js) if d == "cpu" else len(js))
            for d, js in groups.items()]


def _device_key(device: str) -> str:
    """``cpu`` for any CPU device, else ``type:index`` (``cuda`` is ``cuda:0``)."""
    kind, _, index = str(device).partition(":")
    return "cpu" if kind == "cpu" else f"{kind}:{index or 0}"


def _work(plan: Plan, stage: StagePlan, bandwidth: float | None) -> Work:
    """Early and late forward, backward, all-reduce, step and send seconds of one replica of ``stage`` per batch
    (module docstring); ``bandwidth`` ``None``: over the links the stage crosses (inside or across nodes)."""
    compute = max(0.0, stage.compute_cost - plan.allreduce_cost(stage))
    step = min(compute, max(0.0, stage.step_cost))
    recompute = min(compute - step, max(0.0, stage.recompute_cost))  # checkpointing: a forward again, in backward
    rest = compute - step - recompute
    if plan.mode == "ppll":
        first, fwd = stage.flops_fwd, stage.flops_fwd + stage.head.flops_fwd
        total = fwd + stage.flops_bwd + stage.head.flops_bwd
    else:
        first, fwd = stage.aux_flops, stage.aux_flops + stage.flops_fwd
        total = fwd + stage.flops_bwd
    early = rest * first / total if total > 0 else rest
    forward = rest * fwd / total if total > 0 else rest
    send = 0.0 if stage.is_last else \
        sum(t.bytes for t in stage.boundary) / (bandwidth or plan.send_bandwidth(stage)) / stage.replicas
    return Work(early=early, late=forward - early, backward=rest - forward + recompute, step=step,
                 allreduce=plan.allreduce_cost(stage, bandwidth), send=send, replicas=stage.replicas)


def _check(plan: Any, steps: Any, queue_depth: Any, link_bandwidth: Any, cores: Any = None) -> float:
    """Validate the arguments of :func:`simulate`; the bandwidth to simulate."""
    if not isinstance(plan, Plan):
        raise TypeError(f"simulate() takes a Plan, got {type(plan).__name__} (make one with "
                        f"ppll_compile.plan(model, gpus, example_inputs=...) or Plan.load(path))")
    for name, value, hint in (("steps", steps, "the number of batches to simulate, e.g. steps=64"),
                              ("queue_depth", queue_depth, "batches per queue; the runtimes' default is 2")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
            raise error(f"{name} must be an int >= 1, got {value!r} ({hint})")
    if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
        error = ValueError if isinstance(cores, int) and not isinstance(cores, bool) else TypeError
        raise error(f"cores must be an int >= 1 or None, got {cores!r} (the CPU cores the cpu stages share, e.g. "
                    f"cores=os.cpu_count(); None gives every stage a processor of its own)")
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

"""The simulator's batch-by-batch engine, and what both of its engines share: a stage's work and the spans.

The rules of :func:`ppll_compile.simulate` (its module docstring) when every stage replica has a processor of its
own: the equations, evaluated batch by batch in stage order; where a stage sends and whether it waits at the
barrier come from the stage's :class:`~ppll_compile.plans.schedule.StageRule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..plans.schedule import StageRule


@dataclass(frozen=True, kw_only=True)
class Work:
    """Seconds one stage replica spends on each part of one batch."""

    early: float
    """The forward until the output exists (PPLL: the block; Pipe-BD: the teacher blocks)."""
    late: float
    """The rest of the forward (PPLL: the head and loss; Pipe-BD: the student blocks and loss)."""
    backward: float
    """Backward share of the compute."""
    allreduce: float
    """Ring all-reduce of the gradients at the simulated bandwidth."""
    step: float
    """The optimizer step."""
    send: float
    """Transfer of this replica's slice of the boundary at the simulated bandwidth."""
    replicas: int
    """Replicas of the stage (an ``allreduce`` span when more than one)."""

    @property
    def forward(self) -> float:
        return self.early + self.late

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.allreduce + self.step + self.send


@dataclass(frozen=True, kw_only=True)
class Pool:
    """Processors that some stages' threads share: the CPU's cores, or one accelerator."""

    device: str
    """``cpu`` or an accelerator such as ``cuda:0``."""
    processors: int
    """CPU cores, or 1 for an accelerator."""
    stages: tuple[int, ...]
    """The stages on it."""
    threads: int
    """Threads of work on it: every replica of a ``cpu`` stage, the first replica of an accelerator stage."""

    @property
    def oversubscribed(self) -> bool:
        return self.threads > self.processors

    def describe(self, num_stages: int) -> str:
        """``4 stages share 2 CPU cores: each busy stage runs at 2/busy speed while more than 2 are busy``."""
        k, p = len(self.stages), self.processors
        if k == 1:
            who = f"stage {self.stages[0]}"
        elif k == num_stages:
            who = f"{k} stages"
        else:
            who = f"stages {', '.join(map(str, self.stages[:-1]))} and {self.stages[-1]}"
        unit = "thread" if self.threads > k else "stage"
        who += f" ({self.threads} threads with {'its' if k == 1 else 'their'} replicas)" if self.threads > k else ""
        what = f"{p} CPU core{'s' if p != 1 else ''}" if self.device == "cpu" else self.device
        return (f"{who} {'shares' if k == 1 else 'share'} {what}: each busy {unit} runs at {p}/busy speed"
                + (f" while more than {p} are busy" if p > 1 else ""))


@dataclass
class Lanes:
    """Where each stage's time went: its spans per batch, when it ended each batch, and its time shares."""

    lanes: list[list[tuple[int, str, float, float]]]
    """Per stage: ``(batch, kind, start, end)`` spans."""
    end: list[list[float]]
    """Per stage and batch: when the stage was free again."""
    compute: list[float]
    """Per stage, as in :class:`StageSimulation` (so are the next four)."""
    allreduce: list[float]
    send: list[float]
    blocked: list[float]
    barrier: list[float]
    idle: list[float]
    """Waits for input before a batch (the wait after the last batch is added later)."""
    busy: list[float] = field(default_factory=list)
    """Seconds spent computing and all-reducing."""
    speed: list[float] = field(default_factory=list)
    """Mean speed while busy."""

    @classmethod
    def empty(cls, n: int, steps: int) -> Lanes:
        return cls(lanes=[[] for _ in range(n)], end=[[0.0] * steps for _ in range(n)],
                   **{k: [0.0] * n for k in ("compute", "allreduce", "send", "blocked", "barrier", "idle")})


def equations(work: Sequence[Work], rules: Sequence[StageRule], steps: int) -> Lanes:
    """The schedule when nothing is shared: :func:`ppll_compile.simulate`'s equations, batch by batch in stage
    order. The queues are FIFO: every stage takes the batches in order."""
    assert not any(r.takes_newest or r.reuses for r in rules), "the simulator models FIFO queues"
    n = len(work)
    barrier = any(r.barrier for r in rules)
    sched = Lanes.empty(n, steps)
    start = [[0.0] * steps for _ in range(n)]
    end = sched.end
    for b in range(steps):
        arrival = 0.0  # of batch b at stage j: at once at stage 0, then when stage j-1's send of it ends
        done = [0.0] * n
        for j, (w, rule) in enumerate(zip(work, rules)):
            spans = sched.lanes[j]
            free = end[j][b - 1] if b > 0 else 0.0
            begin = start[j][b] = max(arrival, free)
            sched.idle[j] += begin - free
            spans += [(b, "receive", free, begin)] if begin > free else []
            out = begin + w.early
            room = start[j + 1][b - rule.depth] if rule.sends() and b >= rule.depth else 0.0
            early = rule.sends() and rule.send_early(room=room <= out)
            if early:
                arrival = t = out + w.send
                spans += [(b, "forward", begin, out), (b, "send", out, t)]
                spans += [(b, "forward", t, t + w.late)] if w.late > 0 else []
                t += w.late
            else:
                t = begin + w.forward
                spans.append((b, "forward", begin, t))
            spans.append((b, "backward", t, t + w.backward))
            spans += [(b, "allreduce", t + w.backward, t + w.backward + w.allreduce)] if w.replicas > 1 else []
            done[j] = end[j][b] = t + w.backward + w.allreduce
            if not rule.barrier:
                end[j][b] = add_step(spans, b, done[j], w.step)
            if rule.sends() and not early:
                # never with the barrier: stage j began batch b after the barrier of b-1, by which stage j+1 had
                # started b-1 >= b - depth, so room <= start[j][b] <= out
                assert not rule.barrier, "a deferred send under the barrier would deadlock"
                put = max(end[j][b], room)
                sched.blocked[j] += put - end[j][b]
                spans.append((b, "send", end[j][b], put + w.send))
                arrival = end[j][b] = put + w.send
        if barrier:
            step = max(done)  # every stage's optimizer step on batch b waits for every stage's backward on it
            for j, w in enumerate(work):
                sched.barrier[j] += step - done[j]
                end[j][b] = add_step(sched.lanes[j], b, step, w.step)
    for j, w in enumerate(work):
        sched.compute[j], sched.allreduce[j] = steps * (w.forward + w.backward + w.step), steps * w.allreduce
        sched.send[j] = steps * w.send
        sched.busy.append(steps * (w.forward + w.backward + w.step + w.allreduce))
        sched.speed.append(1.0)
    return sched


def add_step(spans: list[tuple[int, str, float, float]], batch: int, at: float, seconds: float) -> float:
    """Add the optimizer step's span from ``at`` (none when it takes no time); its end."""
    spans += [(batch, "step", at, at + seconds)] if seconds > 0 else []
    return at + seconds

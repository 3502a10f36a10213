"""The simulator's event-driven engine: stage replicas that share processors, each progressing at its share.

The rules of :func:`ppll_compile.simulate` (its module docstring, *Sharing*) over time: every stage is a process
that yields what it waits for and works on; where it sends and whether it waits at the barrier come from its
:class:`~ppll_compile.plans.schedule.StageRule`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..plans.schedule import StageRule
from .equations import Lanes, Pool, Work


# The requests a stage's process yields to the event-driven schedule.
class _Run(NamedTuple):
    """Work ``seconds`` (at full speed); ``uses`` whether it takes a processor."""

    seconds: float
    uses: bool


class _Wait(NamedTuple):
    """Wait, taking no processor, until ``ready()``."""

    ready: Callable[[], bool]


class _Decide(NamedTuple):
    """``True`` if ``ready()`` becomes true at this instant, ``False`` once nothing else can happen at it."""

    ready: Callable[[], bool]


@dataclass
class _Shared:
    """The state the stages' processes read and write: the clock and what each stage has got to."""

    t: float
    arrived: list[int]
    """Batches that arrived at each stage (stage 0: all at once)."""
    taken: list[int]
    """Batches each stage has started."""
    done: list[int]
    """Batches each stage is done with (backward and all-reduce)."""


def _stage(j: int, w: Work, rule: StageRule, state: _Shared, sched: Lanes, *, steps: int, cpu: bool
           ) -> Iterator[Any]:
    """Stage ``j``'s life under :func:`ppll_compile.simulate`'s rules, as the requests it waits for and works on;
    it writes its spans and waits into ``sched``. ``cpu``: its transfers take a processor. FIFO: it takes the
    batches in order."""
    sends = rule.sends()
    lane = sched.lanes[j]
    for b in range(steps):
        free = state.t
        yield _Wait(lambda b=b: state.arrived[j] > b)
        begin = state.t
        sched.idle[j] += begin - free
        lane += [(b, "receive", free, begin)] if begin > free else []
        state.taken[j] = b + 1

        def room(b: int = b) -> bool:
            return b < rule.depth or state.taken[j + 1] > b - rule.depth

        yield _Run(w.early, True)
        made = state.t
        early = sends and rule.send_early(room=(yield _Decide(room)))
        if early:
            yield _Run(w.send, cpu)
            sent = state.t
            lane += [(b, "forward", begin, made), (b, "send", made, sent)]
            state.arrived[j + 1] += 1
            yield _Run(w.late, True)
            lane += [(b, "forward", sent, state.t)] if w.late > 0 else []
        else:
            yield _Run(w.late, True)
            lane.append((b, "forward", begin, state.t))
        t = state.t
        yield _Run(w.backward, True)
        lane.append((b, "backward", t, state.t))
        if w.replicas > 1:
            t = state.t
            yield _Run(w.allreduce, cpu)
            lane.append((b, "allreduce", t, state.t))
        state.done[j] = b + 1
        if rule.barrier:
            t = state.t
            yield _Wait(lambda b=b: min(state.done) > b)
            sched.barrier[j] += state.t - t
        if w.step > 0:
            t = state.t
            yield _Run(w.step, True)
            lane.append((b, "step", t, state.t))
        if sends and not early:
            t = state.t
            yield _Wait(room)
            put = state.t
            sched.blocked[j] += put - t
            yield _Run(w.send, cpu)
            lane.append((b, "send", t, state.t))
            state.arrived[j + 1] += 1
        sched.end[j][b] = state.t


def processor_sharing(work: Sequence[Work], rules: Sequence[StageRule], pools: Sequence[Pool], steps: int
                      ) -> Lanes:
    """The schedule when ``pools`` hold more threads than processors: an event-driven simulation over time.

    Between two events every running span progresses at its rate (``processors / busy`` in an oversubscribed
    pool, else 1); an event is a span ending, after which the stages go on through every step that takes no time
    (a wait that is over, a span of no work) until none is left, and only then is a send with no room deferred.
    """
    assert not any(r.takes_newest or r.reuses for r in rules), "the simulator models FIFO queues"
    n = len(work)
    sched = Lanes.empty(n, steps)
    state = _Shared(t=0.0, arrived=[steps] + [0] * (n - 1), taken=[0] * n, done=[0] * n)
    pool_of: dict[int, Pool] = {j: p for p in pools for j in p.stages}
    threads = [work[j].replicas if j in pool_of and pool_of[j].device == "cpu" else 1 for j in range(n)]
    procs = [_stage(j, w, rule, state, sched, steps=steps, cpu=j in pool_of and pool_of[j].device == "cpu")
             for j, (w, rule) in enumerate(zip(work, rules))]
    pending: list[Any] = [None] * n
    left = [0.0] * n

    def resume(j: int, value: Any = None) -> None:
        try:
            pending[j] = procs[j].send(value)
        except StopIteration:
            pending[j] = None
        if isinstance(pending[j], _Run):
            left[j] = pending[j].seconds

    for j in range(n):
        resume(j)
    while True:
        _settle(pending, left, resume)
        running = [j for j in range(n) if isinstance(pending[j], _Run)]
        if not running:
            assert all(p is None for p in pending), "the simulated stages wait for each other"
            break
        busy: dict[str, int] = {}
        for j in running:
            if pending[j].uses and j in pool_of:
                busy[pool_of[j].device] = busy.get(pool_of[j].device, 0) + threads[j]
        rate = {j: min(1.0, pool_of[j].processors / busy[pool_of[j].device])
                if pending[j].uses and j in pool_of else 1.0 for j in running}
        finish = {j: left[j] / rate[j] for j in running}
        dt = min(finish.values())
        now = state.t + dt
        for j in running:  # spans that end within rounding of the first one end with it
            left[j] = 0.0 if finish[j] - dt <= 1e-12 * now else left[j] - rate[j] * dt
        state.t = now
    for j, w in enumerate(work):
        seconds = {k: sum(t1 - t0 for _, kind, t0, t1 in sched.lanes[j] if kind == k)
                   for k in ("forward", "backward", "step", "allreduce", "send")}
        sched.compute[j] = seconds["forward"] + seconds["backward"] + seconds["step"]
        sched.allreduce[j], sched.send[j] = seconds["allreduce"], seconds["send"] - sched.blocked[j]
        sched.busy.append(sched.compute[j] + sched.allreduce[j])
        spent = sched.busy[j] + sched.send[j]
        sched.speed.append(min(1.0, steps * w.total / spent) if spent > 0 else 1.0)
    return sched


def _settle(pending: list[Any], left: list[float], resume: Callable[..., None]) -> None:
    """Go on with every stage through what takes no time at this instant; then defer the sends with no room."""
    while True:
        changed = True
        while changed:
            changed = False
            for j, request in enumerate(pending):
                if isinstance(request, _Run) and left[j] <= 0:
                    resume(j)
                elif isinstance(request, (_Wait, _Decide)) and request.ready():
                    resume(j, True)
                else:
                    continue
                changed = True
        undecided = [j for j, request in enumerate(pending) if isinstance(request, _Decide)]
        if not undecided:
            return
        for j in undecided:  # no room when nothing else happens at this instant: the send waits for the step
            resume(j, False)

"""The schedule's grids kept as golden files, and the simulator's and the ``threads`` runtime's timelines held to them.

Each file in ``tests/golden/schedule/`` holds one :func:`~ppll_compile.plans.schedule.grid` call (its first line, a
comment) and the grid it prints. ``PPLL_REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_schedule_golden.py``
rewrites them from the schedule module (and removes none); without it every test compares.

A timeline and a grid are compared in one reduced form (:func:`reduce_grid`, :func:`reduce_timeline`): per stage, the
actions in order with every action once however many slots it takes, without ``L`` (a runtime traces the loss inside
its ``forward`` span) and ``W`` (the wait at the barrier has no span). ``R``/``U`` open a turn on a new or a
reused input, ``D`` names an input the stage before sent on that the stage never trained on, and a ``send`` span is
``E`` inside the forward and ``S`` after the step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.plans.schedule import Grid
from ppll_compile.plans.timeline import Event, Timeline
from tests.grids import (
    BATCHES,
    CASES,
    GOLDEN,
    MLP,
    Case,
    golden,
    golden_grid,
    mlp_batches,
    project,
    reduce_grid,
    reduce_timeline,
    show,
)
from tests.helpers import compile_quietly, synthetic_plan

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

@pytest.mark.parametrize("name", list(CASES))
def test_the_schedule_prints_the_golden_grid(name):
    """``grid(...)`` of each case prints exactly its golden file's grid, and the file names the same call."""
    case = CASES[name]
    assert golden(case) == case.text(), f"\n{case.text()}"


def test_every_golden_file_is_a_case():
    """No golden file is left over from a case that is gone."""
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(CASES)


def test_the_reduced_form_is_the_documented_turns():
    """The reduction keeps every turn's actions once, in order (a slow stage's repeated slots, ``L`` and ``W``
    gone), and reads a timeline of that schedule's spans the same way: the forward split around an early send, a
    late send, a receive span or none, a dropped input (sent on, never trained on) and a reused one; an input the
    stage before never sent is no drop."""
    g = Grid.from_str("""
        R0 F0 F0 E0 L0 B0 W0 O0 R1 F1 L1 B1 O1 S1
        .  .  .  R0 F0 L0 B0 W0 O0 D1 R2 F2 L2 B2 O2 U2 F2 L2 B2 O2
    """)
    assert reduce_grid(g) == (("R0", "F0", "E0", "B0", "O0", "R1", "F1", "B1", "O1", "S1"),
                              ("R0", "F0", "B0", "O0", "D1", "R2", "F2", "B2", "O2", "U2", "F2", "B2", "O2"))
    spans = [(0, 0, "forward", 0, 1), (0, 0, "send", 1, 2), (0, 0, "forward", 2, 3), (0, 0, "backward", 3, 4),
             (0, 0, "step", 4, 5), (0, 1, "forward", 5, 6), (0, 1, "backward", 6, 7), (0, 1, "step", 7, 8),
             (0, 1, "send", 8, 9), (1, 0, "receive", 0, 2), (1, 0, "forward", 2, 3), (1, 0, "backward", 3, 4),
             (1, 0, "step", 4, 5), (1, 2, "forward", 9, 10), (1, 2, "backward", 10, 11), (1, 2, "step", 11, 12),
             (1, 2, "forward", 12, 13), (1, 2, "backward", 13, 14), (1, 2, "step", 14, 15)]
    timeline = Timeline.of(Event(stage=s, replica=0, batch=b, kind=k, start=t0, end=t1) for s, b, k, t0, t1 in spans)
    assert reduce_timeline(timeline, 2) == reduce_grid(g)
    spans[5:9] = [(0, 1, "forward", 5, 6), (0, 1, "backward", 6, 7), (0, 1, "step", 7, 8), (0, 2, "forward", 8, 9),
                  (0, 2, "send", 8.5, 8.6), (0, 2, "backward", 9, 10), (0, 2, "step", 10, 11)]
    timeline = Timeline.of(Event(stage=s, replica=0, batch=b, kind=k, start=t0, end=t1) for s, b, k, t0, t1 in spans)
    got = reduce_timeline(timeline, 2)
    assert got[1] == ("R0", "F0", "B0", "O0", "R2", "F2", "B2", "O2", "U2", "F2", "B2", "O2")  # 1 was never sent
    assert project(got, "order")[1] == (("R0", "F0", "B0", "O0", "R2", "F2", "B2", "O2"), ())


_COMPILED: dict[int, Any] = {}


def mlp(stages: int) -> Any:
    """:class:`MLP` (weights from seed 0) compiled into ``stages`` stages (compiled once per stage count)."""
    if stages not in _COMPILED:
        torch.manual_seed(0)
        _COMPILED[stages] = compile_quietly(MLP(), torch.randn(4, 8), gpus=stages)
    return _COMPILED[stages]


def slotted_plan(slots: tuple[int, ...]) -> Any:
    """A plan whose stage ``j`` spends ``slots[j]`` seconds on each of its block's forward, its head and loss, its
    backward and its optimizer step, and 1 s on each send: the grid's clock, but for the receive's slot."""
    specs = [{"compute": 4 * s, "fwd": s, "head_fwd": s, "bwd": s, "step": s, "out": 1} for s in slots]
    return synthetic_plan(mlp(2).plan, specs)


FIFO = [name for name, c in CASES.items() if c.queue == "fifo"]


@pytest.mark.parametrize("name", FIFO)
def test_the_simulated_timeline_follows_the_golden_grid(name):
    """The simulator (FIFO queues only) of a plan on the grid's clock: every stage takes the same actions in the
    same order as the golden grid, each send inside the forward or after the step where the grid has it."""
    case = CASES[name]
    sim = ppll_compile.simulate(slotted_plan(case.slots), steps=BATCHES, queue_depth=case.depth,
                                decoupled=case.decoupled)
    got, want = reduce_timeline(sim.timeline, case.stages), reduce_grid(golden_grid(case))
    assert got == want, f"\nsimulated:{show(got)}\ngolden:{show(want)}"


class Gate:
    """Counts each stage's forwards and optimizer steps; ``before(stage, k)`` gives the ``(kind, other stage,
    count)`` the ``k``-th optimizer step (from 0) of ``stage`` waits for: ``other stage`` has begun ``count``
    forwards (``kind="forward"``: it took that many inputs) or made ``count`` steps (``kind="step"``)."""

    LIMIT = 20.0
    """Seconds a step waits before its stage fails."""

    def __init__(self, before: Callable[[int, int], list[tuple[str, int, int]]]) -> None:
        self.before = before
        self.counts: dict[tuple[str, int], int] = {}
        self._changed = threading.Condition()

    def _count(self, kind: str, stage: int) -> int:
        with self._changed:
            k = self.counts.get((kind, stage), 0)
            self.counts[(kind, stage)] = k + 1
            self._changed.notify_all()
            return k

    def _wait(self, stage: int, k: int) -> None:
        with self._changed:
            for kind, other, count in self.before(stage, k):
                if not self._changed.wait_for(lambda key=(kind, other), n=count: self.counts.get(key, 0) >= n,
                                              self.LIMIT):
                    raise RuntimeError(f"stage {stage}'s step {k} waited {self.LIMIT} s for {count} {kind}s of "
                                       f"stage {other}")

    @contextlib.contextmanager
    def attached(self, compiled: Any) -> Iterator[Callable[[list], torch.optim.Optimizer]]:
        """Count the forwards of ``compiled``'s stages while inside; an SGD factory whose optimizers wait at this
        gate before each step."""
        owner = {id(p): i for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)}
        gate = self

        class Gated(torch.optim.SGD):
            def step(self, closure=None):
                stage = owner[id(self.param_groups[0]["params"][0])]
                gate._wait(stage, gate.counts.get(("step", stage), 0))
                out = super().step(closure)
                gate._count("step", stage)
                return out

        def counter(i: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any) -> None:
                self._count("forward", i)
            return hook

        hooks = [stage.register_forward_pre_hook(counter(i)) for i, stage in enumerate(compiled.stages)]
        try:
            yield lambda params: Gated(params, lr=0.01)
        finally:
            for h in hooks:
                h.remove()


def _latest_gate(stages: int) -> Gate:
    """Stage 0's first step (after it sent batch 0 on) waits until stage 1 took batch 0, and stage 1's first step
    until stage 0 has stepped on every batch (having sent each on at once) and stage 2, if any, has taken batch 0:
    stage 1 then takes the newest, the last batch, and the ones between are dropped."""
    def before(stage: int, k: int) -> list[tuple[str, int, int]]:
        if (stage, k) == (0, 0):
            return [("forward", 1, 1)]
        if (stage, k) == (1, 0):
            return [("step", 0, BATCHES)] + [("forward", 2, 1)] * (stages > 2)
        return []
    return Gate(before)


def _reuse_gate(stages: int) -> Gate:
    """Stage 0's step on batch ``b`` waits until stage 1 has stepped ``2 (b + 1)`` times: stage 1 trains on ``b``
    (sent before the step), finds no input waiting and trains on ``b`` again; then its memory has no input left
    to reuse, and it waits for ``b + 1`` (or the end of the input)."""
    assert stages == 2
    return Gate(lambda stage, k: [("step", 1, 2 * (k + 1))] if stage == 0 else [])


def threads_check(case: Case) -> tuple[str, Callable[[int], Gate] | None]:
    """How much of ``case``'s schedule the ``threads`` runtime makes deterministic (a :func:`project` level), and
    the gate that makes it so.

    - ``fifo`` trains on every input in order; a send goes early when the next queue has room at that moment,
      which depends on the stages' timing, except with a queue as deep as the batches (always room) and under
      the barrier (the next stage took the previous batch before the barrier let this stage go on, so the queue
      is empty): ``exact`` there, else ``order``.
    - ``latest``: the first stage takes every input in order and sends each on at once (``first``); which inputs a
      later stage drops depends on timing, made deterministic for the slow-stage-1 cases by :func:`_latest_gate`.
    - ``reuse``: every new input in order (``order``); which inputs are reused depends on timing, made
      deterministic for the two-stage slow-stage-0 cases by :func:`_reuse_gate`.
    """
    if case.queue == "fifo":
        return ("exact" if case.depth >= BATCHES or not case.decoupled else "order"), None
    if case.queue == "latest":
        return ("exact", _latest_gate) if case.slots[1] > 1 else ("first", None)
    return ("exact", _reuse_gate) if case.stages == 2 and case.slots[0] > 1 else ("order", None)


def run_threads(case: Case, gate: Gate | None) -> Timeline:
    """The traced timeline of :class:`MLP` in ``case.stages`` stages trained on :func:`mlp_batches` under
    ``threads`` with ``case``'s queue rule, depth and barrier (its optimizers waiting at ``gate``, if any)."""
    compiled = mlp(case.stages)
    with gate.attached(compiled) if gate is not None else contextlib.nullcontext(None) as gated:
        optimizer = gated if gated is not None else lambda p: torch.optim.SGD(p, lr=0.01)
        with compiled.trainer(optimizer=optimizer, runtime="threads", trace=True, queue=case.queue,
                              queue_depth=case.depth, decoupled=case.decoupled) as trainer:
            for x, y in mlp_batches():
                trainer.step(x, y)
            trainer.finish()
            return trainer.timeline()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_the_threads_timeline_follows_the_golden_grid(name):
    """The ``threads`` runtime's traced timeline equals the golden grid in what its rule makes deterministic
    (:func:`threads_check`)."""
    case = CASES[name]
    level, make_gate = threads_check(case)
    timeline = run_threads(case, make_gate(case.stages) if make_gate is not None else None)
    got = project(reduce_timeline(timeline, case.stages), level)
    want = project(reduce_grid(golden_grid(case)), level)
    assert got == want, f"\n{level}, traced:{show(got)}\ngolden:{show(want)}"

"""The schedule as data: literal grids per queue rule, and the runtimes' and simulator's timelines following it."""

import threading

import pytest

import ppll_compile
from ppll_compile.plans.schedule import Action, Grid, Memory, Op, StageRule, grid, next_input, rules
from tests.helpers import compiled_residual, image_batches, on_first_stage, sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.from_str(c) for c in text.split())


# ---- one stage's turn --------------------------------------------------------------------------
def test_a_turn_lists_what_a_stage_does_on_one_input():
    middle = StageRule(queue="fifo", first=False, last=False)
    assert middle.turn(3) == _acts("R3 F3 E3 L3 B3 O3")
    assert middle.turn(3, early=False) == _acts("R3 F3 L3 B3 O3 S3")  # no room: sent after the step
    assert StageRule(first=False, last=True).turn(3) == _acts("R3 F3 L3 B3 O3")  # the last stage sends nothing
    assert StageRule(queue="reuse", first=False, last=False).turn(3, reused=True) == _acts("U3 F3 L3 B3 O3")
    assert StageRule(decoupled=False, last=False).turn(3) == _acts("R3 F3 E3 L3 B3 W3 O3")
    assert StageRule(queue="latest", first=False).turn(3, dropped=(1, 2)) == _acts("D1 D2 R3 F3 L3 B3 O3")


def test_what_each_queue_rule_does():
    fifo, latest, reuse = (rules(3, queue=q) for q in ("fifo", "latest", "reuse"))
    assert [(r.first, r.last) for r in fifo] == [(True, False), (False, False), (False, True)]
    assert [r.takes_newest for r in latest] == [False, True, True]  # the first stage takes its inputs in order
    assert [r.reuses for r in reuse] == [False, True, True]
    assert not any(r.takes_newest or r.reuses for r in fifo)
    assert [r.send_early(room=False) for r in (fifo[0], latest[0], reuse[0])] == [False, True, False]
    assert all(r.send_early(room=True) for r in (fifo[0], latest[0], reuse[0]))
    assert [r.sends(reused) for r in fifo for reused in (False, True)] == [True, False, True, False, False, False]
    assert [r.barrier for r in rules(2, decoupled=False)] == [True, True]


@pytest.mark.parametrize("kwargs,message", [
    (dict(queue="lifo"), "queue must be one of fifo, latest, reuse, got 'lifo'"),
    (dict(depth=0), "depth must be an int >= 1, got 0 (the inputs a queue holds, e.g. 2)"),
    (dict(queue="latest", decoupled=False), "decoupled=False (a barrier before every optimizer step) needs "
                                            "queue='fifo', got queue='latest'; use decoupled=True with 'latest'"),
])
def test_a_rule_is_checked(kwargs, message):
    with pytest.raises(ValueError) as info:
        StageRule(**kwargs)
    assert str(info.value) == message


def test_actions_and_grids_print_and_parse_back():
    assert str(Action(op=Op.SEND_EARLY, batch=12)) == "E12"
    assert Action.from_str("W7") == Action(op=Op.BARRIER, batch=7)
    with pytest.raises(ValueError, match=r"^'X3' is not an action: expected one of the letters RUDFELBWOS and a "
                                         r"batch index, e.g. 'F3'$"):
        Action.from_str("X3")
    g = grid(3, 12, queue="reuse", slots=[2, 1, 1])
    assert Grid.from_str(str(g)) == g
    assert [op.span for op in Op] == ["receive", None, None, "forward", "send", "forward", "backward", None,
                                      "step", "send"]


# ---- the reuse memory and the next input -------------------------------------------------------
def test_memory_hands_out_the_newest_then_the_second_newest_input_each_once():
    memory: Memory[int] = Memory()
    assert memory.reuse() is None
    memory.remember(0)
    memory.remember(1)
    assert [memory.reuse() for _ in range(3)] == [1, 0, None]
    memory.remember(2)  # 0 is forgotten, 1 was reused already
    assert [memory.reuse() for _ in range(2)] == [2, None]
    memory.remember(3)
    memory.remember(4)
    memory.remember(5)  # only the two newest are kept
    assert [memory.reuse() for _ in range(3)] == [5, 4, None]
    memory.remember(6)
    memory.clear()
    assert memory.reuse() is None


def test_next_input_polls_then_reuses_then_waits():
    taken: list[str] = []
    waiting = [7]

    def poll():
        taken.append("poll")
        return waiting.pop(0) if waiting else None

    def wait():
        taken.append("wait")
        return 9

    memory: Memory[int] = Memory()
    reuse = StageRule(queue="reuse", first=False)
    assert next_input(reuse, poll=poll, wait=wait, memory=memory) == (7, False)
    assert next_input(reuse, poll=poll, wait=wait, memory=memory) == (7, True)
    assert next_input(reuse, poll=poll, wait=wait, memory=memory) == (9, False)
    assert taken == ["poll", "poll", "poll", "wait"]
    taken.clear()
    assert next_input(StageRule(queue="fifo", first=False), poll=poll, wait=wait, memory=memory) == (9, False)
    assert next_input(StageRule(queue="reuse", first=True), poll=poll, wait=wait, memory=memory) == (9, False)
    assert taken == ["wait", "wait"]


# ---- literal grids -----------------------------------------------------------------------------
GRIDS = {
    "fifo, 2 stages, depth 2": (dict(stages=2, batches=2), """
        R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1 .  .
        .  .  .  R0 F0 L0 B0 O0 .  R1 F1 L1 B1 O1
    """),
    "fifo, 4 stages": (dict(stages=4, batches=2), """
        R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1
        .  .  .  R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1
        .  .  .  .  .  .  R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1
        .  .  .  .  .  .  .  .  .  R0 F0 L0 B0 O0 .  R1 F1 L1 B1 O1
    """),
    # stage 1 still holds batch 2 when stage 0's forward on batch 3 ends: batch 3 goes after the step
    "fifo, depth 1, slow second stage": (dict(stages=2, batches=4, depth=1, slots=[1, 2]), """
        R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1 R2 F2 E2 L2 B2 O2 R3 F3 L3 B3 O3 S3
        .  .  .  R0 F0 F0 L0 L0 B0 B0 O0 O0 R1 F1 F1 L1 L1 B1 B1 O1 O1 R2 F2 F2 L2 L2 B2 B2 O2 O2 R3 F3 F3 L3 L3 B3 B3 O3 O3
    """),
    # depth 2: the queue holds batches 2 and 3 while stage 1 trains on 1, so every send goes early
    "fifo, depth 2, slow second stage": (dict(stages=2, batches=4, slots=[1, 3]), """
        R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1 R2 F2 E2 L2 B2 O2 R3 F3 E3 L3 B3 O3
        .  .  .  R0 F0 F0 F0 L0 L0 L0 B0 B0 B0 O0 O0 O0 R1 F1 F1 F1 L1 L1 L1 B1 B1 B1 O1 O1 O1 R2 F2 F2 F2 L2 L2 L2 B2 B2 B2 O2 O2 O2 R3 F3 F3 F3 L3 L3 L3 B3 B3 B3 O3 O3 O3
    """),
    # the barrier: every stage steps in the slot after the last backward on the batch
    "fifo, decoupled=False, 3 stages": (dict(stages=3, batches=2, decoupled=False), """
        R0 F0 E0 L0 B0 .  .  .  .  .  W0 O0 R1 F1 E1 L1 B1 .  .  .  .  .  W1 O1
        .  .  .  R0 F0 E0 L0 B0 .  .  W0 O0 .  .  .  R1 F1 E1 L1 B1 .  .  W1 O1
        .  .  .  .  .  .  R0 F0 L0 B0 W0 O0 .  .  .  .  .  .  R1 F1 L1 B1 W1 O1
    """),
    "fifo, decoupled=False, depth 1, slow first stage": (dict(stages=2, batches=2, decoupled=False, depth=1,
                                                              slots=[2, 1]), """
        R0 F0 F0 E0 L0 L0 B0 B0 W0 O0 O0 R1 F1 F1 E1 L1 L1 B1 B1 W1 O1 O1
        .  .  .  .  R0 F0 L0 B0 W0 O0 .  .  .  .  .  R1 F1 L1 B1 W1 O1
    """),
    # latest, depth 1: batch 2 arrives while batch 1 waits, and pushes it out (D1); the same for 3 and 4
    "latest, depth 1": (dict(stages=2, batches=5, queue="latest", depth=1, slots=[1, 3]), """
        R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1 R2 F2 E2 L2 B2 O2 R3 F3 E3 L3 B3 O3 R4 F4 E4 L4 B4 O4
        .  .  .  R0 F0 F0 F0 L0 L0 L0 B0 B0 B0 O0 O0 O0 D1 R2 F2 F2 F2 L2 L2 L2 B2 B2 B2 O2 O2 O2 D3 R4 F4 F4 F4 L4 L4 L4 B4 B4 B4 O4 O4 O4
    """),
    # latest, depth 2: stage 1 finds 1 and 2 waiting, takes the newest and drops 1; stage 2 never waits for room
    "latest, depth 2, 3 stages": (dict(stages=3, batches=4, queue="latest", slots=[1, 3, 1]), """
        R0 F0 E0 L0 B0 O0 R1 F1 E1 L1 B1 O1 R2 F2 E2 L2 B2 O2 R3 F3 E3 L3 B3 O3
        .  .  .  R0 F0 F0 F0 E0 L0 L0 L0 B0 B0 B0 O0 O0 O0 D1 R2 F2 F2 F2 E2 L2 L2 L2 B2 B2 B2 O2 O2 O2 R3 F3 F3 F3 E3 L3 L3 L3 B3 B3 B3 O3 O3 O3
        .  .  .  .  .  .  .  .  R0 F0 L0 B0 O0 .  .  .  .  .  .  .  .  .  .  R2 F2 L2 B2 O2 .  .  .  .  .  .  .  .  .  R3 F3 L3 B3 O3
    """),
    # reuse: a stage that finds nothing waiting trains again on its newest input (U), once; a reused input's
    # output is not sent on; the end of the input stops a stage before it reuses again
    "reuse, depth 1": (dict(stages=2, batches=3, queue="reuse", depth=1, slots=[2, 1]), """
        R0 F0 F0 E0 L0 L0 B0 B0 O0 O0 R1 F1 F1 E1 L1 L1 B1 B1 O1 O1 R2 F2 F2 E2 L2 L2 B2 B2 O2 O2
        .  .  .  .  R0 F0 L0 B0 O0 U0 F0 L0 B0 O0 R1 F1 L1 B1 O1 U1 F1 L1 B1 O1 R2 F2 L2 B2 O2 U2 F2 L2 B2 O2
    """),
    "reuse, depth 2, 3 stages": (dict(stages=3, batches=3, queue="reuse", slots=[2, 1, 1]), """
        R0 F0 F0 E0 L0 L0 B0 B0 O0 O0 R1 F1 F1 E1 L1 L1 B1 B1 O1 O1 R2 F2 F2 E2 L2 L2 B2 B2 O2 O2
        .  .  .  .  R0 F0 E0 L0 B0 O0 U0 F0 L0 B0 O0 R1 F1 E1 L1 B1 O1 U1 F1 L1 B1 O1 R2 F2 E2 L2 B2 O2
        .  .  .  .  .  .  .  R0 F0 L0 B0 O0 U0 F0 L0 B0 O0 .  R1 F1 L1 B1 O1 U1 F1 L1 B1 O1 .  R2 F2 L2 B2 O2
    """),
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_the_schedule_of_each_queue_rule(case):
    kwargs, text = GRIDS[case]
    kwargs = dict(kwargs)
    got = grid(kwargs.pop("stages"), kwargs.pop("batches"), **kwargs)
    assert got == Grid.from_str(text), f"\n{got}"


def test_every_row_of_a_grid_is_turns_of_its_rule():
    """Rows are whole turns of :meth:`StageRule.turn`, one after the other, whatever the timing (an action that
    takes several slots repeats)."""
    for kwargs, _ in GRIDS.values():
        kwargs = dict(kwargs)
        stages, batches = kwargs.pop("stages"), kwargs.pop("batches")
        g = grid(stages, batches, **kwargs)
        for j, rule in enumerate(rules(stages, queue=kwargs.get("queue", "fifo"), depth=kwargs.get("depth", 2),
                                       decoupled=kwargs.get("decoupled", True))):
            row = g.actions(j)
            acts = [a for k, a in enumerate(row) if k == 0 or row[k - 1] != a]
            while acts:
                drops = []
                while acts[0].op is Op.DROP:
                    drops.append(acts.pop(0).batch)
                b, reused = acts[0].batch, acts[0].op is Op.REUSE
                early = not rule.sends(reused) or Action(op=Op.SEND_EARLY, batch=b) in acts[:len(rule.turn(b))]
                turn = rule.turn(b, reused=reused, early=early, dropped=drops)[len(drops):]
                assert tuple(acts[:len(turn)]) == turn
                del acts[:len(turn)]


# ---- the runtimes and the simulator follow it --------------------------------------------------
def _traced(actions, kinds) -> list[tuple[str, int]]:
    """What a runtime's trace shows of ``actions``: the loss is inside the forward span."""
    return [(a.op.span, a.batch) for a in actions if a.op is not Op.LOSS and a.op.span in kinds]


def _lane(timeline, stage, kinds) -> list[tuple[str, int]]:
    events = sorted((e for e in timeline.events if e.stage == stage and e.replica == 0 and e.kind in kinds),
                    key=lambda e: e.start)
    return [(e.kind, e.batch) for e in events]


TRACED = {"threads": ("receive", "forward", "send", "backward", "step"), "sequential": ("forward", "backward", "step")}


@pytest.mark.parametrize("runtime,gpus,decoupled", [("threads", 2, True), ("threads", 3, False),
                                                     ("threads", 3, True), ("sequential", 2, True)])
def test_a_runtime_trace_follows_the_fifo_schedule(runtime, gpus, decoupled):
    """Queues as deep as the batches: every send goes early, and each stage's spans are its turns in order."""
    n = 4
    compiled = compiled_residual(gpus)
    options = {} if runtime == "sequential" else dict(queue_depth=n, decoupled=decoupled)
    with compiled.trainer(optimizer=sgd, runtime=runtime, trace=True, **options) as trainer:
        for x, y in image_batches(n):
            trainer.step(x, y)
        trainer.finish()
        timeline = trainer.timeline()
    kinds = TRACED[runtime]
    for j, rule in enumerate(rules(gpus, depth=n, decoupled=decoupled)):
        expected = [span for b in range(n) for span in _traced(rule.turn(b), kinds)]
        assert _lane(timeline, j, kinds) == expected


def test_a_reusing_stage_trace_follows_the_reuse_rule():
    """Stage 0 is slow: stage 1's spans are turns on new inputs (a receive first) and on reused ones (none sent
    on), and the inputs it reused are the ones :class:`Memory` chooses, in that order."""
    n = 5
    compiled = compiled_residual()
    slow = on_first_stage(compiled, lambda: threading.Event().wait(0.05), lr=0.05)
    with compiled.trainer(optimizer=slow, runtime="threads", queue="reuse", queue_depth=n, trace=True) as trainer:
        for x, y in image_batches(n):
            trainer.step(x, y)
        trainer.finish()
        timeline, reused = trainer.timeline(), trainer.reused[1]
    assert reused > 0
    kinds = TRACED["threads"]
    lane = _lane(timeline, 1, kinds)
    rule = rules(2, queue="reuse", depth=n)[1]
    turns = [(b, kind != "receive") for k, (kind, b) in enumerate(lane)
             if kind == "receive" or (kind == "forward" and (k == 0 or lane[k - 1][0] != "receive"))]
    assert sum(again for _, again in turns) == reused
    assert lane == [span for b, again in turns for span in _traced(rule.turn(b, reused=again), kinds)]
    memory: Memory[int] = Memory()
    for b, again in turns:
        if again:
            assert memory.reuse() == b
        else:
            memory.remember(b)


@pytest.mark.parametrize("depth,decoupled", [(1, True), (2, True), (1, False)])
def test_the_simulated_timeline_follows_the_fifo_schedule(depth, decoupled):
    """Each simulated batch is one turn, its send early or (no room) after the step; the simulator splits the
    forward around an early send."""
    plan = compiled_residual(3).plan
    sim = ppll_compile.simulate(plan, steps=6, queue_depth=depth, decoupled=decoupled)
    kinds = ("forward", "send", "backward", "step")
    assert all(s.step_cost > 0 for s in plan.stages)
    for j, rule in enumerate(rules(3, depth=depth, decoupled=decoupled)):
        lane = _lane(sim.timeline, j, kinds)
        for b in range(6):
            mine = [span for span in lane if span[1] == b]
            options = [[(a.op.span, b) for a in rule.turn(b, early=early) if a.op.span in kinds]
                       for early in (True, False)]
            options = [[s for k, s in enumerate(o) if k == 0 or o[k - 1] != s] for o in options]  # one forward
            assert mine in options
            assert mine == options[0] or not rule.barrier  # under the barrier a send always goes early

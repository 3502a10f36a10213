"""What travels between stages and when: early forwarding, decoupled=False, and the fifo, latest and reuse queues."""

import queue
import threading
import time

import pytest
import torch

from ppll_compile import StageError
from ppll_compile.runtime.messages import Message
from ppll_compile.runtime.queues import Mailbox, Recent
from tests.helpers import (
    assert_same_parameters,
    compiled_residual,
    image_batches,
    no_workers_left,
    on_first_stage,
    sgd,
    train_residual,
)

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

WAIT = 30  # seconds a gate waits before it fails the test (a hang fails instead of blocking CI)


def _msg(i: int) -> Message:
    return Message(index=i, values=(torch.zeros(1),), target=torch.zeros(1))


def _drain(box: Mailbox) -> list:
    out = []
    while True:
        try:
            out.append(box.get(timeout=0))
        except queue.Empty:
            return out


# ---- the mailbox -------------------------------------------------------------------------------
def test_fifo_mailbox_keeps_order_and_refuses_when_full():
    box = Mailbox(2)
    assert box.put(_msg(0), timeout=0) and box.put(_msg(1), timeout=0)
    assert not box.put(_msg(2), timeout=0)  # full: the sender would wait
    assert [m.index for m in _drain(box)] == [0, 1] and box.dropped() == 0


def test_latest_mailbox_never_refuses_and_hands_out_the_newest_input():
    end = object()
    box = Mailbox(2, latest=True)
    assert all(box.put(_msg(i), timeout=0) for i in range(5))  # never waits: the oldest waiting input goes
    assert box.dropped() == 3 and box.dropped() == 0  # counted once
    box.put(end, timeout=0)
    assert box.get(timeout=0).index == 4  # the newest input; 3 is dropped, END stays behind it
    assert box.dropped() == 1
    assert box.get(timeout=0) is end
    with pytest.raises(queue.Empty):
        box.get(timeout=0)


def test_latest_mailbox_never_drops_the_end_of_an_epoch():
    end = object()
    box = Mailbox(1, latest=True)
    box.put(_msg(7), timeout=0)
    assert box.put(end, timeout=0)  # the last input of the epoch stays: END does not make room for itself
    assert _drain(box)[0].index == 7 and box.dropped() == 0


def test_mailbox_room_says_whether_a_put_would_wait():
    fifo, latest = Mailbox(1), Mailbox(1, latest=True)
    assert fifo.room() and latest.room()
    fifo.put(_msg(0), timeout=0)
    latest.put(_msg(0), timeout=0)
    assert not fifo.room() and latest.room()  # a latest queue makes room by dropping its oldest input


def test_recent_reuses_the_newest_then_the_second_newest_input_each_once():
    """The exact order of the inputs ``queue="reuse"`` trains on again (copies, marked reused)."""
    recent = Recent()
    assert recent.reuse() is None
    first = _msg(0)
    recent.remember(first)
    recent.remember(_msg(1))
    again = [recent.reuse() for _ in range(3)]
    assert [m.index for m in again[:2]] == [1, 0] and again[2] is None
    assert all(m.reused for m in again[:2]) and again[1].values[0] is not first.values[0]
    recent.remember(_msg(2))  # 0 is forgotten; 1 was reused already
    assert [m.index for m in [recent.reuse()]] == [2] and recent.reuse() is None
    for i in (3, 4, 5):
        recent.remember(_msg(i))
    recent.remember(object())  # the end of an epoch is not an input
    assert [recent.reuse().index, recent.reuse().index, recent.reuse()] == [5, 4, None]
    recent.remember(_msg(6))
    recent.clear()
    assert recent.reuse() is None


# ---- early forwarding --------------------------------------------------------------------------
def _stage_started(compiled, stage: int) -> threading.Event:
    """Set when ``stage``'s block starts its first training forward."""
    started = threading.Event()
    compiled.stages[stage].register_forward_pre_hook(lambda *_: started.set())
    return started


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(WAIT):
        raise TimeoutError(what)


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_stage_sends_its_output_before_its_backward_and_step(decoupled):
    """Stage 0's first optimizer step waits until stage 1 started its forward on batch 0: that input can only
    have come before stage 0's step (before it would never come, and stage 0 would fail after WAIT seconds)."""
    compiled = compiled_residual()
    started = _stage_started(compiled, 1)
    optimizer = on_first_stage(compiled, lambda: _wait(started, "stage 1 never received batch 0"), lr=0.05)
    with compiled.trainer(optimizer=optimizer, runtime="threads", decoupled=decoupled) as trainer:
        for x, y in image_batches(3):
            trainer.step(x, y)
        trainer.finish()
        assert trainer.steps == {0: 3, 1: 3}


def test_a_stage_sends_its_output_before_its_head_runs():
    """When stage 0's head starts on a batch, the output of its block has already gone on (a ``send`` span)."""
    n = 3
    compiled = compiled_residual()
    sent_before_head = []
    with compiled.trainer(optimizer=sgd, runtime="threads", queue_depth=n, trace=True) as trainer:
        recorder = trainer.runners[0].recorder
        trainer.runners[0].head.register_forward_pre_hook(
            lambda *_: sent_before_head.append(sorted(e.batch for e in recorder.events if e.kind == "send")))
        for x, y in image_batches(n):
            trainer.step(x, y)
        trainer.finish()
    assert sent_before_head == [[0], [0, 1], [0, 1, 2]]


def test_nan_check_names_the_stage_whose_output_is_nan_before_sending_it():
    """Stage 0's output turns NaN on batch 2, and its head is slow on it: with nan_check, stage 0 fails before
    sending that output on, so stage 1 (which would fail on it first) never sees it."""
    compiled = compiled_residual()
    calls, seen = [0], []

    def poison(module, inputs, out):
        calls[0] += 1
        return tuple(v * float("nan") for v in out) if calls[0] == 3 else None

    compiled.stages[0].register_forward_hook(poison)
    compiled.stages[1].register_forward_pre_hook(lambda m, inputs: seen.append(bool(inputs[0].isnan().any())))
    trainer = compiled.trainer(optimizer=sgd, runtime="threads", nan_check=True)
    trainer.runners[0].head.register_forward_pre_hook(
        lambda m, inputs: time.sleep(0.5) if inputs[0].isnan().any() else None)
    with pytest.raises(StageError, match=r"^stage 0 failed at batch 2: FloatingPointError: output holds nan "
                                         r"\(nan_check=True\)"):
        for x, y in image_batches(5):
            trainer.step(x, y)
        trainer.finish()
    assert seen == [False, False]
    assert no_workers_left()


def test_a_send_that_waits_for_room_is_traced_once():
    """Stage 1 holds its first step until stage 0 stepped on batch 2: by then batch 1 fills the queue (depth 1),
    so batch 2's early send found no room and went after stage 0's step. Every batch has one send span."""
    n = 4
    compiled = compiled_residual()
    first = {id(p) for p in compiled.stage_parameters(0)}
    stepped = [0]
    third = threading.Event()

    class Gated(torch.optim.SGD):
        def step(self, closure=None):
            if any(id(p) in first for g in self.param_groups for p in g["params"]):
                stepped[0] += 1
                if stepped[0] == 3:
                    third.set()
            else:
                _wait(third, f"stage 0 stepped on {stepped[0]} of 3 batches")
            return super().step(closure)

    with compiled.trainer(optimizer=lambda p: Gated(p, lr=0.05), runtime="threads", queue_depth=1,
                          trace=True) as trainer:
        for x, y in image_batches(n):
            trainer.step(x, y)
        trainer.finish()
        events = trainer.timeline().events
    sends = sorted(e.batch for e in events if e.stage == 0 and e.kind == "send")
    assert sends == list(range(n))
    steps = {e.batch: e for e in events if e.stage == 0 and e.kind == "step"}
    late = [e.batch for e in events if e.stage == 0 and e.kind == "send" and e.start >= steps[e.batch].end]
    assert 2 in late  # the send that waited is traced where it happened, after the step


@pytest.mark.parametrize("gpus", [2, 3])
def test_decoupled_false_is_still_the_sequential_computation(gpus):
    data = image_batches(5, last=3)
    seq, _ = train_residual("sequential", data, gpus)
    thr, _ = train_residual("threads", data, gpus, decoupled=False, queue_depth=1)
    assert_same_parameters(seq, thr)


def test_decoupled_false_steps_only_after_every_stage_computed_its_gradients():
    """The barrier sits before the optimizer step, not after the batch: for every batch, no stage steps before
    every stage ended its backward, so the last stage's forward on a batch starts before the first one steps."""
    compiled = compiled_residual(3)
    n = 4
    with compiled.trainer(optimizer=sgd, runtime="threads", decoupled=False, trace=True) as trainer:
        for x, y in image_batches(n):
            trainer.step(x, y)
        trainer.finish()
        events = trainer.timeline().events
    for b in range(n):
        spans = {(e.stage, e.kind): e for e in events if e.batch == b}
        last_backward = max(spans[(s, "backward")].end for s in range(3))
        assert all(spans[(s, "step")].start >= last_backward for s in range(3))
        assert spans[(2, "forward")].start < spans[(0, "step")].start  # relayed on before stage 0 stepped
        if b + 1 < n:
            next_forward = min(e.start for e in events if e.batch == b + 1 and e.kind == "forward")
            assert next_forward >= last_backward


# ---- queue="latest" ----------------------------------------------------------------------------
def test_latest_takes_the_newest_input_and_the_stage_before_never_waits(tmp_path):
    """Stage 1's first step waits until stage 0 stepped on all n batches (queue_depth=1: stage 0 never waits for
    room). Then stage 1 takes batch n - 1 and drops 1 .. n - 2. Its parameters equal a hand-run reference
    that trains stage 0 on every batch and stage 1 on batches 0 and n - 1 only."""
    n = 6
    data = image_batches(n)
    compiled = compiled_residual()
    first = {id(p) for p in compiled.stage_parameters(0)}
    done = [0]
    all_fed = threading.Event()

    class Gated(torch.optim.SGD):
        def step(self, closure=None):
            if any(id(p) in first for g in self.param_groups for p in g["params"]):
                done[0] += 1
                if done[0] == n:
                    all_fed.set()
            else:
                _wait(all_fed, f"stage 0 stepped on {done[0]} of {n} batches: it waited for room")
            return super().step(closure)

    with compiled.trainer(optimizer=lambda p: Gated(p, lr=0.05, momentum=0.9), runtime="threads",
                          queue="latest", queue_depth=1, trace=True) as trainer:
        for x, y in data:
            trainer.step(x, y)
        trainer.finish()
        trained = sorted(e.batch for e in trainer.timeline().events if e.stage == 1 and e.kind == "forward")
        assert trained == [0, n - 1]
        assert trainer.steps == {0: n, 1: 2} and trainer.dropped == {0: 0, 1: n - 2}
        assert trainer.reused == {0: 0, 1: 0}
        trainer.save(tmp_path)
    with compiled.trainer(optimizer=lambda p: Gated(p, lr=0.05), runtime="threads", queue="latest") as again:
        again.load(tmp_path)
        assert again.dropped == {0: 0, 1: n - 2}  # the counter is part of the checkpoint

    reference = compiled_residual()
    with reference.trainer(optimizer=sgd, runtime="sequential") as ref:
        s0, s1 = ref.runners
        for b, (x, y) in enumerate(data):
            out, _ = s0.train_step(ref.message(x, y))
            if b in (0, n - 1):
                s1.train_step(out)
    assert_same_parameters(compiled, reference)


# ---- queue="reuse" -----------------------------------------------------------------------------
@pytest.mark.parametrize("schedule_reused", [False, True])
def test_reuse_steps_the_scheduler_on_new_inputs_only_unless_asked(schedule_reused):
    compiled = compiled_residual()
    slow = on_first_stage(compiled, lambda: threading.Event().wait(0.05), lr=0.05)
    with compiled.trainer(optimizer=slow, runtime="threads", queue="reuse", schedule_reused=schedule_reused,
                          scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)) as trainer:
        for x, y in image_batches(5):
            trainer.step(x, y)
        trainer.finish()
        later = trainer.runners[1]
        assert later.reused > 0
        assert later.scheduler.last_epoch == later.steps - (0 if schedule_reused else later.reused)
        assert trainer.runners[0].scheduler.last_epoch == 5

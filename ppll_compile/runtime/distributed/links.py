"""A ``distributed`` rank's links to its neighbours: taking inputs, sending outputs, a momentum head's weights."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn

from ...errors import PPLLError
from ...plans.plan import TensorSpec
from ...plans.schedule import StageRule, next_input
from ...plans.timeline import span
from ..messages import TRAIN, Message
from ..momentum import WeightsReceiver, WeightsSender
from ..queues import Recent
from ..runner import Runner
from .faults import Faults
from .inbox import Failure, Inbox
from .outbox import Outbox
from .wire import END, Stop, Wire, split

_STORE_POLL = 0.25  # seconds between looks at the store while waiting for a thread
_WEIGHTS_WAIT = 5.0  # seconds settle() waits for a momentum head's receiving thread to take the end marker


def feed(messages: Iterable[Message], faults: Faults) -> Iterator[Message]:
    """Rank 0's batches; a loader that raises stops the other ranks before the error propagates."""
    it = iter(messages)
    while True:
        try:
            msg = next(it)
        except StopIteration:
            return
        except Exception as e:
            faults.data_failed(e)
            raise
        yield msg


class WeightLinks:
    """This rank's ends of the momentum heads' weight links: it publishes for the head before it, or pulls for its own.

    ``pairs`` are (stage, momentum head, the next stage's parameters it follows) of every momentum head of the
    plan; ``ranks[j]`` are the ranks of stage ``j``. The runner's hooks are set here.
    """

    def __init__(self, pairs: list[tuple[int, nn.Module, list[nn.Parameter]]], *, stage: int,
                 ranks: tuple[tuple[int, ...], ...], comm: torch.device, runner: Runner, faults: Faults) -> None:
        self._stage = stage
        self._ranks = ranks
        self._faults = faults
        self.sender: WeightsSender | None = None
        self.receiver: WeightsReceiver | None = None
        self.open = False
        """This epoch's receiving thread of a momentum head runs."""
        for i, head, mirrored in pairs:
            if stage == i + 1:
                self.sender = WeightsSender(mirrored, ranks[i][0], comm)
                runner.publish_weights = self.sender.publish
                runner.publish_every = head.every
            if stage == i:
                self.receiver = WeightsReceiver(head, ranks[i + 1][0], comm)
                runner.take_weights = self.receiver.board.take

    def before_train(self) -> None:
        """Before a training step: start this epoch's receiving thread; mark the published weights as trained."""
        if self.receiver is not None and not self.open:
            self.open = True
            self.receiver.start(self._wait_thread)
        if self.sender is not None:
            self.sender.trained = True

    def end(self) -> None:
        """Close an epoch: the receiving thread is done; the publishing side sends its end marker."""
        self.open = False
        if self.sender is not None:
            peer = self._ranks[self._stage - 1][0]
            try:
                self.sender.end()
            except Exception as e:  # noqa: BLE001 - a send fails when the peer is gone
                self._faults.lost(e, peer, "sending weights to")

    def settle(self) -> None:
        """Wait for the weights still being sent, and for the receiving thread to take the end marker."""
        if self.sender is not None:
            self.sender.settle()
        if self.receiver is not None:
            self.receiver.join(_WEIGHTS_WAIT)

    def _wait_thread(self, thread: Any) -> None:
        """Wait for the last epoch's receiving thread of the momentum head, looking for failures meanwhile."""
        while thread.is_alive():
            thread.join(_STORE_POLL)
            self._faults.check_store()


class BatchSender:
    """Sends batches on: rank 0's slices to the other replicas of stage 0, outputs to the next stage, END to all.

    ``feeds`` are rank 0's further replicas of stage 0 and ``downstream`` the next stage's ranks; ``receivers``
    are both. ``open`` is true while an epoch is in flight here (batches sent or taken since the last END).
    """

    def __init__(self, *, wire: Wire, faults: Faults, outbox: Outbox, feeds: list[int], downstream: list[int],
                 receivers: list[int], data_specs: tuple[TensorSpec, ...], out_specs: tuple[TensorSpec, ...],
                 planned: int, runner: Runner, weights: WeightLinks) -> None:
        self._wire = wire
        self._faults = faults
        self._outbox = outbox
        self._feeds = feeds
        self._downstream = downstream
        self._receivers = receivers
        self._data_specs = data_specs
        self._out_specs = out_specs
        self._planned = planned
        self._runner = runner
        self._weights = weights
        self.open = False

    def relay(self, out: Message) -> None:
        """Send a training output on (called by the stage as soon as its forward made it): early always, as an
        ``isend`` posted at once finds room (the receiving thread of the next stage takes it into its queue)."""
        with span(self._runner.recorder, "send", out.index):
            self.send(out, TRAIN)

    def scatter(self, msg: Message, kind: str) -> Message:
        """Rank 0: send the other replicas of stage 0 their slices of a batch; this rank's own slice."""
        feeds = self._feeds
        if not feeds:
            return msg
        guard, specs = self._faults.guard, self._data_specs
        parts = guard(msg.index, lambda: split(msg, specs, self._planned, 1 + len(feeds)))
        self.open = True
        self._outbox.post([(dst, guard(msg.index, lambda p=p: self._wire.pack(p, kind, specs)))
                           for dst, p in zip(feeds, parts[1:])])
        return parts[0]

    def send(self, msg: Message, kind: str) -> None:
        """Send ``msg`` to the next stage, cut by rows into one slice per replica."""
        guard, specs, downstream = self._faults.guard, self._out_specs, self._downstream
        parts = guard(msg.index, lambda: split(msg, specs, self._planned, len(downstream)))
        packed = [(dst, guard(msg.index, lambda p=p: self._wire.pack(p, kind, specs)))
                  for dst, p in zip(downstream, parts)]
        self.open = True
        self._outbox.post(packed)

    def end(self) -> None:
        """Close an epoch: send END to every receiver (none on the last stage) and wait for every send."""
        end = self._wire.end()
        self._outbox.post([(dst, end) for dst in self._receivers])
        self._outbox.drain(self._receivers)
        self.open = False
        self._weights.end()

    def settle(self) -> None:
        """Wait for the sends still posted, ignoring failures (before the process group is destroyed)."""
        self._outbox.settle()


class BatchTaker:
    """Takes a stage's next input (or END, forwarded on at once) by the rules of :mod:`.schedule`.

    A receiving thread (:class:`.inbox.Inbox`) is started for each epoch at its first input; STOP or a failed
    receive becomes the StageError of the protocol of :mod:`.faults`. ``rule()`` is the stage's rule.
    """

    def __init__(self, *, wire: Wire, faults: Faults, upstream: list[int], stage: int, depth: int,
                 device: torch.device, rule: Callable[[], StageRule], runner: Runner, sender: BatchSender) -> None:
        self._wire = wire
        self._faults = faults
        self._upstream = upstream
        self._stage = stage
        self._depth = depth
        self._device = device
        self._rule = rule
        self._runner = runner
        self._sender = sender
        self._inbox: Inbox | None = None
        self._recent = Recent()

    def take(self, *, reuse: bool) -> tuple[Any, bool]:
        """The next input (or END) and whether it is a reused one (``queue="reuse"``)."""
        start = time.perf_counter()
        item, reused = self._next(reuse=reuse)
        recorder = self._runner.recorder
        if recorder is not None and isinstance(item, Message) and item.kind == TRAIN and not reused:
            recorder.add("receive", item.index, start, time.perf_counter())
        return item, reused

    def batches(self, kind: str) -> Iterator[Message]:
        """Every input in order until END, each checked to be of ``kind``."""
        while True:
            item, _ = self.take(reuse=False)
            if item is END:
                return
            yield self.expect(item, kind)

    def expect(self, msg: Message, kind: str) -> Message:
        """``msg``, failing this stage if it is not of ``kind`` (the processes made different calls)."""
        if msg.kind != kind:
            error = PPLLError(f"stage {self._stage} received an {msg.kind} batch while it expected {kind} batches: "
                              f"every process must make the same trainer calls (step/finish/fit/evaluate/save/"
                              f"load) in the same order")

            def fail() -> NoReturn:
                raise error

            self._faults.guard(msg.index, fail)
        return msg

    def stop(self) -> None:
        """Tell the receiving thread, if one runs, to stop."""
        if self._inbox is not None:
            self._inbox.stop.set()

    def _next(self, *, reuse: bool) -> tuple[Any, bool]:
        """The next input (or END) by :func:`.schedule.next_input`; ``reuse=False`` takes every input in order."""
        rule = self._rule() if reuse else dataclasses.replace(self._rule(), queue="fifo")
        item, reused = next_input(rule, poll=lambda: self._get(block=False), wait=lambda: self._get(block=True),
                                  memory=self._recent)
        if item is END:
            self._recent.clear()
            self._sender.end()
        return item, reused

    def _get(self, *, block: bool) -> Any:
        if self._inbox is None:
            self._inbox = Inbox(self._receive, self._depth, self._device, latest=self._rule().takes_newest)
        inbox = self._inbox
        if block:  # the fault protocol knows whom this rank waits on (a silent stage is found along such waits)
            self._faults.waiting_on = self._wire.receiving_from
        try:
            item = inbox.get(block=block, alarm=self._alarm, idle=self._faults.check_store)
        finally:
            self._faults.waiting_on = None
        self._runner.dropped += inbox.queue.dropped()
        if item is None:
            return None
        if item is END:
            self._inbox = None
        else:
            self._sender.open = True
        return item

    def _alarm(self, alarm: Stop | Failure) -> NoReturn:
        self._inbox = None
        if isinstance(alarm, Stop):
            self._faults.remote(alarm.report)
        self._faults.lost(alarm.error, self._wire.receiving_from, "receiving from")

    def _receive(self) -> Any:
        """Receive one batch from the upstream ranks, a part from each, joined by rows (on the inbox thread)."""
        return self._wire.receive(self._upstream)

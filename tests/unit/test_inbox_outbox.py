"""The distributed runtime's receiving thread and bounded sends in one process, with fakes of the receive and of
``isend``: order, END, the bound on what waits (and on what is outstanding), STOP and failures raised at once, the
idle calls while waiting, and a failed send naming its peer."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ppll_compile.runtime.distributed.inbox import Failure, Inbox
from ppll_compile.runtime.distributed.outbox import Outbox
from ppll_compile.runtime.distributed.wire import END, Stop
from ppll_compile.runtime.messages import Message

CPU = torch.device("cpu")
WAIT = 10.0  # seconds before a test that waits on a thread fails instead of hanging


def _msg(i: int) -> Message:
    return Message(index=i, values=(torch.full((1,), float(i)),), target=torch.zeros(1))


class Source:
    """A receive function: hands out ``items`` in order (an exception is raised), then blocks until released."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.calls = 0
        self.more = threading.Event()

    def __call__(self) -> Any:
        self.calls += 1
        if not self.items:
            assert self.more.wait(WAIT), "the inbox received more than it was given"
            return END
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


class Raised(Exception):
    def __init__(self, item: Any) -> None:
        super().__init__(item)
        self.item = item


def _alarm(item: Stop | Failure) -> None:
    raise Raised(item)


def _get(inbox: Inbox, block: bool = True, idle=lambda: None) -> Any:
    return inbox.get(block=block, alarm=_alarm, idle=idle)


def _settle(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# ---- the inbox -------------------------------------------------------------------------------------------------

def test_batches_arrive_in_order_and_end_closes_the_epoch():
    inbox = Inbox(Source([_msg(i) for i in range(5)] + [END]), depth=8, device=CPU)
    assert [_get(inbox).index for _ in range(5)] == [0, 1, 2, 3, 4]
    assert _get(inbox) is END
    inbox.thread.join(WAIT)
    assert not inbox.thread.is_alive()


def test_at_most_depth_batches_wait_and_one_more_is_held_by_the_thread():
    source = Source([_msg(i) for i in range(6)] + [END])
    inbox = Inbox(source, depth=2, device=CPU)
    _settle(lambda: source.calls == 3, "the inbox did not receive 3 batches")
    time.sleep(0.2)  # a few polls of the full queue: nothing more is received
    assert source.calls == 3
    assert _get(inbox).index == 0
    _settle(lambda: source.calls == 4, "taking a batch did not make room for one more")
    assert [_get(inbox).index for _ in range(5)] == [1, 2, 3, 4, 5] and _get(inbox) is END


def test_latest_never_holds_the_sender_and_gives_the_newest_batch():
    inbox = Inbox(Source([_msg(i) for i in range(10)] + [END]), depth=1, device=CPU, latest=True)
    inbox.thread.join(WAIT)  # it received everything with nobody taking
    assert not inbox.thread.is_alive()
    assert _get(inbox).index == 9 and _get(inbox) is END
    assert inbox.queue.dropped() == 9


def test_a_stop_is_raised_before_the_batches_waiting_ahead_of_it():
    report = {"stage": 0, "message": "ValueError: x"}
    inbox = Inbox(Source([_msg(0), _msg(1), Stop(report)]), depth=4, device=CPU)
    inbox.thread.join(WAIT)
    assert not inbox.thread.is_alive()  # it stops receiving after STOP
    with pytest.raises(Raised) as e:
        _get(inbox)
    assert isinstance(e.value.item, Stop) and e.value.item.report == report
    assert inbox.alarm is e.value.item


def test_a_failed_receive_becomes_a_failure_with_its_error():
    error = ConnectionError("peer closed")
    source = Source([_msg(0), error])
    inbox = Inbox(source, depth=4, device=CPU)
    inbox.thread.join(WAIT)
    with pytest.raises(Raised) as e:
        _get(inbox, block=False)
    assert isinstance(e.value.item, Failure) and e.value.item.error is error and source.calls == 2


def test_without_input_a_non_blocking_get_is_none_and_a_blocking_one_looks_for_failures_while_it_waits():
    source = Source([])
    inbox = Inbox(source, depth=2, device=CPU)
    assert _get(inbox, block=False) is None
    looks: list[float] = []

    def idle() -> None:
        looks.append(time.monotonic())
        if len(looks) == 2:
            source.more.set()  # the sender's END arrives after the second look

    start = time.monotonic()
    assert _get(inbox, idle=idle) is END
    assert len(looks) == 2 and looks[0] - start >= 0.2  # a look every quarter second, not at every poll


def test_stop_ends_a_thread_that_waits_for_room():
    source = Source([_msg(i) for i in range(5)])
    inbox = Inbox(source, depth=1, device=CPU)
    _settle(lambda: source.calls == 2, "the inbox did not fill")
    inbox.stop.set()
    inbox.thread.join(WAIT)
    assert not inbox.thread.is_alive() and source.calls == 2


# ---- the outbox ------------------------------------------------------------------------------------------------

class Work:
    """A posted send; ``wait`` records the order of the waits and may fail."""

    def __init__(self, log: list, name: tuple[int, int], fails: bool) -> None:
        self.log, self.name, self.fails = log, name, fails

    def wait(self) -> None:
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError(f"send {self.name} failed")


class Sends:
    """In place of ``dist.isend``: a :class:`Work` per tensor, named (receiver, the tensor's value)."""

    def __init__(self) -> None:
        self.posted: list[tuple[int, int]] = []
        self.waited: list[tuple[int, int]] = []
        self.failing: set[tuple[int, int]] = set()
        self.refused: set[int] = set()

    def __call__(self, tensor: torch.Tensor, dst: int) -> Work:
        if dst in self.refused:
            raise ConnectionError(f"rank {dst} is gone")
        name = (dst, int(tensor.item()))
        self.posted.append(name)
        return Work(self.waited, name, name in self.failing)

    def outstanding(self) -> int:
        return len(self.posted) - len(self.waited)


class Lost(Exception):
    pass


class Faults:
    """Records what :meth:`Outbox` reports lost, and raises as the real protocol does."""

    def __init__(self) -> None:
        self.lost_calls: list[tuple[str, int, str]] = []

    def lost(self, error: BaseException, peer: int, doing: str) -> None:
        self.lost_calls.append((str(error), peer, doing))
        raise Lost(str(error))


@pytest.fixture
def sends(monkeypatch) -> Sends:
    fake = Sends()
    monkeypatch.setattr(dist, "isend", fake)
    return fake


def _batch(b: int, receivers: tuple[int, ...] = (1,), tensors: int = 2) -> list[tuple[int, list[torch.Tensor]]]:
    return [(r, [torch.tensor([10 * b + k]) for k in range(tensors)]) for r in receivers]


def test_at_most_depth_batches_are_outstanding_and_the_oldest_is_waited_first(sends):
    outbox = Outbox(rank=0, depth=2, faults=Faults())
    for b in range(5):
        outbox.post(_batch(b))
        assert sends.outstanding() == 2 * min(b + 1, 2)  # two tensors per batch, two batches
    assert sends.waited == [(1, 0), (1, 1), (1, 10), (1, 11), (1, 20), (1, 21)]
    outbox.drain([1])
    assert sends.waited == sends.posted and sends.outstanding() == 0


def test_replicas_each_get_their_part_and_the_bound_counts_batches(sends):
    outbox = Outbox(rank=0, depth=1, faults=Faults())
    for b in range(3):
        outbox.post(_batch(b, receivers=(1, 2), tensors=1))
        assert sends.outstanding() == 2  # one batch: its part to each of the two replicas
    assert sends.posted == [(1, 0), (2, 0), (1, 10), (2, 10), (1, 20), (2, 20)]
    assert sends.waited == [(1, 0), (2, 0), (1, 10), (2, 10)]


def test_a_failed_send_is_reported_as_losing_its_peer(sends):
    faults = Faults()
    outbox = Outbox(rank=1, depth=1, faults=faults)
    sends.failing.add((3, 0))
    outbox.post(_batch(0, receivers=(3,), tensors=1))
    with pytest.raises(Lost):
        outbox.post(_batch(1, receivers=(3,), tensors=1))
    assert faults.lost_calls == [("send (3, 0) failed", 3, "sending to")]

    sends.refused.add(2)
    with pytest.raises(Lost):
        Outbox(rank=1, depth=1, faults=faults).post(_batch(0, receivers=(2,)))
    assert faults.lost_calls[1] == ("rank 2 is gone", 2, "sending to")


def test_drain_reports_a_failure_as_losing_the_first_receiver(sends):
    faults = Faults()
    outbox = Outbox(rank=0, depth=4, faults=faults)
    sends.failing.add((2, 10))
    outbox.post(_batch(0, receivers=(1, 2), tensors=1))
    outbox.post(_batch(1, receivers=(1, 2), tensors=1))
    with pytest.raises(Lost):
        outbox.drain([1, 2])
    assert faults.lost_calls == [("send (2, 10) failed", 1, "sending to")]


def test_settle_waits_on_the_sends_still_posted_and_reports_no_failure(sends):
    faults = Faults()
    outbox = Outbox(rank=0, depth=4, faults=faults)
    for b in range(3):
        outbox.post(_batch(b, tensors=1))
    outbox.settle()
    assert sends.waited == [(1, 0), (1, 10), (1, 20)]
    failing = Outbox(rank=0, depth=4, faults=faults)
    sends.failing.add((2, 0))
    failing.post(_batch(0, receivers=(2,), tensors=1))
    failing.settle()
    assert sends.waited[-1] == (2, 0) and faults.lost_calls == []

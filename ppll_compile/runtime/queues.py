"""The queues in front of a stage: ``Mailbox`` (FIFO or latest) and ``Recent``, the inputs ``queue="reuse"`` keeps.

``queue="fifo"``: a stage trains on every input in order, and the stage before it waits while the queue is full
(the same computation as sequential local learning). ``queue="latest"`` (PPLL's asynchronous rule): a stage takes
the newest waiting input and drops the older ones, never trained on; the stage before it never waits (a full
queue drops its oldest input). ``queue="reuse"``: FIFO, and a stage with no waiting input trains again on one of
its two newest inputs (each at most once) instead of idling, by :class:`.schedule.Memory`'s rule.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

from torch import Tensor

from ..plans.schedule import Memory
from .messages import Message


class Mailbox:
    """A bounded queue of a stage's inputs: FIFO, or ``latest`` (see the module's docstring).

    Anything that is not a :class:`Message` (the end of an epoch, a failure) is never dropped and never makes
    room for itself by dropping an input; under ``latest`` it is taken only once no input waits before it.
    """

    def __init__(self, depth: int, *, latest: bool = False) -> None:
        self._depth = depth
        self._latest = latest
        self._items: deque[Any] = deque()
        self._ready = threading.Condition()
        self._dropped = 0

    def put(self, item: Any, timeout: float | None = None) -> bool:
        """Append ``item``: FIFO waits up to ``timeout`` seconds for room (``False`` if none came); latest never
        waits."""
        with self._ready:
            if self._latest:
                while isinstance(item, Message) and len(self._items) >= self._depth:
                    oldest = next((k for k, v in enumerate(self._items) if isinstance(v, Message)), None)
                    if oldest is None:
                        break
                    del self._items[oldest]
                    self._dropped += 1
            elif not self._ready.wait_for(lambda: len(self._items) < self._depth, timeout):
                return False
            self._items.append(item)
            self._ready.notify_all()
            return True

    def get(self, timeout: float | None = None) -> Any:
        """The next item (FIFO: the oldest; latest: the newest input, older ones dropped); ``queue.Empty`` when
        none came within ``timeout`` seconds (0: do not wait)."""
        with self._ready:
            if not self._ready.wait_for(lambda: len(self._items) > 0, timeout):
                raise queue.Empty
            take = 0
            inputs = [k for k, v in enumerate(self._items) if isinstance(v, Message)] if self._latest else []
            if inputs:  # the newest input; the older ones are dropped
                older = len(inputs) - 1
                self._items = deque(v for k, v in enumerate(self._items) if k not in inputs[:-1])
                self._dropped += older
                take = inputs[-1] - older
            item = self._items[take]
            del self._items[take]
            self._ready.notify_all()
            return item

    def room(self) -> bool:
        """Whether a put would find room at once (a ``latest`` queue always makes room)."""
        with self._ready:
            return self._latest or len(self._items) < self._depth

    def dropped(self) -> int:
        """Inputs dropped since the last call."""
        with self._ready:
            n, self._dropped = self._dropped, 0
            return n


class Recent(Memory[Message]):
    """``queue="reuse"``: copies of a stage's two newest inputs, each handed out again at most once, by the rule
    of :class:`.schedule.Memory` (the newest first)."""

    @staticmethod
    def _copy(m: Message, reused: bool = False) -> Message:
        # a stage may modify its input in place (a ReLU right after the cut): keep and hand out copies
        return Message(index=m.index, values=tuple(v.clone() if isinstance(v, Tensor) else v for v in m.values),
                       target=m.target, raw=m.raw, kind=m.kind, whole=m.whole, reused=reused)

    def remember(self, item: Any) -> None:
        """Keep a copy of a new input (call it before the stage runs on it); anything else (END) is not an input."""
        if isinstance(item, Message):
            super().remember(self._copy(item))

    def reuse(self) -> Message | None:
        """A copy of the input :class:`.schedule.Memory` hands out again, marked ``reused``; ``None`` if none."""
        again = super().reuse()
        return None if again is None else self._copy(again, reused=True)

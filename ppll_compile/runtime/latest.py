"""The queue in front of a stage (``Mailbox``: FIFO or latest) and the input memory of ``queue="reuse"`` (``Recent``).

``queue="fifo"``: a stage trains on every input in order, and the stage before it waits while the queue is full
(the same computation as sequential local learning). ``queue="latest"`` (PPLL's asynchronous rule): a stage takes
the newest waiting input and drops the older ones, never trained on; the stage before it never waits (a full
queue drops its oldest input). ``queue="reuse"``: FIFO, and a stage with no waiting input trains again on one of
its two newest inputs (each at most once) instead of idling.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

from torch import Tensor

from .messages import Message

__all__ = ["Mailbox", "Recent"]


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

    def dropped(self) -> int:
        """Inputs dropped since the last call."""
        with self._ready:
            n, self._dropped = self._dropped, 0
            return n


class Recent:
    """``queue="latest"``: a stage's two newest inputs, each trained on again at most once when none is waiting."""

    def __init__(self) -> None:
        self._entries: list[list[Any]] = []  # [pristine copy, reused?], newest first

    @staticmethod
    def _copy(m: Message, reused: bool = False) -> Message:
        # a stage may modify its input in place (a ReLU right after the cut): keep and hand out copies
        return Message(index=m.index, values=tuple(v.clone() if isinstance(v, Tensor) else v for v in m.values),
                       target=m.target, raw=m.raw, kind=m.kind, whole=m.whole, reused=reused)

    def remember(self, msg: Message) -> None:
        """Keep a copy of a new input (call it before the stage runs on ``msg``)."""
        self._entries = [[self._copy(msg), False]] + self._entries[:1]

    def reuse(self) -> Message | None:
        """A copy of the newest, else the second newest, input not yet reused (marked ``reused``); ``None`` if none."""
        for entry in self._entries:
            if not entry[1]:
                entry[1] = True
                return self._copy(entry[0], reused=True)
        return None

    def clear(self) -> None:
        """Forget every input (at the end of an epoch)."""
        self._entries = []

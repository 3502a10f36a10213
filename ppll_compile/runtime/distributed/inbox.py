"""The receiving thread of the ``distributed`` runtime: one epoch's batches from upstream into a bounded queue.

Gloo's ``Work.is_completed()`` stays false until ``wait()`` is called, so a pre-posted ``irecv`` cannot be
polled; a thread that receives is what lets a stage see "no new input yet" (``queue="reuse"``), and what keeps
the sender from ever waiting under ``queue="latest"`` (the thread keeps receiving; its mailbox drops old inputs).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..queues import Mailbox
from .wire import END, Stop

_POLL = 0.05  # seconds between checks of the stop flag while a queue is full or empty
_STORE_POLL = 0.25  # seconds between calls of ``idle`` (a look at the store) while waiting for input


class Failure:
    """Receiving from upstream raised (the peer died, or the process group timed out)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Inbox:
    """A thread that receives one epoch's messages (until END, STOP or a failure) into a :class:`.queues.Mailbox`."""

    def __init__(self, receive: Callable[[], Any], depth: int, device: torch.device, *, latest: bool = False) -> None:
        self.queue = Mailbox(depth, latest=latest)
        self.stop = threading.Event()
        self.alarm: Stop | Failure | None = None
        """Set as soon as STOP or a failure is received, so the trainer need not drain the queue first."""
        self._receive = receive
        self._device = device
        self.thread = threading.Thread(target=self._run, name="ppll-receive", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while not self.stop.is_set():
            try:
                item = self._receive()
            except BaseException as e:  # noqa: BLE001 - the trainer turns it into a StageError
                item = Failure(e)
            if isinstance(item, (Stop, Failure)):
                self.alarm = item
            self._put(item)
            if item is END or isinstance(item, (Stop, Failure)):
                return

    def _put(self, item: Any) -> None:
        while not self.stop.is_set() and not self.queue.put(item, timeout=_POLL):
            pass

    def get(self, *, block: bool, alarm: Callable[[Stop | Failure], None], idle: Callable[[], None]) -> Any:
        """The next item received (a message or END); ``None`` when not ``block`` and none is waiting.

        ``alarm(item)`` is called (and must raise) on STOP or a failure, as soon as one is received;
        ``idle()`` is called every quarter second while waiting (to look for failures reported elsewhere).
        """
        waited = 0.0
        while True:
            if self.alarm is not None:
                alarm(self.alarm)
            try:
                item = self.queue.get(timeout=_POLL if block else 0)
                break
            except queue.Empty:
                if not block:
                    return None
                waited += _POLL
                if waited >= _STORE_POLL:
                    waited = 0.0
                    idle()
        if isinstance(item, (Stop, Failure)):
            alarm(item)
        return item

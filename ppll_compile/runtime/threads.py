"""The ``threads`` runtime: one worker thread per stage, bounded queues between them (FIFO or latest)."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import PPLLError, StageError
from ..timeline import span
from .base import Losses, Runtime
from .latest import Recent
from .messages import Message
from .runner import Runner

__all__ = ["ThreadsRuntime"]

_END = object()
_POLL = 0.05  # seconds between checks for a failed stage while waiting on a queue
_RELEASE = 0.5  # seconds close() (or an interrupt) waits for the workers before leaving them to stop alone


class _Stopped(Exception):
    """Raised inside a worker (or the caller) waiting on a queue once another stage has failed."""


class ThreadsRuntime(Runtime):
    """One worker thread per stage, bounded queues between them; FIFO (same computation as sequential) or latest.

    ``decoupled=False`` lets a batch in only after the last stage finished the one before (a barrier per
    batch: relaying alone, without decoupled updates).
    """

    def __init__(self, runners: list[Runner], *, depth: int, latest: bool, threads_per_stage: int,
                 decoupled: bool = True) -> None:
        self.runners = runners
        self._decoupled = decoupled
        self._fed = self._done = 0  # batches put in / finished by the last stage (decoupled=False waits on them)
        self.num_stages = len(runners)
        self._depth = depth
        self._latest = latest
        self._threads_per_stage = threads_per_stage
        self._workers: list[threading.Thread] = []
        self._queues: list[queue.Queue] = []
        self._stop = threading.Event()
        self._interrupted = False
        self._lock = threading.Lock()
        self._losses: list[list[Any]] = [[] for _ in runners]

    def _start(self) -> None:
        self._caller_threads = torch.get_num_threads()  # workers set their share; restored on join
        self._queues = [queue.Queue(maxsize=self._depth) for _ in self.runners]
        self._workers = [threading.Thread(target=self._work, args=(i,), name=f"ppll-stage-{i}", daemon=True)
                         for i in range(self.num_stages)]
        for w in self._workers:
            w.start()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            self._join(_RELEASE)
            raise self.error
        if self._interrupted:
            raise PPLLError("this trainer was interrupted (KeyboardInterrupt) and its queued batches dropped; "
                            "build a new trainer (and load a checkpoint) to go on training")

    def step(self, msg: Message | None) -> Losses:
        """Put ``msg`` into stage 0's queue (waiting while it is full); the losses the stages finished since."""
        assert msg is not None
        self._raise_if_failed()
        if not self._workers:
            self._start()
        if any(isinstance(v, torch.Tensor) and v.is_cuda for v in (*msg.values, msg.target)):
            event = torch.cuda.Event()  # the caller made them on its stream; stage 0 works on its own
            event.record()
            msg.events.append(event)
        with self._interruptible():
            try:
                self._put(self._queues[0], msg)
                self._fed += 1
                while not self._decoupled and self._done < self._fed:  # every stage finishes it before the next
                    if self._stop.wait(_POLL / 50):
                        raise _Stopped
            except _Stopped:
                self._raise_if_failed()
        return self._collect()

    def finish(self) -> Losses:
        """Send END down the stages and join the workers; the losses not yet returned."""
        self._raise_if_failed()
        if self._workers:
            with self._interruptible():
                try:
                    self._put(self._queues[0], _END)
                except _Stopped:
                    pass
                self._join()
            self._raise_if_failed()
        return self._collect()

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        """Ctrl-C (KeyboardInterrupt) in the caller stops every worker before it propagates."""
        try:
            yield
        except KeyboardInterrupt:
            self._interrupted = True
            self.close()
            raise

    def _join(self, wait: float | None = None) -> None:
        """Wait for the workers to end (at most ``wait`` seconds; then leave them to stop on their own)."""
        if self.error is not None:
            self._stop.set()
        end = None if wait is None else time.monotonic() + wait
        for w in self._workers:
            while w.is_alive() and (end is None or time.monotonic() < end):
                w.join(_POLL)
                if self.error is not None:
                    self._stop.set()
        if self._workers:
            torch.set_num_threads(self._caller_threads)
        self._workers = []

    def _collect(self) -> Losses:
        with self._lock:
            taken, self._losses = self._losses, [[] for _ in self.runners]
        out: Losses = []
        for items in taken:
            for _, event in items:
                if event is not None:
                    event.synchronize()
            out.append([float(loss) for loss, _ in items])
        return out

    def close(self) -> None:
        """Stop the workers and wait for them up to half a second. A worker in the middle of a step (which cannot
        be interrupted) ends as soon as it finishes that step, without sending its result on."""
        self._stop.set()
        self._join(_RELEASE)

    @property
    def stopped(self) -> bool:
        """Whether a stage failed or the caller was interrupted (Ctrl-C): the runtime can only be closed."""
        return self.error is not None or self._interrupted

    def abandon(self) -> None:
        """Its trainer is gone: every worker ends at its next look at the queues (within ``_POLL``)."""
        self._stop.set()

    def _put(self, q: queue.Queue, item: Any) -> None:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                q.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def _get(self, q: queue.Queue) -> Any:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                return q.get(timeout=_POLL)
            except queue.Empty:
                continue

    def _next(self, i: int, recent: Recent) -> tuple[Any, bool]:
        """The next input of stage ``i`` and whether it is a reused one (``queue="latest"``)."""
        q = self._queues[i]
        if self._latest and i > 0:
            try:
                msg = q.get_nowait()
            except queue.Empty:
                again = recent.reuse()
                if again is not None:
                    return again, True
                msg = self._get(q)
            if isinstance(msg, Message):
                recent.remember(msg)
            return msg, False
        return self._get(q), False

    def _work(self, i: int) -> None:
        torch.set_num_threads(self._threads_per_stage)
        r = self.runners[i]
        if r.device.type == "cuda":
            torch.cuda.set_device(r.device)
        out_q = self._queues[i + 1] if i + 1 < self.num_stages else None
        stream = torch.cuda.stream(torch.cuda.Stream(r.device)) if r.device.type == "cuda" \
            else contextlib.nullcontext()
        recent = Recent()
        msg = None
        try:
            with stream:
                while True:
                    start = time.perf_counter()
                    msg, reused = self._next(i, recent)
                    if r.recorder is not None and isinstance(msg, Message):
                        r.recorder.add("receive", msg.index, start, time.perf_counter())
                    if msg is _END:
                        if out_q is not None:
                            self._put(out_q, _END)
                        return
                    out, loss = r.train_step(msg)
                    r.reused += reused
                    event = None
                    if r.device.type == "cuda":
                        event = torch.cuda.Event()
                        event.record(torch.cuda.current_stream(r.device))
                    with self._lock:
                        self._losses[i].append((loss, event))
                        self._done += out_q is None
                    if out is not None and not reused:
                        with span(r.recorder, "send", out.index):
                            self._put(out_q, out)  # type: ignore[arg-type]
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - every failure must stop the pipeline and reach the caller
            batch = msg.index if isinstance(msg, Message) else None
            with self._lock:
                if self.error is None:
                    self.error = StageError(i, batch, f"{type(e).__name__}: {e}", traceback.format_exc())
                    self.error.__cause__ = e
            self._stop.set()

"""The ``threads`` runtime: one worker thread per stage, bounded queues between them (FIFO, latest or reuse)."""

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
from ..plans.schedule import StageRule, next_input, rules
from ..plans.timeline import span
from .base import Losses, Runtime
from .messages import Message
from .queues import Mailbox, Recent
from .runner import Runner, StageCancelled

_END = object()
_POLL = 0.05  # seconds between checks for a failed stage while waiting on a queue
_RELEASE = 0.5  # seconds close() (or an interrupt) waits for the workers before leaving them to stop alone


class _Stopped(Exception):
    """Raised inside a worker (or the caller) waiting on a queue once another stage has failed."""


class ThreadsRuntime(Runtime):
    """One worker thread per stage, bounded queues between them: ``fifo`` (the same computation as sequential),
    ``latest`` or ``reuse`` (see :mod:`.queues`), by the rules of :mod:`.schedule`.

    A stage sends its output on as soon as its forward made it (early forwarding), a copy of it (the next stage
    may write into its input while this one's backward reads the output). When a FIFO queue is full, the send
    waits until the stage's step is done (the stage never waits for room while holding the seeded-randomness
    lock). ``decoupled=False`` puts a barrier of all the stages before every optimizer step: the stages still
    overlap within a batch, and no stage updates on batch ``t`` before every stage computed its gradients on it
    (relaying alone, without decoupled updates).
    """

    queues = ("fifo", "latest", "reuse")
    pipelined = True
    can_move_cuts = True

    @classmethod
    def build(cls, setup: Runtime.Setup) -> ThreadsRuntime:
        """A worker thread for every stage of ``setup.plan`` on its device, with its share of the CPU threads."""
        return cls(setup.local_runners(), depth=setup.depth, queue=setup.queue, threads_per_stage=setup.threads_each(),
                   decoupled=setup.decoupled)

    def __init__(self, runners: list[Runner], *, depth: int, queue: str, threads_per_stage: int,
                 decoupled: bool = True) -> None:
        self.runners = runners
        self.num_stages = len(runners)
        self._depth = depth
        self._queue = queue
        self._threads_per_stage = threads_per_stage
        self._workers: list[threading.Thread] = []
        self._left: list[threading.Thread] = []  # workers a bounded join left running (inside a stage's own code)
        self._boxes: list[Mailbox] = []
        self._stop = threading.Event()
        self._barrier = None if decoupled else threading.Barrier(len(runners))
        self._interrupted = False
        self._closed = False
        self._lock = threading.Lock()
        self._losses: list[list[Any]] = [[] for _ in runners]
        self._decoupled = decoupled
        self.replace_runners(runners)

    def replace_runners(self, runners: list[Runner]) -> None:
        """Train ``runners`` from the next batch on (as many as before; call :meth:`drain` first): a moved cut."""
        assert not self._workers and len(runners) == self.num_stages, "drain before replacing the same number of stages"
        self.runners = runners
        for r, rule in zip(runners, self._rules):
            r.copy_sent = True
            r.before_step = self._wait_barrier if rule.barrier else None

    @property
    def _rules(self) -> tuple[StageRule, ...]:
        """What each stage does next (:mod:`.schedule`)."""
        return rules(self.num_stages, queue=self._queue, depth=self._depth, decoupled=self._decoupled)

    def _start(self) -> None:
        self._caller_threads = torch.get_num_threads()  # workers set their share; restored on join
        self._boxes = [Mailbox(self._depth, latest=rule.takes_newest) for rule in self._rules]
        self._workers = [threading.Thread(target=self._work, args=(i,), name=f"ppll-stage-{i}", daemon=True)
                         for i in range(self.num_stages)]
        for w in self._workers:
            w.start()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            self._join(_RELEASE)
            raise self.error.with_traceback(None)  # the frames of earlier raises (and their trainer) are not kept
        if self._interrupted:
            raise PPLLError("this trainer was interrupted (KeyboardInterrupt) and its queued batches dropped; "
                            "build a new trainer (and load a checkpoint) to go on training")

    def step(self, msg: Message | None) -> Losses:
        """Put ``msg`` into stage 0's queue (waiting while it is full); the losses the stages finished since."""
        assert msg is not None
        self._raise_if_failed()
        if self._closed:
            raise PPLLError("this trainer was closed (close(), or the end of its with block): its stages no longer "
                            "train; build a new trainer (and load a checkpoint) to go on training")
        if not self._workers:
            self._start()
        if any(isinstance(v, torch.Tensor) and v.is_cuda for v in (*msg.values, msg.target)):
            event = torch.cuda.Event()  # the caller made them on its stream; stage 0 works on its own
            event.record()
            msg.events.append(event)
        with self._interruptible():
            try:
                self._put(self._boxes[0], msg)
            except _Stopped:
                self._raise_if_failed()
        return self._collect()

    def finish(self) -> Losses:
        """Send END down the stages and join the workers; the losses not yet returned."""
        self.drain()
        return self._collect()

    def drain(self) -> None:
        """Send END down the stages and join the workers, keeping the losses they finished for the next :meth:`step`
        or :meth:`finish`; the next step starts the workers again."""
        self._raise_if_failed()
        if self._workers:
            with self._interruptible():
                try:
                    self._put(self._boxes[0], _END)
                except _Stopped:
                    pass
                self._join()
            self._raise_if_failed()

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
            self._halt()
        end = None if wait is None else time.monotonic() + wait
        for w in self._workers:
            while w.is_alive() and (end is None or time.monotonic() < end):
                w.join(_POLL)
                if self.error is not None:
                    self._halt()
        if self._workers:
            torch.set_num_threads(self._caller_threads)
        self._left += [w for w in self._workers if w.is_alive()]
        self._workers = []

    def wait_stopped(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` seconds for every worker thread to end; the stages whose workers still run."""
        end = time.monotonic() + timeout
        for w in (*self._workers, *self._left):
            w.join(max(0.0, end - time.monotonic()))
        self._left = [w for w in self._left if w.is_alive()]
        return sorted(int(w.name.rsplit("-", 1)[1]) for w in (*self._workers, *self._left) if w.is_alive())

    def _collect(self) -> Losses:
        with self._lock:
            taken, self._losses = self._losses, [[] for _ in self.runners]
        for items in taken:
            for _, event, _ in items:
                if event is not None:
                    event.synchronize()
        return Losses([[float(loss) for loss, _, _ in items] for items in taken],
                      [[size for _, _, size in items] for items in taken])

    def close(self) -> None:
        """Cancel every stage, stop the workers and wait for them up to half a second. A worker inside a stage's own
        code (a forward, which cannot be interrupted) ends when that code returns, before its backward and step:
        a cancelled stage never changes its parameters again (:attr:`.Runner.cancelled`)."""
        self._closed = True
        self._cancel()
        self._halt()
        self._join(_RELEASE)

    @property
    def stopped(self) -> bool:
        """Whether a stage failed or the caller was interrupted (Ctrl-C): the runtime can only be closed."""
        return self.error is not None or self._interrupted

    def abandon(self) -> None:
        """Its trainer is gone: every stage is cancelled and every worker ends at its next look at the queues
        (within ``_POLL``), or, inside a stage's forward, before its backward and step."""
        self._cancel()
        self._halt()

    def _cancel(self) -> None:
        for r in self.runners:
            r.cancelled = True

    def _halt(self) -> None:
        """Tell every worker to stop: at its next look at a queue, or now if it waits at the barrier."""
        self._stop.set()
        if self._barrier is not None:
            self._barrier.abort()

    def _wait_barrier(self) -> None:
        try:
            self._barrier.wait()  # type: ignore[union-attr]
        except threading.BrokenBarrierError:
            raise _Stopped from None

    def _put(self, box: Mailbox, item: Any) -> None:
        while not box.put(item, timeout=_POLL):
            if self._stop.is_set():
                raise _Stopped

    def _get(self, box: Mailbox, timeout: float | None = None) -> Any:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                return box.get(timeout=_POLL if timeout is None else timeout)
            except queue.Empty:
                if timeout is not None:
                    raise

    def _next(self, rule: StageRule, box: Mailbox, recent: Recent) -> tuple[Any, bool]:
        """The next input of a stage (or END) and whether it is a reused one, by :func:`.schedule.next_input`."""
        def poll() -> Any:
            try:
                return self._get(box, timeout=0)
            except queue.Empty:
                return None

        return next_input(rule, poll=poll, wait=lambda: self._get(box), memory=recent)

    def _work(self, i: int) -> None:
        r, rule = self.runners[i], self._rules[i]
        out_box = self._boxes[i + 1] if i + 1 < self.num_stages else None
        recent = Recent()
        msg = None
        try:  # the worker's own setup too: a failure there stops the pipeline like one in a step
            torch.set_num_threads(self._threads_per_stage)
            if r.device.type == "cuda":
                torch.cuda.set_device(r.device)
            stream = torch.cuda.stream(torch.cuda.Stream(r.device)) if r.device.type == "cuda" \
                else contextlib.nullcontext()
            with stream:
                while True:
                    start = time.perf_counter()
                    msg, reused = self._next(rule, self._boxes[i], recent)
                    r.dropped += self._boxes[i].dropped()
                    if r.recorder is not None and isinstance(msg, Message) and not reused:
                        r.recorder.add("receive", msg.index, start, time.perf_counter())
                    if msg is _END:
                        r.flush()  # the end of the data: a partial accumulation group steps
                        if out_box is not None:
                            self._put(out_box, _END)
                        return
                    waiting: list[Message] = []  # an output a full FIFO queue had no room for yet

                    def send(out: Message) -> None:
                        start = time.perf_counter()
                        box: Mailbox = out_box  # type: ignore[assignment]
                        if not (rule.send_early(room=box.room()) and box.put(out, timeout=0)):
                            waiting.append(out)  # sent (and traced) after the step
                        elif r.recorder is not None:
                            r.recorder.add("send", out.index, start, time.perf_counter())

                    _, loss = r.train_step(msg, send if rule.sends(reused) else None)
                    r.reused += reused
                    event = None
                    if r.device.type == "cuda":
                        event = torch.cuda.Event()
                        event.record(torch.cuda.current_stream(r.device))
                    with self._lock:
                        self._losses[i].append((loss, event, msg.size))
                    for out in waiting:
                        with span(r.recorder, "send", out.index):
                            self._put(out_box, out)  # type: ignore[arg-type]
        except (_Stopped, StageCancelled):
            return
        except BaseException as e:  # noqa: BLE001 - every failure must stop the pipeline and reach the caller
            batch = msg.index if isinstance(msg, Message) else None
            with self._lock:
                if self.error is None:
                    self.error = StageError(i, batch, f"{type(e).__name__}: {e}", traceback.format_exc())
                    self.error.__cause__ = e
            self._halt()

"""Per-stage event timelines: recorded by the runtimes (``trace=True``) or predicted by the simulator.

A timeline is a list of :class:`Event` spans ``(stage, replica, batch, kind, start, end)`` in seconds from
a common origin. It is saved in the Chrome trace-event format (one complete ``"X"`` event per span, the
stage as ``pid`` and the replica as ``tid``), so a file opens in Perfetto or ``chrome://tracing`` as well
as in ``ppll-plan --gantt``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import PPLLError

KINDS = ("receive", "forward", "backward", "allreduce", "step", "send")
"""What a span is: waiting for the next input, the stage's forward (block, head, loss; under Pipe-BD also the
teacher), its backward, the gradient all-reduce of a replicated stage (simulated only: the runtimes overlap
it with the backward), the optimizer step, and handing the output to the next stage (waiting for room
included)."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One span of one stage replica's work on one batch."""

    stage: int
    """Stage index."""
    replica: int
    """Replica of the stage (0 unless the stage is replicated)."""
    batch: int
    """Index of the batch the span belongs to."""
    kind: str
    """One of :data:`KINDS`."""
    start: float
    """Seconds from the timeline's origin."""
    end: float
    """Seconds from the timeline's origin (``>= start``)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """Spans of every stage replica, and where they came from (``simulated`` or ``measured``)."""

    events: tuple[Event, ...]
    """The spans, ordered by start time."""
    source: str = "measured"
    """``measured`` (a runtime's trace) or ``simulated`` (:func:`ppll_compile.simulate`)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form facts about the run: model, runtime, batch size, ..."""

    @classmethod
    def of(cls, events: Iterable[Event], source: str = "measured", **meta: Any) -> Timeline:
        """A timeline of ``events`` shifted so that the earliest starts at 0."""
        events = sorted(events, key=lambda e: (e.start, e.stage, e.replica))
        t0 = events[0].start if events else 0.0
        shifted = tuple(Event(stage=e.stage, replica=e.replica, batch=e.batch, kind=e.kind, start=e.start - t0,
                              end=e.end - t0) for e in events)
        return cls(events=shifted, source=source, meta=dict(meta))

    @property
    def lanes(self) -> list[tuple[int, int]]:
        """Every (stage, replica) with a span, in order."""
        return sorted({(e.stage, e.replica) for e in self.events})

    @property
    def span(self) -> float:
        """Seconds from the origin to the last span's end."""
        return max((e.end for e in self.events), default=0.0)

    def busy(self, stage: int, kinds: Iterable[str] = ("forward", "backward", "allreduce", "step")) -> float:
        """Seconds the first replica of ``stage`` spent on spans of ``kinds`` (default: computing)."""
        kinds = set(kinds)
        return sum(e.duration for e in self.events if e.stage == stage and e.replica == 0 and e.kind in kinds)

    def to_chrome(self) -> dict[str, Any]:
        """The Chrome trace-event form (microseconds), as :meth:`save` writes it."""
        return {
            "traceEvents": [{"name": e.kind, "cat": self.source, "ph": "X", "ts": e.start * 1e6,
                             "dur": e.duration * 1e6, "pid": e.stage, "tid": e.replica,
                             "args": {"batch": e.batch}} for e in self.events],
            "displayTimeUnit": "ms",
            "otherData": {"source": self.source, **self.meta},
        }

    def save(self, path: str | Path) -> Path:
        """Write the timeline as a Chrome trace-event JSON file."""
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        """Read a file written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise PPLLError(f"trace file {str(path)!r} does not exist; write one with trainer.timeline().save(path)")
        try:
            data = json.loads(path.read_text())
            other = dict(data.get("otherData", {}))
            events = tuple(Event(stage=int(e["pid"]), replica=int(e["tid"]), batch=int(e["args"]["batch"]),
                                 kind=str(e["name"]), start=float(e["ts"]) / 1e6,
                                 end=(float(e["ts"]) + float(e["dur"])) / 1e6)
                           for e in data["traceEvents"] if e.get("ph") == "X")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PPLLError(f"{path}: not a ppll-compile trace file ({type(e).__name__}: {e}); write one with "
                            f"trainer.timeline().save(path)") from None
        unknown = sorted({e.kind for e in events} - set(KINDS))
        if unknown:
            raise PPLLError(f"{path}: unknown span kind(s) {unknown}; known kinds: {', '.join(KINDS)}")
        return cls(events=events, source=str(other.pop("source", "measured")), meta=other)


class Recorder:
    """Collects one stage replica's spans during training (``trace=True``); times are ``time.perf_counter()``.

    On a GPU each span ends with a synchronisation of the stage's device, so that it covers the kernels it
    launched; tracing therefore costs some of the overlap between the host and the device.
    """

    def __init__(self, stage: int, replica: int = 0, device: torch.device | None = None) -> None:
        self.stage = stage
        self.replica = replica
        self._cuda = device if device is not None and device.type == "cuda" else None
        self._wall = time.time() - time.perf_counter()  # spans of several processes (or machines) line up
        self.events: list[Event] = []

    def add(self, kind: str, batch: int, start: float, end: float) -> None:
        """Record a span from ``time.perf_counter()`` readings."""
        self.events.append(Event(stage=self.stage, replica=self.replica, batch=batch, kind=kind,
                                 start=start + self._wall, end=end + self._wall))

    @contextlib.contextmanager
    def span(self, kind: str, batch: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda is not None:
                torch.cuda.synchronize(self._cuda)
            self.add(kind, batch, start, time.perf_counter())


def span(recorder: Recorder | None, kind: str, batch: int) -> contextlib.AbstractContextManager[None]:
    """``recorder.span(kind, batch)``, or nothing when not tracing."""
    return recorder.span(kind, batch) if recorder is not None else contextlib.nullcontext()

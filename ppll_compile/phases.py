"""Where planning spends its time: ``with record_phases() as seconds: plan(...)`` adds up each phase's seconds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PHASES", "record_phases"]

PHASES = ("trace", "cost", "cuts", "heads", "partition")
"""The timed phases of planning: torch.fx capture, per-node measurement on fake tensors, legal cuts, the heads'
measurement, and the partitioner's solve."""

_recorders: list[dict[str, float]] = []


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the seconds spent inside this block to phase ``name`` of every active :func:`record_phases`."""
    if not _recorders:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        spent = time.perf_counter() - start
        for seconds in _recorders:
            seconds[name] = seconds.get(name, 0.0) + spent


@contextmanager
def record_phases() -> Iterator[dict[str, float]]:
    """A dict that fills with the seconds of every phase (see :data:`PHASES`) run inside the block."""
    seconds = {name: 0.0 for name in PHASES}
    _recorders.append(seconds)
    try:
        yield seconds
    finally:
        _recorders.remove(seconds)

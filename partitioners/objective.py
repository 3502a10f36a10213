"""The stage-cost objective, defined once: what every solver minimises and what a plan reports for each stage.

A stage over segments ``[a, b)`` on ``r`` replicas of a device of relative speed ``s`` takes

    compute = work / (s r) + allreduce(grad, r)       send = comm[b-1] / r       cost = compute + send

seconds per batch, where ``work = sum(compute[a:b]) - start[a] + head[b-1]`` (the backbone's segments, less what
a stage starting at ``a`` saves because its input arrives detached, plus the auxiliary head at its cut) and
``allreduce`` is a ring all-reduce of the stage's gradient bytes (exactly 0 for one replica). With measured
per-replica times (``split``), ``work / (s r)`` for ``r >= 2`` is the measured share plus the head over ``r``.
Sums are differences of float64 prefix sums, evaluated identically by the exact solver, the replica solver and
the plan's assembly, so a plan's ``cost`` of each stage is the solver's objective to the last bit.

Topology (:class:`Links`): devices are numbered as the stages are laid out (stage ``j``'s replicas take the next
``r`` devices) and ``gpus_per_node`` consecutive devices share a node. A stage's send takes ``cross_comm[b-1]``
instead of ``comm[b-1]`` when its last device and the next stage's first sit on different nodes, and its
all-reduce runs at the inter-node bandwidth when its replicas span nodes (else the intra-node one). So a stage's
cost depends on where it sits (its first device), as it does on its device's speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Links:
    """Where consecutive devices sit (``gpus_per_node`` per node) and the bandwidths of the links inside and
    across nodes; ``gpus_per_node=None`` is one node (no link crosses)."""

    gpus_per_node: int | None = None
    """Devices per node, or ``None`` for a single node."""
    intra: float = math.inf
    """Bytes per second of a link inside a node."""
    inter: float = math.inf
    """Bytes per second of a link across nodes."""

    def crosses(self, first, replicas):
        """Whether a stage on devices ``first .. first + replicas - 1`` sends to a device on another node (the next
        stage's first device, ``first + replicas``); scalars or broadcast arrays."""
        after = np.asarray(first) + np.asarray(replicas)
        return _scalar(after % self.gpus_per_node == 0 if self.gpus_per_node else np.zeros(after.shape, bool))

    def spans(self, first, replicas):
        """Whether the replicas of a stage on devices ``first .. first + replicas - 1`` sit on more than one node."""
        first, last = np.asarray(first), np.asarray(first) + np.asarray(replicas) - 1
        g = self.gpus_per_node
        return _scalar(first // g != last // g if g else np.zeros(last.shape, bool))

    def allreduce_bandwidth(self, first, replicas):
        """Bytes per second of the all-reduce of a stage on devices ``first .. first + replicas - 1``: the
        inter-node link's when its replicas span nodes, else the intra-node link's."""
        return _scalar(np.where(self.spans(first, replicas), self.inter, self.intra))

    def across(self, comm: Sequence[float] | None) -> list[float] | None:
        """Seconds over the inter-node link of sends that take ``comm`` seconds inside a node (``None`` without
        nodes, or without sends)."""
        if self.gpus_per_node is None or comm is None:
            return None
        if self.intra == self.inter:
            return [float(c) for c in comm]
        return [float(c) * self.intra / self.inter for c in comm]

    @staticmethod
    def firsts(replicas: Sequence[int]) -> list[int]:
        """The first device of each stage when stage ``j`` runs on ``replicas[j]`` consecutive devices."""
        return [int(x) for x in np.concatenate(([0], np.cumsum(replicas)[:-1]))] if len(replicas) else []


def _scalar(values: np.ndarray):
    """A 0-d array as its Python value, any other as itself."""
    return values.item() if values.ndim == 0 else values


def allreduce_seconds(nbytes, replicas, bandwidth):
    """Seconds of a ring all-reduce of ``nbytes`` over ``replicas`` devices: ``2 (r-1)/r * nbytes / bandwidth``.

    Exactly 0 for one replica; scalars or broadcast arrays, identical bits either way.
    """
    return 2 * (replicas - 1) / replicas * nbytes / bandwidth


def stage_seconds(work, comm, *, speed=1.0, replicas=1, grad_bytes=0.0, bandwidth=math.inf, split=None):
    """``(compute, send)`` seconds of a stage (see the module docstring); its cost is ``compute + send``.

    ``work``: the stage's seconds on one device of speed 1; ``comm``: seconds to send its boundary at the full
    batch; ``split``: measured seconds per replica for ``replicas >= 2`` (replaces ``work / (speed replicas)``
    there). Scalars or broadcast arrays, identical bits either way; with one replica, no gradient bytes and speed 1
    the result is exactly ``(work, comm)``.
    """
    each = work / (speed * replicas)
    if split is not None:
        each = np.where(np.asarray(replicas) == 1, each, split)
    return each + allreduce_seconds(grad_bytes, replicas, bandwidth), comm / replicas


def _column(values: Sequence[float] | None, n: int) -> np.ndarray:
    return np.zeros(n) if values is None else np.asarray(values, dtype=np.float64)


def _across(cross_comm: Sequence[float], comm: Sequence[float] | None, n: int) -> np.ndarray:
    """``cross_comm`` as a column, but for the last segment ``comm``'s: the last stage sends to no other node."""
    column = _column(cross_comm, n).copy()
    column[-1] = _column(comm, n)[-1]
    return column


def _prefix(values: Sequence[float] | None, n: int) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(_column(values, n))))


@dataclass(frozen=True, kw_only=True)
class Segments:
    """Per-segment seconds and gradient bytes as the float64 prefix sums and per-cut terms the objective reads."""

    compute_prefix: np.ndarray
    """``compute_prefix[i]`` is the summed compute of segments ``0 .. i-1`` (length n + 1)."""
    compute_top: np.ndarray
    """``compute_prefix[b] + head[b-1]`` at index ``b-1``: what a stage ending at ``b`` adds before its start."""
    compute_bottom: np.ndarray
    """``compute_prefix[a] + start[a]`` at index ``a`` (and ``compute_prefix[n]`` at ``n``): what a stage starting
    at ``a`` takes off."""
    comm: np.ndarray
    """Per segment ``i``: seconds to send the boundary after ``i`` at the full batch."""
    grad_prefix: np.ndarray
    """``grad_prefix[i]`` is the summed gradient bytes of segments ``0 .. i-1`` (length n + 1)."""
    grad_top: np.ndarray
    """``grad_prefix[b] + head_grad_bytes[b-1]`` at index ``b-1``."""
    split_prefix: np.ndarray | None = None
    """``split_prefix[r-2, i]``: summed measured seconds per replica of ``r >= 2`` over segments ``0 .. i-1``."""
    cross_comm: np.ndarray | None = None
    """Per segment ``i``: seconds to send the boundary after ``i`` to another node (``None``: ``comm``; the last
    segment's is ``comm``'s, as the last stage has no next node)."""

    @classmethod
    def of(cls, compute: Sequence[float], *, head: Sequence[float] | None = None, comm: Sequence[float] | None = None,
           start: Sequence[float] | None = None, grad_bytes: Sequence[float] | None = None,
           head_grad_bytes: Sequence[float] | None = None,
           split: Sequence[Sequence[float]] | None = None,
           cross_comm: Sequence[float] | None = None) -> Segments:
        """The sums of per-segment vectors (``None``: zeros; ``split``: none; ``cross_comm``: ``comm``)."""
        n = len(compute)
        prefix, grad = _prefix(compute, n), _prefix(grad_bytes, n)
        return cls(compute_prefix=prefix, compute_top=prefix[1:] + _column(head, n),
                   compute_bottom=prefix + np.append(_column(start, n), 0.0), comm=_column(comm, n),
                   grad_prefix=grad, grad_top=grad[1:] + _column(head_grad_bytes, n),
                   split_prefix=np.stack([_prefix(row, n) for row in split]) if split else None,
                   cross_comm=None if cross_comm is None else _across(cross_comm, comm, n))

    def work(self, a, b):
        """Seconds of the stage ``[a, b)`` on one device of speed 1 (scalars or broadcast arrays)."""
        return self.compute_top[b - 1] - self.compute_bottom[a]

    def sends(self, cross: bool = False) -> np.ndarray:
        """Per segment ``i``: seconds to send the boundary after ``i`` at the full batch, to another node if
        ``cross``."""
        return self.cross_comm if cross and self.cross_comm is not None else self.comm

    def send(self, b, cross=False):
        """Seconds to send the boundary of a stage ending at ``b`` at the full batch: across nodes where ``cross``."""
        if self.cross_comm is None or not np.any(cross):
            return self.comm[b - 1]
        return np.where(cross, self.cross_comm[b - 1], self.comm[b - 1])

    def seconds(self, a, b, *, speed=1.0, replicas=1, bandwidth=math.inf, grad_bytes=None, cross=False):
        """``(compute, send)`` of the stage ``[a, b)`` (:func:`stage_seconds`); ``grad_bytes`` replaces the summed
        gradient bytes of its segments and head (a stage that counts a shared parameter once); ``cross``: its
        send goes to another node."""
        split = None
        if self.split_prefix is not None:
            row = np.maximum(np.asarray(replicas) - 2, 0)
            head = (self.compute_top[b - 1] - self.compute_prefix[b]) / replicas
            split = self.split_prefix[row, b] - self.split_prefix[row, a] + head
        grad = self.grad_top[b - 1] - self.grad_prefix[a] if grad_bytes is None else grad_bytes
        return stage_seconds(self.work(a, b), self.send(b, cross), speed=speed, replicas=replicas, grad_bytes=grad,
                             bandwidth=bandwidth, split=split)

    def cost(self, a, b, *, speed=1.0, replicas=1, bandwidth=math.inf, cross=False):
        """Seconds per batch of the stage ``[a, b)``: its compute plus its send."""
        compute, send = self.seconds(a, b, speed=speed, replicas=replicas, bandwidth=bandwidth, cross=cross)
        return compute + send

    def placed(self, a, b, first, links: Links, *, speed=1.0, replicas=1, grad_bytes=None):
        """``(compute, send)`` of the stage ``[a, b)`` on devices ``first .. first + replicas - 1`` of ``links``:
        its send and all-reduce over the links it crosses (the module docstring)."""
        return self.seconds(a, b, speed=speed, replicas=replicas, grad_bytes=grad_bytes,
                            bandwidth=links.allreduce_bandwidth(first, replicas), cross=links.crosses(first, replicas))

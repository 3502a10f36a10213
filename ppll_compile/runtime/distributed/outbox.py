"""The sending side of the ``distributed`` runtime: ``isend`` of each batch, with at most ``depth`` outstanding."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch.distributed as dist
from torch import Tensor

from .faults import Faults, wait_quietly


class Outbox:
    """Posts each batch's tensors with ``isend`` and keeps them alive until sent; a failed send names the peer.

    A wait on a peer that failed (and may stay alive) ends when the watching thread of :mod:`.faults` aborts
    the process group on this rank: the send fails, and the report's StageError is raised.
    """

    def __init__(self, *, rank: int, depth: int, faults: Faults) -> None:
        self._rank = rank
        self._depth = depth
        self._faults = faults
        self._sends: deque[tuple[int, list[Any], list[Tensor]]] = deque()  # (receiver, works, tensors)

    def post(self, parts: list[tuple[int, list[Tensor]]]) -> None:
        """``isend`` one batch's tensors, ``(rank, tensors)`` per receiver; wait on batches beyond ``depth``."""
        peer = parts[0][0] if parts else self._rank
        try:
            for peer, tensors in parts:
                self._sends.append((peer, [dist.isend(t, peer) for t in tensors], tensors))
            while len(self._sends) > self._depth * max(1, len(parts)):
                peer = self._sends[0][0]
                self._wait_oldest()
        except Exception as e:  # noqa: BLE001 - a send fails when the peer is gone
            self._faults.lost(e, peer, "sending to")

    def drain(self, receivers: list[int]) -> None:
        """Wait for every send posted; a failure is reported as losing ``receivers[0]``."""
        try:
            while self._sends:
                self._wait_oldest()
        except Exception as e:  # noqa: BLE001
            self._faults.lost(e, receivers[0], "sending to")

    def settle(self) -> None:
        """Wait for the sends still posted, ignoring failures (before the process group is destroyed)."""
        wait_quietly([w for _, works, _ in self._sends for w in works])

    def _wait_oldest(self) -> None:
        """Wait for the oldest send; meanwhile the fault protocol knows this rank waits on its receiver."""
        peer, works, _ = self._sends.popleft()
        self._faults.waiting_on = peer
        try:
            for w in works:
                w.wait()
        finally:
            self._faults.waiting_on = None

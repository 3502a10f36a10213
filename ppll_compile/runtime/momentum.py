"""Momentum (MAN) heads at run time: a stage publishes the weights the head before it follows, that head pulls them.

A stage whose predecessor has a momentum head publishes copies of the parameters the head mirrors after every
``head.every``-th optimizer step (its steps counted from 0 in this trainer). The stage with the head, before each
training step, pulls the newest copy published since its last pull (if any): ``head.pull(copy)``, one EMA
step. Copies, never the live parameters: a pull never sees an optimizer step half done.

- ``sequential``: stage ``i`` trains batch ``t`` after stage ``i + 1`` trained batch ``t - 1``, so a pull happens
  exactly before the batches ``t`` with ``t % every == 0`` (``t > 0``): the reference computation.
- ``threads``: the copies go through a shared :class:`Board`; stage ``i + 1`` lags stage ``i`` by up to the queue
  depth, so a head follows slightly older weights and the run is not the sequential computation.
- ``distributed``: the process of stage ``i + 1`` sends each copy back to the process of stage ``i`` (``isend`` on
  its own tag, about ``head.ema_bytes()`` per pull), where a thread receives it onto the board; at the end of every
  training epoch it sends an end marker, so the thread ends with the epoch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import PPLLError
from ..lower.stages import Lowered
from .distributed.faults import wait_quietly
from .runner import Runner

TAG = 0x3A11
"""Tag of the weights a stage sends back to the momentum head before it (``distributed``)."""
_MORE, _END = 1, 0


class Board:
    """The newest copy of the weights a stage published for the momentum head before it, taken at most once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tensors: list[Tensor] | None = None
        self._fresh = False

    def publish(self, tensors: list[Tensor]) -> None:
        """Replace the copy on the board (an older one not yet taken is never pulled)."""
        with self._lock:
            self._tensors, self._fresh = tensors, True

    def take(self) -> list[Tensor] | None:
        """The copy published since the last call, or ``None``."""
        with self._lock:
            if not self._fresh:
                return None
            self._fresh = False
            return self._tensors


def momentum_pairs(lowered: Lowered) -> list[tuple[int, nn.Module, list[nn.Parameter]]]:
    """Per momentum head: (its stage ``i``, the head, the parameters of stage ``i + 1`` it mirrors)."""
    return [(i, lowered.heads[i], mirrored) for i in range(len(lowered.heads) - 1)
            if (mirrored := lowered.mirrors(i))]


def _copies(params: Sequence[nn.Parameter]) -> list[Tensor]:
    return [p.detach().clone() for p in params]


def link_local(runners: list[Runner], lowered: Lowered) -> None:
    """Connect the runners of one process (``sequential``, ``threads``) through one :class:`Board` per momentum head."""
    by_index = {r.index: r for r in runners}
    for i, head, mirrored in momentum_pairs(lowered):
        board = Board()
        by_index[i].take_weights = board.take
        source = by_index[i + 1]
        source.publish_weights = lambda board=board, mirrored=mirrored: board.publish(_copies(mirrored))
        source.publish_every = head.every


class WeightsSender:
    """``distributed``, on stage ``i + 1``: sends copies of the mirrored parameters to stage ``i``'s process."""

    def __init__(self, mirrored: list[nn.Parameter], peer: int, comm: torch.device) -> None:
        self._mirrored = mirrored
        self._peer = peer
        self._comm = comm
        self._works: list[Any] = []
        self._held: list[Tensor] = []
        self.trained = False
        """Whether a training step happened since the last end marker (then the peer's thread is receiving)."""

    def _post(self, tensors: list[Tensor]) -> None:
        for w in self._works:  # at most one copy in flight: the peer's thread receives as they come
            w.wait()
        self._held = tensors
        self._works = [dist.isend(t, self._peer, tag=TAG) for t in tensors]

    def publish(self) -> None:
        """Send a copy of the mirrored parameters (after an optimizer step)."""
        self._post([torch.tensor([_MORE], device=self._comm)] + [t.to(self._comm) for t in _copies(self._mirrored)])

    def end(self) -> None:
        """End of a training epoch: send the end marker and wait until everything sent was taken."""
        if self.trained:
            self.trained = False
            self._post([torch.tensor([_END], device=self._comm)])
            for w in self._works:
                w.wait()
            self._works, self._held = [], []

    def settle(self) -> None:
        """Wait for what is in flight, ignoring failures (before the process group goes)."""
        wait_quietly(self._works)


class WeightsReceiver:
    """``distributed``, on stage ``i``: a thread per training epoch receives stage ``i + 1``'s copies onto a board."""

    def __init__(self, head: nn.Module, peer: int, comm: torch.device) -> None:
        self.board = Board()
        self._shapes = [(t.shape, t.dtype) for t in head.ema_tensors()]
        self._peer = peer
        self._comm = comm
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, wait: Callable[[threading.Thread], None]) -> None:
        """Listen for this epoch's copies (the epoch's first training step calls it); ``wait(thread)`` first waits
        for the last epoch's thread, which ends once the next stage has finished that epoch."""
        if self._thread is not None:
            wait(self._thread)
        self._thread = threading.Thread(target=self._run, name="ppll-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                header = torch.empty(1, dtype=torch.int64, device=self._comm)
                dist.recv(header, self._peer, tag=TAG)
                if int(header) == _END:
                    return
                tensors = [torch.empty(s, dtype=d, device=self._comm) for s, d in self._shapes]
                for t in tensors:
                    dist.recv(t, self._peer, tag=TAG)
                self.board.publish(tensors)
        except Exception as e:  # noqa: BLE001 - the group was aborted after a failure: the trainer reports it
            self.error = e

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for this epoch's thread to take the end marker."""
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


def check_distributed(lowered: Lowered, replicas: Sequence[int]) -> None:
    """Momentum heads under ``distributed`` need one process for the head's stage and one for the next."""
    for i, _, _ in momentum_pairs(lowered):
        if replicas[i] > 1 or replicas[i + 1] > 1:
            raise PPLLError(f"stage {i} has a momentum head that follows stage {i + 1}, and one of the two is "
                            f"replicated; momentum heads need one process per stage under distributed: compile "
                            f"with replicas=False, or use another head policy")

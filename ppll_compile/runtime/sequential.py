"""The ``sequential`` runtime: every stage in order on each batch, in the calling thread (the reference)."""

from __future__ import annotations

import traceback

from ..errors import StageError
from .base import Losses, Runtime
from .messages import Message
from .runner import Runner


class SequentialRuntime(Runtime):
    """Every stage in order on each batch, in the calling thread: local learning without pipelining."""

    can_move_cuts = True

    @classmethod
    def build(cls, setup: Runtime.Setup) -> SequentialRuntime:
        """Every stage of ``setup.plan`` on its device, in this thread."""
        return cls(setup.local_runners())

    def __init__(self, runners: list[Runner]) -> None:
        self.runners = runners
        self.num_stages = len(runners)

    def step(self, msg: Message | None) -> Losses:
        """Train every stage on ``msg`` in turn; each stage's loss."""
        assert msg is not None
        if self.error is not None:
            raise self.error
        losses: list[list[float]] = []
        size = msg.size
        for r in self.runners:
            try:
                msg_out, loss = r.train_step(msg)
            except Exception as e:
                self.error = StageError(r.index, msg.index, f"{type(e).__name__}: {e}", traceback.format_exc())
                raise self.error from e
            losses.append([float(loss)])
            msg = msg_out  # type: ignore[assignment]
        return Losses(losses, [[size]] * len(losses))

    def replace_runners(self, runners: list[Runner]) -> None:
        """Train ``runners`` from the next batch on (as many as before): a moved cut."""
        assert len(runners) == self.num_stages, "a moved cut keeps the number of stages"
        self.runners = runners

    def drain(self) -> None:
        """Nothing is pending; raises the error of an earlier failed step again."""
        if self.error is not None:
            raise self.error

    def finish(self) -> Losses:
        """The end of the data: every stage steps on a partial accumulation group (``accumulate > 1``); raises the
        error of an earlier failed step again."""
        if self.error is not None:
            raise self.error
        for r in self.runners:
            try:
                r.flush()
            except Exception as e:
                self.error = StageError(r.index, None, f"{type(e).__name__}: {e}", traceback.format_exc())
                raise self.error from e
        return Losses([[] for _ in self.runners])

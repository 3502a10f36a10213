"""``Runtime``: what a trainer drives (step, finish, evaluate, an epoch loop), and the losses and tallies it returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..errors import StageError
from ..allocator import keep_freed_memory
from .messages import Message, add_counts
from .runner import Runner

__all__ = ["Runtime", "Losses", "Counts", "progress_bar"]

Losses = list[list[float]]
"""Per stage, the losses of the batches it finished since the last call, in order."""
Counts = list[tuple[tuple[float, ...] | None, int]]
"""Per stage, (its evaluation tally, examples seen); a PPLL stage tallies its head's right predictions, a
Pipe-BD stage each block's summed loss; ``None`` when not countable."""


class Runtime:
    """What a trainer drives: ``step`` one batch in, ``finish`` to drain, ``evaluate`` and an epoch loop."""

    runners: list[Runner]
    """The stages this process runs (all of them, except under ``distributed``)."""
    num_stages: int
    is_main_writer: bool = True
    """Whether this process writes a checkpoint's manifest."""
    is_main: bool = True
    """Whether this process reports progress (under ``distributed``, the last stage's first replica)."""
    reads_data: bool = True
    """Whether this process feeds batches (under ``distributed`` only rank 0 does)."""
    replica: int = 0
    """Which replica of its stage this process runs (under ``distributed``; else 0)."""
    error: StageError | None = None
    """The failure of a stage, once one was raised; every later call raises it again."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Runtime:
        # every runtime starts alike: freed memory stays in the process for the next step (see ppll_compile.allocator)
        keep_freed_memory()
        return super().__new__(cls)

    @property
    def stopped(self) -> bool:
        """Whether the runtime stopped before finishing its batches (a failure or an interrupt): it can only be
        closed."""
        return self.error is not None

    def step(self, msg: Message | None) -> Losses:
        """Feed one batch (``None`` in a process that reads no data); per stage, the losses finished since."""
        raise NotImplementedError

    def finish(self) -> Losses:
        """Wait until every submitted batch went through every stage; the losses not yet returned."""
        raise NotImplementedError

    def evaluate(self, messages: Iterable[Message]) -> Counts:
        """Eval-mode forward of every batch through every stage, with each stage's tally (see ``Counts``)."""
        self.finish()
        counts: list[list[Any]] = [[(), 0] for _ in self.runners]
        for r in self.runners:
            r.train_mode(False)
        try:
            for msg in messages:
                for r, c in zip(self.runners, counts):
                    msg_out, tally = r.eval_step(msg)
                    c[0] = add_counts(c[0], tally)
                    c[1] += msg.size
                    msg = msg_out
        finally:
            for r in self.runners:
                r.train_mode(True)
        return [(c[0], c[1]) for c in counts]

    def epoch(self, messages: Iterable[Message] | None, on_step: Callable[[Losses, int], None]) -> None:
        """Train on every batch of ``messages`` and finish, calling ``on_step(losses, batch_size)`` as losses come.

        ``messages`` is ``None`` in a process that does not read data (distributed ranks after the first).
        """
        assert messages is not None
        for msg in messages:
            on_step(self.step(msg), msg.size)
        on_step(self.finish(), 0)

    def states(self) -> list[dict[str, Any]]:
        """The stage states this process writes into a checkpoint."""
        return [r.state_dict() for r in self.runners]

    def barrier(self) -> None:
        """Wait for every process of the pipeline (nothing to wait for in one process)."""

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every process of the pipeline, in rank order."""
        return [obj]

    def close(self) -> None:
        """Release threads or process groups; the runtime cannot be used afterwards."""

    def abandon(self) -> None:
        """Its trainer is gone without :meth:`close`: let worker threads end on their own, without waiting."""


def progress_bar(total: int | None, desc: str, enabled: bool) -> Any:
    """A tqdm bar of ``total`` batches labelled ``desc`` (``None`` when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True)

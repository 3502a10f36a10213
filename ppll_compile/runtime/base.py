"""``Runtime``: what a trainer drives (step, finish, evaluate, an epoch loop, a moved cut), what each runtime can do
(its declared capabilities), how it is built, and the losses and tallies it returns."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import torch

from ..errors import StageError
from ..lower.stages import Lowered
from ..plans.plan import Plan
from .config import TrainConfig
from .messages import Message, add_counts
from .momentum import link_local
from .runner import Runner
from .runners import make_runners

__all__ = ["Runtime", "RuntimeSetup", "Losses", "Counts"]



class Losses(list):  # type: ignore[type-arg]
    """Per stage, the losses of the batches it finished since the last call, in order: a list of lists of floats
    (as before), with :attr:`sizes`, per stage the batch size of each of those losses (rows of the whole batch;
    ``None`` where the runtime does not know it)."""

    def __init__(self, losses: Iterable[list[float]] = (), sizes: Iterable[list[int | None]] | None = None) -> None:
        super().__init__(list(ls) for ls in losses)
        self.sizes: list[list[int | None]] = [list(s) for s in sizes] if sizes is not None \
            else [[None] * len(ls) for ls in self]
        """Per stage, the batch size of each loss (as long as that stage's list of losses)."""

    @classmethod
    def of(cls, losses: Any, size: int | None = None, stage: int | None = None) -> Losses:
        """``losses`` as :class:`Losses`: itself when it is one; else every size unknown (``None``), except that
        the losses of ``stage`` (when given) are of batches of ``size`` rows."""
        if isinstance(losses, Losses):
            return losses
        return cls(losses, [[size if i == stage else None] * len(ls) for i, ls in enumerate(losses)])

Counts = list[tuple[tuple[float, ...] | None, int]]
"""Per stage, (its evaluation tally, examples seen); a PPLL stage tallies its local loss, right predictions and the
user's metrics (see :mod:`.scores`), a Pipe-BD stage each block's summed loss; ``None`` when not countable."""


@dataclass(frozen=True, kw_only=True)
class RuntimeSetup:
    """What a runtime is built from: the plan, its lowered modules, how every stage trains, and the trainer's
    runtime options (each runtime reads those it needs)."""

    plan: Plan
    """The plan whose stages the runtime trains."""
    lowered: Lowered
    """The plan's stage modules and heads (the model's own parameters)."""
    config: TrainConfig
    """How every stage trains (optimizer and scheduler factories, loss, clipping, autocast, seed)."""
    depth: int = 2
    """Batches a queue between two stages holds (``queue_depth``)."""
    queue: str = "fifo"
    """The queue rule between stages: ``fifo``, ``latest`` or ``reuse``."""
    threads_per_stage: int | None = None
    """CPU threads each stage's worker uses (``None``: the machine's cores shared out)."""
    timeout: float = 300.0
    """Seconds a process waits for the others (process groups)."""
    decoupled: bool = True
    """``False``: a barrier of all the stages before every optimizer step."""

    def local_runners(self) -> list[Runner]:
        """A runner for every stage of the plan, each on its device, in this process (momentum heads linked to the
        stage they follow)."""
        k = self.plan.num_stages
        runners = make_runners(self.plan, self.lowered, self.config, range(k),
                               [torch.device(self.plan.devices[i]) for i in range(k)])
        link_local(runners, self.lowered)
        return runners

    def threads_each(self) -> int:
        """CPU threads per stage: ``threads_per_stage``, else the machine's cores shared out over the stages."""
        return self.threads_per_stage or max(1, (os.cpu_count() or 1) // self.plan.num_stages)


class Runtime:
    """What a trainer drives: ``step`` one batch in, ``finish`` to drain, ``evaluate`` and an epoch loop.

    A runtime declares what it can do as class attributes (read by the trainer's option checks, never its name),
    and :meth:`build` makes one from a :class:`RuntimeSetup`. A new runtime is a subclass in its own module and one
    entry in :mod:`.registry`.
    """

    Setup: TypeAlias = RuntimeSetup
    """What :meth:`build` is given (:class:`RuntimeSetup`, by a name every runtime's module has)."""
    modes: ClassVar[tuple[str, ...]] = ("ppll", "pipebd")
    """The plan kinds it trains: ``ppll`` (local learning) and/or ``pipebd`` (blockwise distillation)."""
    queues: ClassVar[tuple[str, ...]] = ("fifo",)
    """The queue rules between stages it runs (``fifo``, ``latest``, ``reuse``)."""
    pipelined: ClassVar[bool] = False
    """Whether its stages run at once, so that ``decoupled=False`` (a barrier before every step) applies."""
    one_process_per_stage: ClassVar[bool] = False
    """Whether every stage runs in another process (under torchrun)."""
    can_move_cuts: ClassVar[bool] = False
    """Whether a trainer may move its cuts (``rebalance=True``, ``replan``): it implements :meth:`drain` and
    :meth:`replace_runners`."""
    whole_fit: ClassVar[bool] = False
    """Whether it trains over all the epochs itself (:meth:`fit`) instead of batch by batch (:meth:`epoch`)."""

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

    @classmethod
    def build(cls, setup: RuntimeSetup) -> Runtime:
        """The runtime for ``setup``, its runners built for ``setup.plan``."""
        raise NotImplementedError(f"{cls.__name__} does not say how it is built; give it a build(setup) classmethod")

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

    def drain(self) -> None:
        """Wait until every batch fed in went through every stage, keeping their losses for the next :meth:`step` or
        :meth:`finish` (a runtime that ``can_move_cuts``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot drain its stages (it cannot move cuts)")

    def replace_runners(self, runners: list[Runner]) -> None:
        """Train ``runners`` from the next batch on, as many as before (a moved cut; :meth:`drain` first)."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace its stages (it cannot move cuts)")

    def fit(self, loader: Iterable[Any], epochs: int, *, first: int = 0,
            progress: bool | str = False) -> tuple[list[dict[str, Any]], int]:
        """Train over every epoch of ``loader`` (a runtime with ``whole_fit``); per epoch the record
        :meth:`~.trainer.Trainer.fit` gives, and the batch count after (batches numbered from ``first``)."""
        raise NotImplementedError(f"{type(self).__name__} trains batch by batch (epoch), not over the whole data")

    def evaluate(self, messages: Iterable[Message], metrics: Sequence[Callable[[Any, Any], Any]] = ()) -> Counts:
        """Eval-mode forward of every batch through every stage, with each stage's tally (see ``Counts``);
        ``metrics``: functions ``fn(output, target)`` the last stage tallies on the model's output."""
        self.finish()
        counts: list[list[Any]] = [[(), 0] for _ in self.runners]
        for r in self.runners:
            r.train_mode(False)
        try:
            for msg in messages:
                for r, c in zip(self.runners, counts):
                    msg_out, tally = r.eval_step(msg, metrics)
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

    def collective(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, an exchange with the other processes (a collective or a send or receive); under ``distributed``,
        when another rank reported a failure meanwhile, its :class:`StageError` instead of a broken connection."""
        return fn()

    def gather_to_writer(self, obj: Any) -> list[Any] | None:
        """``obj`` of every process of the pipeline, in rank order, on the process that writes (``is_main_writer``:
        rank 0); ``None`` on the others."""
        return [obj] if self.is_main_writer else None

    def close(self) -> None:
        """Release threads or process groups; the runtime cannot be used afterwards."""

    def abandon(self) -> None:
        """Its trainer is gone without :meth:`close`: let worker threads end on their own, without waiting."""

    def wait_stopped(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` seconds for the worker threads a closed or dropped trainer left running (inside a
        stage's own code) to end; the stages whose workers still run (none in a runtime without worker threads)."""
        return []


def progress_bar(total: int | None, desc: str, enabled: bool) -> Any:
    """A tqdm bar of ``total`` batches labelled ``desc`` (``None`` when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True)

"""The ``distributed`` runtime: one process per stage replica (under torchrun), activations sent point to point."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import PPLLError, StageError
from ...lower.stages import Lowered
from ...plans.plan import Plan
from ...plans.schedule import StageRule
from ..base import Counts, Losses, Runtime
from ..config import TrainConfig
from ..messages import EVAL, TRAIN, Message, add_counts, dtype_of
from ..momentum import check_distributed, momentum_pairs
from ..runners import make_runners
from .faults import Faults
from .group import (
    abort,
    check_same_model,
    check_same_plan,
    check_world,
    init_group,
    place,
    rank_device,
    release,
    stage_group,
)
from .links import BatchSender, BatchTaker, WeightLinks, feed
from .outbox import Outbox
from .wire import END, Wire, check_splittable


class DistributedRuntime(Runtime):
    """One process per stage replica: ranks are given to the stages in order, ``plan.stages[j].replicas`` each.

    FIFO is the same computation as sequential; ``queue="latest"`` and ``"reuse"`` need one process per stage.

    ``step``/``finish``/``epoch`` must be called in the same order on every process (the trainer's ``fit``,
    ``evaluate``, ``save`` and ``load`` do). ``epoch`` ends with an all-gather of the stage losses, so on
    every process the losses passed to ``on_step`` (and ``fit``'s history) cover every stage.

    Rank ``r`` runs on ``cuda:LOCAL_RANK`` (or the CPU). Only rank 0 reads data; every batch travels down
    the ranks in the format of :mod:`.wire`, its receive buffers sized from the plan
    (``plan.stages[r - 1].boundary``; the raw input from the first tensor of ``plan.inputs``), so a smaller
    last batch works and no shapes are exchanged per step.

    Replicas: a sender cuts each batch by rows into one slice per replica of the next stage (rank 0 also
    for the other replicas of stage 0), and a replica joins the slices it gets from every replica before
    it. Each replica trains under DDP in its stage's group on its slice, its loss scaled by
    ``slice * replicas / batch`` so that the all-reduced gradient is the whole batch's. ``decoupled=False``
    puts a barrier over all ranks before every optimizer step (relaying without decoupled updates).

    A thread per process (:class:`.inbox.Inbox`) receives one epoch's batches (until the END header) into a
    bounded queue (:class:`.queues.Mailbox`); the main thread trains and sends its output on with ``isend`` as soon
    as its forward made it (:class:`.outbox.Outbox`, at most ``depth`` batches outstanding), and takes the newest
    input (``queue="latest"``) or reuses one when none waits (``queue="reuse"``), by the rules of :mod:`.schedule`.
    A failure anywhere reaches every rank as a :class:`StageError` naming the stage that failed, by the protocol
    of :mod:`.faults` (reports under :data:`.faults.ERROR_KEY`, STOP, lost peers): a thread per process watches the
    store and aborts the process's groups when another rank reports, so no send, receive or collective waits
    on a failed process, even one that stays alive.
    """

    queues = ("fifo", "latest", "reuse")
    pipelined = True
    one_process_per_stage = True

    @classmethod
    def build(cls, setup: Runtime.Setup) -> DistributedRuntime:
        """This process's place in the process group (under torchrun) and the stage it trains."""
        return cls(setup.plan, setup.lowered, setup.config, depth=setup.depth, queue=setup.queue,
                   timeout=setup.timeout, decoupled=setup.decoupled)

    def __init__(self, plan: Plan, lowered: Lowered, config: TrainConfig, *, depth: int, queue: str,
                 timeout: float, decoupled: bool = True) -> None:
        self._owns_group = init_group(plan.world_size, timeout)
        try:
            self._join(plan, lowered, config, queue=queue, decoupled=decoupled)
        except BaseException:
            if self._owns_group:
                dist.destroy_process_group()
            raise
        self.runner = self.runners[0]
        self.num_stages = plan.num_stages
        self.is_main_writer = self.reads_data = self.rank == 0
        self.is_main = self.stage == plan.num_stages - 1 and self.replica == 0
        self._depth = depth
        self._queue = queue
        self._connect(plan)
        check_splittable(plan)
        self._faults.watch(self._groups)
        self._ended = False  # an END taken by step() that no finish() has matched yet
        self._closed = False

    def _join(self, plan: Plan, lowered: Lowered, config: TrainConfig, *, queue: str, decoupled: bool) -> None:
        """Check the world against the plan, place this rank, make the groups and this rank's runner."""
        world = dist.get_world_size()
        check_world(plan, world, queue)
        self.rank = dist.get_rank()
        check_same_plan(plan, world)
        check_same_model(lowered, world)
        self._place = place(plan, self.rank)
        self.stage, self.replica = self._place.stage, self._place.replica
        group = stage_group(self._place)
        self._sync = None if decoupled else dist.new_group(list(range(world)))
        self._groups: list[Any] = [None] + [g for g in (group, self._sync) if g is not None]
        """This rank's groups: the default one (``None``), its stage's replicas, the barrier of ``decoupled=False``."""
        self.device = rank_device(self.rank)
        self.runners = make_runners(plan, lowered, config, [self.stage], [self.device], [group])
        check_distributed(lowered, [s.replicas for s in plan.stages])
        self._pairs = momentum_pairs(lowered)
        """(stage, momentum head, the next stage's parameters it follows) of every momentum head of the plan."""
        self.runners[0].replica = self.replica  # a replica trains its own slice: its own random stream
        if self._sync is not None:
            sync = self._sync
            self.runners[0].before_step = lambda: self._faults.collective(lambda: dist.barrier(group=sync))

    def _connect(self, plan: Plan) -> None:
        """The wire format, fault protocol, sending, taking and weight links between this rank and its neighbours."""
        p = self._place
        backend = str(dist.get_backend())
        comm = self.device if self.device.type == "cuda" and "nccl" in backend else torch.device("cpu")
        in_specs = plan.inputs if p.fed else plan.stages[self.stage - 1].boundary if self.stage > 0 else ()
        raw_spec = next((s for s in plan.inputs if dtype_of(s) is not None), None)
        wire = Wire(stage=self.stage, planned=plan.batch_size, in_specs=in_specs, raw_spec=raw_spec, comm=comm)
        wire.receiving_from = p.upstream[0] if p.upstream else 0
        receivers = p.feeds + p.downstream  # rank 0's further replicas of stage 0, then the next stage
        self._faults = Faults(rank=self.rank, stage=self.stage, stage_of=p.stage_of, receivers=receivers, wire=wire)
        outbox = Outbox(rank=self.rank, depth=self._depth, faults=self._faults)
        self._weights = WeightLinks(self._pairs, stage=self.stage, ranks=p.ranks, comm=comm, runner=self.runner,
                                    faults=self._faults)
        self._sending = BatchSender(wire=wire, faults=self._faults, outbox=outbox, feeds=p.feeds,
                                    downstream=p.downstream, receivers=receivers, data_specs=plan.inputs,
                                    out_specs=plan.stages[self.stage].boundary, planned=plan.batch_size,
                                    runner=self.runner, weights=self._weights)
        self._taking = BatchTaker(wire=wire, faults=self._faults, upstream=p.upstream, stage=self.stage,
                                  depth=self._depth, device=self.device, rule=lambda: self._rule, runner=self.runner,
                                  sender=self._sending)

    @property
    def _rule(self) -> StageRule:
        """What this rank's stage does next (:mod:`.schedule`)."""
        return StageRule(queue=self._queue, depth=self._depth, decoupled=self._sync is None, first=self.stage == 0,
                         last=self.stage == self.num_stages - 1)

    def _losses(self, mine: list[float], sizes: list[int] | None = None) -> Losses:
        """Per stage, ``mine`` (of batches of ``sizes`` rows) for this rank's stage; a replicated stage reports its
        first replica's losses."""
        here = [i == self.stage and self.replica == 0 for i in range(self.num_stages)]
        return Losses([list(mine) if h else [] for h in here],
                      [(list(sizes) if sizes is not None else [None] * len(mine)) if h else [] for h in here])

    def _by_stage(self, per_rank: list[Any]) -> list[list[Any]]:
        """Values gathered from every rank, grouped by stage (replicas in order)."""
        return [[per_rank[r] for r in ranks] for ranks in self._place.ranks]

    def step(self, msg: Message | None) -> Losses:
        """Rank 0: train stage 0 on ``msg`` and send it on. Other ranks: take one input, train, send it on.

        Under ``queue="latest"`` a later stage drops inputs, so it takes fewer than were fed: once the end of the
        epoch (rank 0's :meth:`finish`) has reached it, its remaining ``step`` calls of the epoch return no
        losses without waiting, and its :meth:`finish` returns at once.
        """
        self._raise_if_failed()
        if self.rank == 0:
            assert msg is not None, "rank 0 reads the data: step() needs a batch there"
            return self._losses([self._train(self._sending.scatter(msg, TRAIN), False)], [msg.size])
        if self._ended:  # this epoch's inputs are all taken (or dropped): nothing left to train on until finish()
            return self._losses([])
        item, reused = self._taking.take(reuse=self._queue == "reuse")
        if item is END:
            self._ended = True
            self._flush()
            return self._losses([])
        taken = self._taking.expect(item, TRAIN)
        return self._losses([self._train(taken, reused)], [taken.whole or taken.size])

    def finish(self) -> Losses:
        """Rank 0: wait for its sends and send END. Other ranks: train until END arrives, forward it, wait."""
        self._raise_if_failed()
        if self.rank == 0:
            self._flush()
            self._sending.end()
            return self._losses([])
        if self._ended:
            self._ended = False
            return self._losses([])
        done = list(self._until_end())
        return self._losses([loss for loss, _, _ in done], [rows for _, rows, _ in done])

    def epoch(self, messages: Iterable[Message] | None, on_step: Callable[[Losses, int], None]) -> None:
        """Train one epoch (rank 0 feeds ``messages``, the others train until END); every stage's losses at the end."""
        mine: list[float] = []
        sizes: list[int | None] = []
        if self.rank == 0:
            assert messages is not None, "rank 0 reads the data: epoch() needs the batches there"
            for msg in feed(messages, self._faults):
                losses = self.step(msg)
                mine += losses[0]
                sizes += losses.sizes[0]
                on_step(losses, msg.size)  # the whole batch: rank 0 counts the samples fed in
            on_step(self.finish(), 0)
        else:
            self._raise_if_failed()
            self._ended = False
            for loss, rows, reused in self._until_end():
                mine.append(loss)
                sizes.append(rows)
                on_step(self._losses([loss], [rows]), 0 if reused else rows)  # a reused batch feeds no new samples
        first = [replicas[0] for replicas in self._by_stage(self.gather((mine, sizes)))]
        here = [i == self.stage and self.replica == 0 for i in range(self.num_stages)]
        on_step(Losses([[] if h else list(ls) for h, (ls, _) in zip(here, first)],
                       [[] if h else list(s) for h, (_, s) in zip(here, first)]), 0)

    def evaluate(self, messages: Iterable[Message], metrics: Sequence[Callable[[Any, Any], Any]] = ()) -> Counts:
        """Eval-mode forward pipelined through the ranks; every stage's tally and examples seen, on every rank
        (the last stage's rank tallies ``metrics``)."""
        self.finish()
        self.runner.train_mode(False)
        try:
            mine = self._evaluate_here(messages, metrics)
        finally:
            self.runner.train_mode(True)
        counts = []
        for replicas in self._by_stage(self.gather(mine)):
            total: Any = ()
            for t, _ in replicas:
                total = add_counts(total, t)
            counts.append((total, sum(n for _, n in replicas)))
        return counts

    def _evaluate_here(self, messages: Iterable[Message], metrics: Sequence[Callable[[Any, Any], Any]] = ()
                       ) -> tuple[Any, int]:
        """This rank's stage on every eval batch (sent on as it goes): its tally and the examples it saw."""
        tally: Any = ()
        seen = 0
        if self.rank == 0:
            batches: Iterable[Any] = (self._sending.scatter(m, EVAL) for m in feed(messages, self._faults))
        else:
            self._ended = False
            batches = self._taking.batches(EVAL)
        for msg in batches:
            out, count = self._faults.guard(msg.index, lambda m=msg: self.runner.eval_step(m, metrics))
            tally = add_counts(tally, count)
            seen += msg.size
            if out is not None:
                self._sending.send(out, EVAL)
        if self.rank == 0:
            self._sending.end()  # the other ranks forward END as they take it
        return tally, seen

    def states(self) -> list[dict[str, Any]]:
        """This rank's stage state, written by its first replica only (replicas hold the same state)."""
        return [self.runner.state_dict()] if self.replica == 0 else []

    def barrier(self) -> None:
        """Wait for every rank."""
        self._faults.collective(dist.barrier)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order."""
        out: list[Any] = [None] * dist.get_world_size()
        self._faults.collective(lambda: dist.all_gather_object(out, obj))
        return out

    def collective(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, an exchange with other ranks, under the fault protocol (see :meth:`.faults.Faults.collective`)."""
        return self._faults.collective(fn)

    def gather_to_writer(self, obj: Any) -> list[Any] | None:
        """``obj`` of every rank, in rank order, on rank 0 only (``None`` on the others)."""
        out: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        self._faults.collective(lambda: dist.gather_object(obj, out, dst=0))
        return out

    def close(self) -> None:
        """Stop the receiving and watching threads; tell the others if batches are still in flight; release the group.

        After a failure (or with batches still in flight) this rank's sends, receives and collectives are
        aborted first, so the group is destroyed (if this runtime made it) without waiting on any peer; rank 0,
        which holds the store unless torchrun does, first gives every rank a few seconds to read the report.
        """
        if self._closed:
            return
        self._closed = True
        failed = self._sending.open or self._faults.error is not None
        if self._sending.open and self._faults.error is None:
            self._faults.closed_early()
        self._taking.stop()
        self._faults.unwatch()
        if not dist.is_initialized():
            return
        if failed:
            if self.rank == 0:
                self._faults.wait_taken(dist.get_world_size())
            abort(self._groups)
        else:
            self._sending.settle()
            self._weights.settle()
        if self._owns_group:
            release()

    @property
    def error(self) -> StageError | None:  # type: ignore[override]
        """The StageError this rank raised (its own stage's, or the one another rank reported)."""
        return self._faults.error

    def _raise_if_failed(self) -> None:
        if self._faults.error is not None:
            raise self._faults.error
        if self._closed:
            raise PPLLError("this distributed runtime was closed; build a new trainer")

    def _train(self, msg: Message, reused: bool) -> float:
        self._weights.before_train()
        send = self._sending.relay if self._rule.sends(reused) else None
        _, loss = self._faults.guard(msg.index, lambda: self.runner.train_step(msg, send))
        self.runner.reused += reused
        return float(loss)

    def _flush(self) -> None:
        """The end of the data: this rank's stage steps on a partial accumulation group (``accumulate > 1``)."""
        self._faults.guard(None, self.runner.flush)

    def _until_end(self) -> Iterator[tuple[float, int, bool]]:
        """Train on every batch until END (forwarded on); each loss with its batch size and whether it was reused."""
        while True:
            item, reused = self._taking.take(reuse=self._queue == "reuse")
            if item is END:
                self._flush()
                return
            loss = self._train(self._taking.expect(item, TRAIN), reused)
            yield loss, item.whole or item.size, reused

"""The ``distributed`` runtime: one process per stage replica (under torchrun), activations sent point to point."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import PPLLError, StageError
from ..lowered import Lowered
from ..plan import Plan, TensorSpec
from ..timeline import span
from .base import Counts, Losses, Runtime
from .config import TrainConfig
from .faults import ERROR_KEY, Faults
from .group import abort, check_same_plan, check_world, init_group, place, rank_device, release, stage_group
from .inbox import Failure, Inbox
from .messages import EVAL, TRAIN, Message, add_counts, dtype_of
from .momentum import WeightsReceiver, WeightsSender, check_distributed, momentum_pairs
from .outbox import Outbox
from .queues import Recent
from .runners import make_runners
from .schedule import StageRule, next_input
from .wire import END, Stop, Wire, check_splittable, split

__all__ = ["DistributedRuntime", "ERROR_KEY"]

_STORE_POLL = 0.25  # seconds between looks at the store while waiting for a thread
_WEIGHTS_WAIT = 5.0  # seconds close() waits for a momentum head's receiving thread to take the end marker


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
    of :mod:`.faults` (reports under :data:`ERROR_KEY`, STOP, lost peers): a thread per process watches the
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
        self._inbox: Inbox | None = None
        self._recent = Recent()
        self._open = False  # batches sent (rank 0) or taken (others) since the last END
        self._ended = False  # an END taken by step() that no finish() has matched yet
        self._closed = False

    def _join(self, plan: Plan, lowered: Lowered, config: TrainConfig, *, queue: str, decoupled: bool) -> None:
        """Check the world against the plan, place this rank, make the groups and this rank's runner."""
        world = dist.get_world_size()
        check_world(plan, world, queue)
        self.rank = dist.get_rank()
        check_same_plan(plan, world)
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
        """The wire format, fault protocol and send queue between this rank and its neighbours."""
        p = self._place
        backend = str(dist.get_backend())
        comm = self.device if self.device.type == "cuda" and "nccl" in backend else torch.device("cpu")
        in_specs = plan.inputs if p.fed else plan.stages[self.stage - 1].boundary if self.stage > 0 else ()
        raw_spec = next((s for s in plan.inputs if dtype_of(s.dtype) is not None), None)
        self._wire = Wire(stage=self.stage, planned=plan.batch_size, in_specs=in_specs, raw_spec=raw_spec, comm=comm)
        self._wire.receiving_from = p.upstream[0] if p.upstream else 0
        self._receivers = p.feeds + p.downstream
        """The ranks this rank sends batches to: rank 0's further replicas of stage 0, then the next stage."""
        self._faults = Faults(rank=self.rank, stage=self.stage, stage_of=p.stage_of, receivers=self._receivers,
                              wire=self._wire)
        self._outbox = Outbox(rank=self.rank, depth=self._depth, faults=self._faults)
        self._sender: WeightsSender | None = None
        self._receiver: WeightsReceiver | None = None
        self._weights_open = False  # this epoch's receiving thread of a momentum head runs
        for i, head, mirrored in self._pairs:
            if self.stage == i + 1:
                self._sender = WeightsSender(mirrored, p.ranks[i][0], comm)
                self.runner.publish_weights = self._sender.publish
                self.runner.publish_every = head.every
            if self.stage == i:
                self._receiver = WeightsReceiver(head, p.ranks[i + 1][0], comm)
                self.runner.take_weights = self._receiver.board.take
        self._data_specs: tuple[TensorSpec, ...] = plan.inputs
        self._out_specs: tuple[TensorSpec, ...] = plan.stages[self.stage].boundary
        self._planned = plan.batch_size

    @property
    def _rule(self) -> StageRule:
        """What this rank's stage does next (:mod:`.schedule`)."""
        return StageRule(queue=self._queue, depth=self._depth, decoupled=self._sync is None, first=self.stage == 0,
                         last=self.stage == self.num_stages - 1)

    def _losses(self, mine: list[float]) -> Losses:
        """Per stage, ``mine`` for this rank's stage; a replicated stage reports its first replica's losses."""
        return [list(mine) if i == self.stage and self.replica == 0 else [] for i in range(self.num_stages)]

    def _by_stage(self, per_rank: list[Any]) -> list[list[Any]]:
        """Values gathered from every rank, grouped by stage (replicas in order)."""
        return [[per_rank[r] for r in ranks] for ranks in self._place.ranks]

    def step(self, msg: Message | None) -> Losses:
        """Rank 0: train stage 0 on ``msg`` and send it on. Other ranks: receive one batch, train, send on."""
        self._raise_if_failed()
        if self.rank == 0:
            assert msg is not None, "rank 0 reads the data: step() needs a batch there"
            return self._losses([self._train(self._scatter(msg, TRAIN), False)])
        item, reused = self._take(reuse=self._queue == "reuse")
        if item is END:
            self._ended = True
            return self._losses([])
        return self._losses([self._train(self._expect(item, TRAIN), reused)])

    def finish(self) -> Losses:
        """Rank 0: wait for its sends and send END. Other ranks: train until END arrives, forward it, wait."""
        self._raise_if_failed()
        if self.rank == 0:
            self._end()
            return self._losses([])
        if self._ended:
            self._ended = False
            return self._losses([])
        return self._losses([loss for loss, _ in self._until_end()])

    def epoch(self, messages: Iterable[Message] | None, on_step: Callable[[Losses, int], None]) -> None:
        """Train one epoch (rank 0 feeds ``messages``, the others train until END); every stage's losses at the end."""
        mine: list[float] = []
        if self.rank == 0:
            assert messages is not None, "rank 0 reads the data: epoch() needs the batches there"
            for msg in self._feed(messages):
                losses = self.step(msg)
                mine += losses[0]
                on_step(losses, msg.size)  # the whole batch: rank 0 counts the samples fed in
            on_step(self.finish(), 0)
        else:
            self._raise_if_failed()
            self._ended = False
            for loss, size in self._until_end():
                mine.append(loss)
                on_step(self._losses([loss]), size)
        first = [replicas[0] for replicas in self._by_stage(self.gather(mine))]
        on_step([[] if i == self.stage and self.replica == 0 else list(ls) for i, ls in enumerate(first)], 0)

    def evaluate(self, messages: Iterable[Message]) -> Counts:
        """Eval-mode forward pipelined through the ranks; every stage's (right, seen) counts on every rank."""
        self.finish()
        self.runner.train_mode(False)
        try:
            mine = self._evaluate_here(messages)
        finally:
            self.runner.train_mode(True)
        counts = []
        for replicas in self._by_stage(self.gather(mine)):
            total: Any = ()
            for t, _ in replicas:
                total = add_counts(total, t)
            counts.append((total, sum(n for _, n in replicas)))
        return counts

    def _evaluate_here(self, messages: Iterable[Message]) -> tuple[Any, int]:
        """This rank's stage on every eval batch (sent on as it goes): its tally and the examples it saw."""
        tally: Any = ()
        seen = 0
        if self.rank == 0:
            batches: Iterable[Any] = (self._scatter(m, EVAL) for m in self._feed(messages))
        else:
            self._ended = False
            batches = self._eval_batches()
        for msg in batches:
            out, count = self._faults.guard(msg.index, lambda m=msg: self.runner.eval_step(m))
            tally = add_counts(tally, count)
            seen += msg.size
            if out is not None:
                self._send(out, EVAL)
        if self.rank == 0:
            self._end()  # the other ranks forward END as they take it
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

    def close(self) -> None:
        """Stop the receiving and watching threads; tell the others if batches are still in flight; release the group.

        After a failure (or with batches still in flight) this rank's sends, receives and collectives are
        aborted first, so the group is destroyed (if this runtime made it) without waiting on any peer; rank 0,
        which holds the store unless torchrun does, first gives every rank a few seconds to read the report.
        """
        if self._closed:
            return
        self._closed = True
        failed = self._open or self._faults.error is not None
        if self._open and self._faults.error is None:
            self._faults.closed_early()
        if self._inbox is not None:
            self._inbox.stop.set()
        self._faults.unwatch()
        if not dist.is_initialized():
            return
        if failed:
            if self.rank == 0:
                self._faults.wait_taken(dist.get_world_size())
            abort(self._groups)
        else:
            self._outbox.settle()
            if self._sender is not None:
                self._sender.settle()
            if self._receiver is not None:
                self._receiver.join(_WEIGHTS_WAIT)
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
        if self._receiver is not None and not self._weights_open:
            self._weights_open = True
            self._receiver.start(self._wait_thread)
        if self._sender is not None:
            self._sender.trained = True
        send = self._relay if self._rule.sends(reused) else None
        _, loss = self._faults.guard(msg.index, lambda: self.runner.train_step(msg, send))
        self.runner.reused += reused
        return float(loss)

    def _relay(self, out: Message) -> None:
        """Send a training output on (called by the stage as soon as its forward made it): early always, as an
        ``isend`` posted at once finds room (the receiving thread of the next stage takes it into its queue)."""
        with span(self.runner.recorder, "send", out.index):
            self._send(out, TRAIN)

    def _scatter(self, msg: Message, kind: str) -> Message:
        """Rank 0: send the other replicas of stage 0 their slices of a batch; this rank's own slice."""
        feeds = self._place.feeds
        if not feeds:
            return msg
        guard, specs = self._faults.guard, self._data_specs
        parts = guard(msg.index, lambda: split(msg, specs, self._planned, 1 + len(feeds)))
        self._open = True
        self._outbox.post([(dst, guard(msg.index, lambda p=p: self._wire.pack(p, kind, specs)))
                           for dst, p in zip(feeds, parts[1:])])
        return parts[0]

    def _send(self, msg: Message, kind: str) -> None:
        guard, specs, downstream = self._faults.guard, self._out_specs, self._place.downstream
        parts = guard(msg.index, lambda: split(msg, specs, self._planned, len(downstream)))
        packed = [(dst, guard(msg.index, lambda p=p: self._wire.pack(p, kind, specs)))
                  for dst, p in zip(downstream, parts)]
        self._open = True
        self._outbox.post(packed)

    def _end(self) -> None:
        """Close an epoch: send END to every receiver (none on the last stage) and wait for every send."""
        end = self._wire.end()
        self._outbox.post([(dst, end) for dst in self._receivers])
        self._outbox.drain(self._receivers)
        self._open = self._weights_open = False
        if self._sender is not None:
            peer = self._place.ranks[self.stage - 1][0]
            try:
                self._sender.end()
            except Exception as e:  # noqa: BLE001 - a send fails when the peer is gone
                self._faults.lost(e, peer, "sending weights to")

    def _feed(self, messages: Iterable[Message]) -> Iterator[Message]:
        """Rank 0's batches; a loader that raises stops the other ranks before the error propagates."""
        it = iter(messages)
        while True:
            try:
                msg = next(it)
            except StopIteration:
                return
            except Exception as e:
                self._faults.data_failed(e)
                raise
            yield msg

    def _until_end(self) -> Iterator[tuple[float, int]]:
        """Train on every batch until END (forwarded on); each loss with its batch size (0 when reused)."""
        while True:
            item, reused = self._take(reuse=self._queue == "reuse")
            if item is END:
                return
            loss = self._train(self._expect(item, TRAIN), reused)
            yield loss, 0 if reused else item.whole or item.size

    def _eval_batches(self) -> Iterator[Message]:
        while True:
            item, _ = self._take(reuse=False)
            if item is END:
                return
            yield self._expect(item, EVAL)

    def _expect(self, msg: Message, kind: str) -> Message:
        if msg.kind != kind:
            error = PPLLError(f"stage {self.stage} received an {msg.kind} batch while it expected {kind} batches: "
                              f"every process must make the same trainer calls (step/finish/fit/evaluate/save/"
                              f"load) in the same order")

            def fail() -> NoReturn:
                raise error

            self._faults.guard(msg.index, fail)
        return msg

    def _take(self, *, reuse: bool) -> tuple[Any, bool]:
        """The next input (or END) and whether it is a reused one (``queue="reuse"``)."""
        start = time.perf_counter()
        item, reused = self._next(reuse=reuse)
        recorder = self.runner.recorder
        if recorder is not None and isinstance(item, Message) and item.kind == TRAIN and not reused:
            recorder.add("receive", item.index, start, time.perf_counter())
        return item, reused

    def _next(self, *, reuse: bool) -> tuple[Any, bool]:
        """The next input (or END) by :func:`.schedule.next_input`; ``reuse=False`` takes every input in order."""
        rule = self._rule if reuse else dataclasses.replace(self._rule, queue="fifo")
        item, reused = next_input(rule, poll=lambda: self._get(block=False), wait=lambda: self._get(block=True),
                                  memory=self._recent)
        if item is END:
            self._recent.clear()
            self._end()
        return item, reused

    def _get(self, *, block: bool) -> Any:
        if self._inbox is None:
            self._inbox = Inbox(self._receive, self._depth, self.device, latest=self._rule.takes_newest)
        inbox = self._inbox
        item = inbox.get(block=block, alarm=self._alarm, idle=self._faults.check_store)
        self.runner.dropped += inbox.queue.dropped()
        if item is None:
            return None
        if item is END:
            self._inbox = None
        else:
            self._open = True
        return item

    def _wait_thread(self, thread: Any) -> None:
        """Wait for the last epoch's receiving thread of the momentum head, looking for failures meanwhile."""
        while thread.is_alive():
            thread.join(_STORE_POLL)
            self._faults.check_store()

    def _alarm(self, alarm: Stop | Failure) -> NoReturn:
        self._inbox = None
        if isinstance(alarm, Stop):
            self._faults.remote(alarm.report)
        self._faults.lost(alarm.error, self._wire.receiving_from, "receiving from")

    def _receive(self) -> Any:
        """Receive one batch from the upstream ranks, a part from each, joined by rows (on the inbox thread)."""
        return self._wire.receive(self._place.upstream)

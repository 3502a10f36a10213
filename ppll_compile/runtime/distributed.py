"""The ``distributed`` runtime: one process per stage (under torchrun), activations sent point to point."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import PPLLError
from ..lowered import Lowered
from ..plan import Plan, TensorSpec
from ..timeline import span
from .local import Counts, Losses, Runtime
from .runners import make_runners
from .stage import EVAL, TRAIN, Message, Recent, StageError, TrainConfig, add_counts, dtype_of

__all__ = ["DistributedRuntime", "ERROR_KEY"]

ERROR_KEY = "ppll/error"
"""Store key under which the first failing stage publishes its report (JSON)."""

_TRAIN, _EVAL, _END, _STOP = 1, 2, 3, 4
_KIND_CODES = {TRAIN: _TRAIN, EVAL: _EVAL}
_MAX_DIMS = 8
_HEADER = 8 + _MAX_DIMS
_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64)
"""Target dtypes the header can name (by position)."""
_SCALARS = {"int": torch.int64, "float": torch.float64, "bool": torch.int64}
_PY_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "float": float, "bool": bool}
_POLL = 0.05  # seconds between checks of the stop flag while a queue is full or empty
_STORE_POLL = 0.25  # seconds between looks at the store's error key while waiting for input
_LINGER = 5.0  # seconds a failing rank waits for its STOP message to be taken before it raises
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_END_ITEM = object()


class _Stop:
    """A STOP header arrived from upstream, with the failing stage's report."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report


class _Failure:
    """Receiving from upstream raised (the peer died, or the process group timed out)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Inbox:
    """A thread that receives one epoch's messages (until END, STOP or a failure) into a bounded queue."""

    def __init__(self, receive: Callable[[], Any], depth: int, device: torch.device) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.alarm: _Stop | _Failure | None = None
        """Set as soon as STOP or a failure is received, so the trainer need not drain the queue first."""
        self._receive = receive
        self._device = device
        self.thread = threading.Thread(target=self._run, name="ppll-receive", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while not self.stop.is_set():
            try:
                item = self._receive()
            except BaseException as e:  # noqa: BLE001 - the trainer turns it into a StageError
                item = _Failure(e)
            if isinstance(item, (_Stop, _Failure)):
                self.alarm = item
            self._put(item)
            if item is _END_ITEM or isinstance(item, (_Stop, _Failure)):
                return

    def _put(self, item: Any) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue


def _expected(spec: TensorSpec, planned: int, batch: int) -> tuple[int, ...]:
    """The shape of a value of ``spec`` at ``batch``: dimension 0 scales when it is the planned batch size."""
    if spec.shape and spec.shape[0] == planned:
        return (batch, *spec.shape[1:])
    return tuple(spec.shape)


def _text(shape: Iterable[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _raise(error: BaseException) -> None:
    raise error


def _wait_quietly(works: list[Any]) -> None:
    try:
        for w in works:
            w.wait()
    except Exception:  # noqa: BLE001 - best effort: the peer may be gone
        pass


def _init_group(stages: int, timeout: float) -> bool:
    """Initialise the default process group from torchrun's environment; whether this call did it."""
    if not dist.is_available():
        raise PPLLError('runtime="distributed" needs torch.distributed, which this PyTorch build lacks; use '
                        'runtime="threads"')
    if dist.is_initialized():
        return False
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise PPLLError(f'runtime="distributed" runs one process per stage, but {", ".join(missing)} '
                        f'{"is" if len(missing) == 1 else "are"} not set: launch the script with '
                        f'torchrun --nproc-per-node={stages} your_script.py (or call '
                        f'torch.distributed.init_process_group yourself before building the trainer)')
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return True


def _check_same_plan(plan: Any, world: int) -> None:
    """Every rank must run the same cuts and heads: a plan measured by time may differ from process to process."""
    mine = {"cuts": list(plan.cuts), "heads": [s.head.config for s in plan.stages],
            "replicas": [s.replicas for s in plan.stages], "blocks": [list(s.blocks) for s in plan.stages]}
    plans: list[Any] = [None] * world
    dist.all_gather_object(plans, mine)
    differ = [r for r, p in enumerate(plans) if p != plans[0]]
    if differ:
        other = " (and other heads or replicas)" if plans[0]["cuts"] == plans[differ[0]]["cuts"] else ""
        raise PPLLError(f"the processes compiled different plans: rank 0 cuts after {plans[0]['cuts']}, rank "
                        f"{differ[0]} after {plans[differ[0]]['cuts']}{other}. Plan once (e.g. "
                        "plan.save('plan.json') on one process) and compile with plan='plan.json' on every rank")


def _rows(v: Any, spec: TensorSpec | None, planned: int) -> bool:
    """Whether ``v`` is split by rows between replicas: a tensor whose dimension 0 is the batch."""
    return isinstance(v, Tensor) and spec is not None and bool(spec.shape) and spec.shape[0] == planned


def _split(msg: Message, specs: tuple[TensorSpec, ...], planned: int, parts: int) -> list[Message]:
    """``msg`` cut by rows into ``parts`` near-equal slices, one per replica (other values go to each whole)."""
    if parts == 1:
        return [msg]
    if msg.size < parts:
        raise PPLLError(f"a batch of {msg.size} example(s) cannot be split over {parts} replicas; feed batches of "
                        f"at least {parts} examples")

    def cut(v: Any, rows: bool) -> Any:
        return v.tensor_split(parts) if rows else [v] * parts

    columns = [cut(v, _rows(v, s, planned)) for v, s in zip(msg.values, specs)]
    targets, raws = cut(msg.target, True), cut(msg.raw, msg.raw is not None)
    return [Message(index=msg.index, values=tuple(c[i] for c in columns), target=targets[i], raw=raws[i],
                    kind=msg.kind, whole=msg.whole or msg.size) for i in range(parts)]


def _join(values: list[Any], spec: TensorSpec | None, planned: int) -> Any:
    """The parts of one value received from several replicas, joined by rows (or the first, if not split)."""
    return torch.cat(values) if _rows(values[0], spec, planned) and len(values) > 1 else values[0]


def _device(rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", rank % count))
    if local >= count:
        raise PPLLError(f"LOCAL_RANK is {local} but this machine has {count} CUDA device(s); start at most "
                        f"{count} processes per node (torchrun --nproc-per-node={count})")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class DistributedRuntime(Runtime):
    """One process per stage replica: ranks are given to the stages in order, ``plan.stages[j].replicas`` each.

    FIFO is the same computation as sequential; ``queue="latest"`` needs one process per stage.

    ``step``/``finish``/``epoch`` must be called in the same order on every process (the trainer's ``fit``,
    ``evaluate``, ``save`` and ``load`` do). ``epoch`` ends with an all-gather of the stage losses, so on
    every process the losses passed to ``on_step`` (and ``fit``'s history) cover every stage.

    Rank ``r`` runs on ``cuda:LOCAL_RANK`` (or the CPU). Only rank 0 reads data; every batch travels down
    the ranks as a fixed-length int64 header followed by its tensors::

        header   kind, batch index, batch size, target dtype code, target ndim, raw present, extra bytes,
                 whole batch size (0 unless the part is a replica's slice), target shape (padded to 8 dims)
        tensors  the boundary values (in the plan's order), the target, the raw input if a later head needs it

    Receive buffers are sized from the plan (``plan.stages[r - 1].boundary``; the raw input from the first
    tensor of ``plan.inputs``): a dimension 0 equal to the planned batch size is the batch and takes the
    header's batch size, so a smaller last batch works and no shapes are exchanged per step. Python scalars
    that cross a cut (sizes read off tensors) travel as one-element tensors (int64 for ``int`` and ``bool``,
    float64 for ``float``) and arrive as the same Python type.

    Replicas: a sender cuts each batch by rows into one slice per replica of the next stage (rank 0 also
    for the other replicas of stage 0), and a replica joins the slices it gets from every replica before
    it. Each replica trains under DDP in its stage's group on its slice, its loss scaled by
    ``slice * replicas / batch`` so that the all-reduced gradient is the whole batch's. ``decoupled=False``
    puts a barrier over all ranks after every batch (relaying without decoupled updates).

    A thread per process receives one epoch's batches (until the END header) into a bounded queue; the main
    thread trains and sends on with ``isend`` (at most ``depth`` batches outstanding) and, with
    ``queue="latest"``, reuses an input when the queue is empty, by the threads runtime's rules. (Gloo's
    ``Work.is_completed()`` stays false until ``wait()`` is called, so a pre-posted ``irecv`` cannot be
    polled; the receiving thread is what lets a stage see "no new input yet".)

    A stage that raises publishes ``{stage, batch, message, traceback}`` under :data:`ERROR_KEY` in the
    process group's store and sends a STOP header carrying the same report downstream before it raises. A
    rank that gets STOP, finds the key while it waits, or whose send or receive fails because a peer died,
    raises a :class:`StageError` for the *original* stage ("reported by stage ..."), or one naming the lost
    peer.
    """

    def __init__(self, plan: Plan, lowered: Lowered, config: TrainConfig, *, depth: int, latest: bool,
                 timeout: float, decoupled: bool = True) -> None:
        k = plan.num_stages
        self._owns_group = _init_group(plan.world_size, timeout)
        try:
            world = dist.get_world_size()
            if world != plan.world_size:
                replicas = f" ({' + '.join(str(s.replicas) for s in plan.stages)} replicas)" \
                    if plan.world_size != k else ""
                raise PPLLError(f"the plan has {k} stages{replicas}, so it needs {plan.world_size} processes; got "
                                f"world size {world} (launch with torchrun --nproc-per-node={plan.world_size}, or "
                                f"compile with gpus={world})")
            if latest and plan.world_size != k:
                raise PPLLError('queue="latest" needs one process per stage: the replicas of a stage must train '
                                'on the same number of batches; compile with replicas=False or use queue="fifo"')
            self.rank = dist.get_rank()
            _check_same_plan(plan, world)
            first = [sum(s.replicas for s in plan.stages[:j]) for j in range(k + 1)]
            self._ranks = [list(range(first[j], first[j + 1])) for j in range(k)]
            """The ranks of every stage's replicas."""
            self.stage = max(j for j in range(k) if first[j] <= self.rank)
            self.replica = self.rank - first[self.stage]
            group = None
            for j, ranks in enumerate(self._ranks):  # every rank creates every group, in the same order
                g = dist.new_group(ranks) if len(ranks) > 1 else None
                group = g if j == self.stage else group
            self._sync = None if decoupled else dist.new_group(list(range(world)))
            self.device = _device(self.rank)
            self.runners = make_runners(plan, lowered, config, [self.stage], [self.device], [group])
        except BaseException:
            if self._owns_group:
                dist.destroy_process_group()
            raise
        self.runner = self.runners[0]
        self.num_stages = k
        self.is_main_writer = self.reads_data = self.rank == 0
        self.is_main = self.stage == k - 1 and self.replica == 0
        backend = str(dist.get_backend())
        self._comm = self.device if self.device.type == "cuda" and "nccl" in backend else torch.device("cpu")
        """Where send and receive buffers live: the GPU under NCCL, else the CPU (gloo)."""
        self._depth = depth
        self._latest = latest
        self._planned = plan.batch_size
        fed = self.stage == 0 and self.replica > 0  # receives its slice of the data from rank 0
        self._upstream = [0] if fed else self._ranks[self.stage - 1] if self.stage > 0 else []
        self._feeds = self._ranks[0][1:] if self.rank == 0 else []
        """Rank 0: the other replicas of stage 0, which it sends their slices of every batch."""
        self._downstream = self._ranks[self.stage + 1] if self.stage < k - 1 else []
        self._data_specs = plan.inputs
        self._in_specs = plan.inputs if fed else plan.stages[self.stage - 1].boundary if self.stage > 0 else ()
        self._out_specs = plan.stages[self.stage].boundary
        self._raw_spec = next((s for s in plan.inputs if dtype_of(s.dtype) is not None), None)
        for j, specs in ((j, plan.stages[j - 1].boundary if j else plan.inputs) for j in range(k)):
            split = plan.stages[j].replicas > 1 or (j > 0 and plan.stages[j - 1].replicas > 1)
            if split and any(dtype_of(t.dtype) is None for t in specs):
                raise PPLLError(f"stage {j} is replicated (or follows a replicated stage), but its input carries a "
                                f"Python scalar, which cannot be split by rows; compile with replicas=False or "
                                f"cut elsewhere")
        self._sends: deque[tuple[list[Any], list[Tensor]]] = deque()
        self._inbox: _Inbox | None = None
        self._receiving_from = self._upstream[0] if self._upstream else 0
        self._recent = Recent()
        self._open = False  # batches sent (rank 0) or taken (others) since the last END
        self._ended = False  # an END taken by step() that no finish() has matched yet
        self._error: StageError | None = None
        self._stop_sent = False
        self._closed = False

    # ---- the trainer's side -------------------------------------------------------------------
    def _losses(self, mine: list[float]) -> Losses:
        """Per stage, ``mine`` for this rank's stage; a replicated stage reports its first replica's losses."""
        return [list(mine) if i == self.stage and self.replica == 0 else [] for i in range(self.num_stages)]

    def _by_stage(self, per_rank: list[Any]) -> list[list[Any]]:
        """Values gathered from every rank, grouped by stage (replicas in order)."""
        return [[per_rank[r] for r in ranks] for ranks in self._ranks]

    def step(self, msg: Message | None) -> Losses:
        """Rank 0: train stage 0 on ``msg`` and send it on. Other ranks: receive one batch, train, send on."""
        self._raise_if_failed()
        if self.rank == 0:
            assert msg is not None, "rank 0 reads the data: step() needs a batch there"
            return self._losses([self._train(self._scatter(msg, _TRAIN), False)])
        item, reused = self._take(reuse=self._latest)
        if item is _END_ITEM:
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
        tally: Any = ()
        seen = 0
        self.runner.train_mode(False)
        try:
            if self.rank == 0:
                batches: Iterable[Any] = (self._scatter(m, _EVAL) for m in self._feed(messages))
            else:
                self._ended = False
                batches = self._eval_batches()
            for msg in batches:
                out, count = self._guard(msg.index, lambda m=msg: self.runner.eval_step(m))
                tally = add_counts(tally, count)
                seen += msg.size
                if out is not None:
                    self._send(out, _EVAL)
            if self.rank == 0:
                self._end()  # the other ranks forward END as they take it
        finally:
            self.runner.train_mode(True)
        counts = []
        for replicas in self._by_stage(self.gather((tally, seen))):
            total: Any = ()
            for t, _ in replicas:
                total = add_counts(total, t)
            counts.append((total, sum(n for _, n in replicas)))
        return counts

    def states(self) -> list[dict[str, Any]]:
        return [self.runner.state_dict()] if self.replica == 0 else []  # replicas hold the same state

    def barrier(self) -> None:
        dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        """Stop the receiving thread; tell the others if batches are still in flight; destroy an own group."""
        if self._closed:
            return
        self._closed = True
        if self._open and self._error is None:
            report = {"stage": self.stage, "batch": None, "by": self.stage, "traceback": "",
                      "message": f"the process of stage {self.stage} (rank {self.rank}) closed the pipeline in the "
                                 f"middle of an epoch (an exception in its training script?)"}
            self._publish(report)
            self._stop_downstream(report)
        if self._inbox is not None:
            self._inbox.stop.set()
        if self._owns_group and dist.is_initialized():
            if self._error is None and not self._open:
                _wait_quietly([w for works, _ in self._sends for w in works])
                dist.destroy_process_group()
            # after a failure, peers may be gone and the receiving thread may sit in a recv: leave the group
            # to process exit rather than risk blocking in its teardown

    # ---- training, sending ------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise PPLLError("this distributed runtime was closed; build a new trainer")

    def _guard(self, batch: int | None, fn: Callable[[], Any]) -> Any:
        """Run this rank's own stage work; an exception becomes its StageError, published to every rank."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure must stop the pipeline and reach every rank
            earlier = self._read_report()
            if earlier is not None:  # e.g. a replica's all-reduce timed out because its peer had failed first
                self._remote(earlier)
            report = {"stage": self.stage, "batch": batch, "by": self.stage,
                      "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            self._error = StageError(self.stage, batch, report["message"], report["traceback"])
            self._publish(report)
            self._stop_downstream(report)
            raise self._error from e

    def _train(self, msg: Message, reused: bool) -> float:
        out, loss = self._guard(msg.index, lambda: self.runner.train_step(msg))
        self.runner.reused += reused
        if out is not None and not reused:
            with span(self.runner.recorder, "send", msg.index):
                self._send(out, _TRAIN)
        if self._sync is not None:  # decoupled=False: the next batch starts when every stage is done with this
            dist.barrier(group=self._sync)
        return float(loss)

    def _scatter(self, msg: Message, kind: int) -> Message:
        """Rank 0: send the other replicas of stage 0 their slices of a batch; this rank's own slice."""
        if not self._feeds:
            return msg
        specs = self._data_specs
        parts = self._guard(msg.index, lambda: _split(msg, specs, self._planned, 1 + len(self._feeds)))
        self._open = True
        self._post([(dst, self._guard(msg.index, lambda p=p: self._pack(p, kind, specs)))
                    for dst, p in zip(self._feeds, parts[1:])])
        return parts[0]

    def _send(self, msg: Message, kind: int) -> None:
        parts = self._guard(msg.index, lambda: _split(msg, self._out_specs, self._planned, len(self._downstream)))
        packed = [(dst, self._guard(msg.index, lambda p=p: self._pack(p, kind, self._out_specs)))
                  for dst, p in zip(self._downstream, parts)]
        self._open = True
        self._post(packed)

    def _pack(self, msg: Message, kind: int, specs: tuple[TensorSpec, ...]) -> list[Tensor]:
        """The header and tensors of ``msg``, checked against the plan's ``specs`` of what it carries."""
        r = self.stage
        if len(msg.values) != len(specs):
            raise PPLLError(f"stage {r} produced {len(msg.values)} boundary value(s); the plan has {len(specs)}")
        batch = next((int(v.shape[0]) for v, s in zip(msg.values, specs)
                      if isinstance(v, Tensor) and v.dim() and s.shape and s.shape[0] == self._planned), None)
        if batch is None:
            batch = int(msg.raw.shape[0]) if isinstance(msg.raw, Tensor) and msg.raw.dim() else msg.size
        payload: list[Tensor] = []
        for v, s in zip(msg.values, specs):
            dtype = dtype_of(s.dtype)
            if dtype is None:
                if isinstance(v, Tensor) or not isinstance(v, (int, float, bool)) or s.dtype not in _SCALARS:
                    raise PPLLError(f"stage {r} sends {s.name!r} as {type(v).__name__}; the plan says it is a "
                                    f"Python {s.dtype}, and only int, float and bool scalars can travel between "
                                    f"processes beside tensors; cut elsewhere (split_points=...)")
                payload.append(torch.tensor([v], dtype=_SCALARS[s.dtype]))
                continue
            payload.append(self._checked(v, s, batch, f"boundary value {s.name!r}"))
        target = msg.target
        if not isinstance(target, Tensor):
            raise PPLLError(f"the distributed runtime sends the labels between processes as one tensor; got "
                            f"{type(target).__name__}. Pass the target as a tensor (or use runtime=\"threads\")")
        if target.dim() > _MAX_DIMS or target.dtype not in _DTYPES:
            raise PPLLError(f"the target has shape {_text(target.shape)} and dtype {target.dtype}; the "
                            f"distributed runtime sends targets of at most {_MAX_DIMS} dimensions and dtypes "
                            f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}; convert it first")
        payload.append(target)
        if msg.raw is not None:
            assert self._raw_spec is not None
            payload.append(self._checked(msg.raw, self._raw_spec, batch, "the raw input"))
        shape = list(target.shape) + [0] * (_MAX_DIMS - target.dim())
        header = torch.tensor([kind, msg.index, batch, _DTYPES.index(target.dtype), target.dim(),
                               int(msg.raw is not None), 0, msg.whole or 0, *shape], dtype=torch.int64)
        return [t.detach().to(self._comm).contiguous() for t in (header, *payload)]

    def _checked(self, v: Any, spec: TensorSpec, batch: int, what: str) -> Tensor:
        want = _expected(spec, self._planned, batch)
        dtype = dtype_of(spec.dtype)
        if not isinstance(v, Tensor) or tuple(v.shape) != want or v.dtype != dtype:
            found = f"shape {_text(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, Tensor) \
                else type(v).__name__
            raise PPLLError(f"stage {self.stage} sends {what} with {found}; the plan fixes {_text(want)} "
                            f"{spec.dtype} for a batch of {batch}. The distributed runtime sizes its receive "
                            f"buffers from the plan, where only a dimension 0 equal to the planned batch size "
                            f"({self._planned}) may vary: compile with example inputs shaped like your batches")
        return v

    def _post(self, parts: list[tuple[int, list[Tensor]]]) -> None:
        """``isend`` one batch's tensors, ``(rank, tensors)`` per receiver; wait on batches beyond ``depth``."""
        peer = parts[0][0] if parts else self.rank
        try:
            for peer, tensors in parts:
                self._sends.append(([dist.isend(t, peer) for t in tensors], tensors))
            while len(self._sends) > self._depth * max(1, len(parts)):
                self._wait_oldest()
        except Exception as e:  # noqa: BLE001 - a send fails when the peer is gone
            self._lost(e, peer, "sending to")

    def _wait_oldest(self) -> None:
        works, _ = self._sends.popleft()
        for w in works:
            w.wait()

    def _end(self) -> None:
        """Close an epoch: send END to every receiver (none on the last stage) and wait for every send."""
        receivers = self._feeds + self._downstream
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _END
        self._post([(dst, [header.to(self._comm)]) for dst in receivers])
        try:
            while self._sends:
                self._wait_oldest()
        except Exception as e:  # noqa: BLE001
            self._lost(e, receivers[0], "sending to")
        self._open = False

    def _feed(self, messages: Iterable[Message]) -> Iterator[Message]:
        """Rank 0's batches; a loader that raises stops the other ranks before the error propagates."""
        it = iter(messages)
        while True:
            try:
                msg = next(it)
            except StopIteration:
                return
            except Exception as e:
                report = {"stage": 0, "batch": None, "by": 0, "traceback": traceback.format_exc(),
                          "message": f"reading data on the first stage's process raised {type(e).__name__}: {e}"}
                self._publish(report)
                self._stop_downstream(report)
                self._error = StageError(0, None, report["message"], report["traceback"])
                raise
            yield msg

    # ---- receiving --------------------------------------------------------------------------------
    def _until_end(self) -> Iterator[tuple[float, int]]:
        """Train on every batch until END (forwarded on); each loss with its batch size (0 when reused)."""
        while True:
            item, reused = self._take(reuse=self._latest)
            if item is _END_ITEM:
                return
            loss = self._train(self._expect(item, TRAIN), reused)
            yield loss, 0 if reused else item.whole or item.size

    def _eval_batches(self) -> Iterator[Message]:
        while True:
            item, _ = self._take(reuse=False)
            if item is _END_ITEM:
                return
            yield self._expect(item, EVAL)

    def _expect(self, msg: Message, kind: str) -> Message:
        if msg.kind != kind:
            error = PPLLError(f"stage {self.stage} received an {msg.kind} batch while it expected {kind} batches: "
                              f"every process must make the same trainer calls (step/finish/fit/evaluate/save/"
                              f"load) in the same order")
            self._guard(msg.index, lambda: _raise(error))
        return msg

    def _take(self, *, reuse: bool) -> tuple[Any, bool]:
        """The next input (or END) and whether it is a reused one (``queue="latest"``)."""
        start = time.perf_counter()
        item, reused = self._next(reuse=reuse)
        recorder = self.runner.recorder
        if recorder is not None and isinstance(item, Message) and item.kind == TRAIN and not reused:
            recorder.add("receive", item.index, start, time.perf_counter())
        return item, reused

    def _next(self, *, reuse: bool) -> tuple[Any, bool]:
        if reuse:
            item = self._get(block=False)
            if item is None:
                again = self._recent.reuse()
                if again is not None:
                    return again, True
                item = self._get(block=True)
            if isinstance(item, Message):
                self._recent.remember(item)
        else:
            item = self._get(block=True)
        if item is _END_ITEM:
            self._recent.clear()
            self._end()
        return item, False

    def _get(self, *, block: bool) -> Any:
        if self._inbox is None:
            self._inbox = _Inbox(self._receive, self._depth, self.device)
        inbox = self._inbox
        waited = 0.0
        while True:
            if inbox.alarm is not None:
                self._alarm(inbox.alarm)
            try:
                item = inbox.queue.get(timeout=_POLL) if block else inbox.queue.get_nowait()
                break
            except queue.Empty:
                if not block:
                    return None
                waited += _POLL
                if waited >= _STORE_POLL:
                    waited = 0.0
                    report = self._read_report()
                    if report is not None:
                        self._remote(report)
        if isinstance(item, (_Stop, _Failure)):
            self._alarm(item)
        if item is _END_ITEM:
            self._inbox = None
        else:
            self._open = True
        return item

    def _alarm(self, alarm: _Stop | _Failure) -> None:
        self._inbox = None
        if isinstance(alarm, _Stop):
            self._remote(alarm.report)
        self._lost(alarm.error, self._receiving_from, "receiving from")  # type: ignore[union-attr]

    def _receive(self) -> Any:
        """Receive one batch from the upstream ranks, a part from each, joined by rows (on the inbox thread)."""
        parts = []
        for src in self._upstream:
            self._receiving_from = src
            part = self._receive_part(src)
            if isinstance(part, _Stop):
                return part
            parts.append(part)
        if all(p is _END_ITEM for p in parts):
            return _END_ITEM
        if any(p is _END_ITEM for p in parts):
            raise PPLLError(f"stage {self.stage} received END from some replicas of stage {self.stage - 1} and "
                            f"a batch from others")
        first = parts[0]
        values = tuple(_join([p.values[i] for p in parts], spec, self._planned)
                       for i, spec in enumerate(self._in_specs))
        raw = _join([p.raw for p in parts], self._raw_spec, self._planned) if first.raw is not None else None
        return Message(index=first.index, values=values, target=torch.cat([p.target for p in parts]), raw=raw,
                       kind=first.kind, whole=first.whole)

    def _receive_part(self, src: int) -> Any:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self._comm)
        dist.recv(header, src)
        h = header.tolist()
        kind = h[0]
        if kind == _END:
            return _END_ITEM
        if kind == _STOP:
            blob = torch.empty(h[6], dtype=torch.uint8, device=self._comm)
            dist.recv(blob, src)
            return _Stop(json.loads(bytes(blob.tolist()).decode()))
        if kind not in (_TRAIN, _EVAL):
            raise PPLLError(f"stage {self.stage} received a header of unknown kind {kind} from rank {src}")
        batch = h[2]
        values: list[Any] = []
        for s in self._in_specs:
            dtype = dtype_of(s.dtype)
            if dtype is None:
                buf = torch.empty(1, dtype=_SCALARS[s.dtype], device=self._comm)
                dist.recv(buf, src)
                values.append(_PY_TYPES[s.dtype](buf.item()))
            else:
                buf = torch.empty(_expected(s, self._planned, batch), dtype=dtype, device=self._comm)
                dist.recv(buf, src)
                values.append(buf)
        target = torch.empty(h[8:8 + h[4]], dtype=_DTYPES[h[3]], device=self._comm)
        dist.recv(target, src)
        raw = None
        if h[5]:
            assert self._raw_spec is not None
            raw = torch.empty(_expected(self._raw_spec, self._planned, batch),
                              dtype=dtype_of(self._raw_spec.dtype), device=self._comm)
            dist.recv(raw, src)
        if self._comm.type == "cuda":
            torch.cuda.current_stream(self._comm).synchronize()  # the trainer reads them on its own thread
        return Message(index=h[1], values=tuple(values), target=target, raw=raw,
                       kind=TRAIN if kind == _TRAIN else EVAL, whole=h[7] or None)

    # ---- faults -----------------------------------------------------------------------------------
    def _publish(self, report: dict[str, Any]) -> None:
        """Put ``report`` under ERROR_KEY unless an earlier failure is there already (best effort)."""
        try:
            dist.distributed_c10d._get_default_store().compare_set(ERROR_KEY, "", json.dumps(report))
        except Exception:  # noqa: BLE001 - the store's host may be gone
            pass

    def _read_report(self) -> dict[str, Any] | None:
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.check([ERROR_KEY]):
                return json.loads(store.get(ERROR_KEY))
        except Exception:  # noqa: BLE001
            pass
        return None

    def _stop_downstream(self, report: dict[str, Any]) -> None:
        """Send STOP with ``report`` to every receiver and give them a few seconds to take it (best effort)."""
        receivers = self._feeds + self._downstream
        if not receivers or self._stop_sent:
            return
        self._stop_sent = True
        works = []
        blob = torch.tensor(list(json.dumps(report).encode()), dtype=torch.uint8)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[6] = _STOP, blob.numel()
        tensors = [header.to(self._comm), blob.to(self._comm)]
        for dst in receivers:
            try:
                works += [dist.isend(t, dst) for t in tensors]
            except Exception:  # noqa: BLE001 - that receiver is gone already
                continue
        waiter = threading.Thread(target=_wait_quietly, args=(works,), name="ppll-stop", daemon=True)
        waiter.start()
        waiter.join(_LINGER)

    def _remote(self, report: dict[str, Any]) -> None:
        """Raise the StageError of another rank's ``report`` (after passing STOP on)."""
        by = report.get("by", report["stage"])
        self._error = StageError(int(report["stage"]), report.get("batch"),
                                 f"{report['message']} (reported by stage {by} to stage {self.stage})",
                                 report.get("traceback", ""))
        self._stop_downstream(report)
        raise self._error

    def _lost(self, error: BaseException, peer: int, doing: str) -> None:
        """A send or receive failed: raise the published report if any, else an error naming the lost peer rank."""
        if isinstance(error, StageError):
            raise error
        report = self._read_report()
        if report is None:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            stage = next(j for j, ranks in enumerate(self._ranks) if peer in ranks)
            report = {"stage": stage, "batch": None, "by": self.stage, "traceback": "",
                      "message": f"lost contact with the process of stage {stage} (rank {peer}) while {doing} it: "
                                 f"it stopped without reporting an error (killed, out of memory, crashed, or no "
                                 f"message within the process group's timeout); see its own output. "
                                 f"{type(error).__name__}: {first}"}
            self._publish(report)
        self._remote(report)

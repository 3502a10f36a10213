"""The trainer: one training-loop API over the sequential, threads, distributed (and DNA) runtimes."""

from __future__ import annotations

import math
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import PPLLError, StageError
from ..lowered import Lowered
from ..plan import Plan
from ..timeline import Recorder, Timeline
from . import checkpoint
from .base import Losses, Runtime, progress_bar
from .config import TrainConfig
from .distributed import DistributedRuntime
from .dna import DNA_RUNTIMES, DNAPerBlockRuntime
from .inputs import batch_message, loader_pair
from .messages import EVAL, TRAIN, Message
from .runner import Runner
from .momentum import link_local
from .runners import make_runners
from .sequential import SequentialRuntime
from .threads import ThreadsRuntime

__all__ = ["Trainer", "RUNTIMES", "QUEUES"]

RUNTIMES = ("sequential", "threads", "distributed")
QUEUES = ("fifo", "latest", "reuse")
_TRAINERS: weakref.WeakKeyDictionary[Lowered, weakref.ref[Trainer]] = weakref.WeakKeyDictionary()
"""The last trainer built on each compiled pipeline's modules (one may be open at a time)."""


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not known; choose one of {', '.join(choices)}")


def _check_options(plan: Plan, *, runtime: str, queue: str, optimizer: Any, queue_depth: Any, loss: Any,
                   decoupled: bool, trace: Any, seed: Any) -> None:
    """The trainer's options, each alone and together with the others and the plan's kind."""
    distill = plan.mode == "pipebd"
    _check_choice("runtime", runtime, RUNTIMES + (tuple(DNA_RUNTIMES) if distill else ()))
    _check_choice("queue", queue, QUEUES)
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a factory fn(params) -> torch.optim.Optimizer, e.g. "
                        f"lambda p: torch.optim.SGD(p, lr=0.1); got {optimizer!r}")
    if not (isinstance(queue_depth, int) and queue_depth >= 1):
        raise ValueError(f"queue_depth must be an integer >= 1, got {queue_depth!r}")
    if queue != "fifo" and runtime in ("sequential", *DNA_RUNTIMES):
        raise ValueError(f'queue="{queue}" needs a pipelined runtime ("threads" or "distributed"); the '
                         f'{runtime} runtime never waits')
    if distill and loss is not None:
        raise ValueError("a pipebd plan trains on the distillation losses of its policy; drop loss= and "
                         "compile with policy=... (pipebd, mse, kl or your YAML file) instead")
    if not decoupled and (queue != "fifo" or runtime in ("sequential", *DNA_RUNTIMES)):
        raise ValueError('decoupled=False (a barrier of all the stages before every optimizer step) applies to the '
                         'pipelined runtimes "threads" and "distributed" with queue="fifo"')
    if not isinstance(trace, bool):
        raise TypeError(f"trace must be True or False, got {trace!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int (the seed of every stage's dropout and other training randomness) "
                        f"or None (draw from torch's global generator, unseeded); got {seed!r}")


def _autocast(value: Any, n: int) -> tuple[torch.dtype | None, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.dtype):
        return (value,) * n
    if isinstance(value, Sequence) and len(value) == n and all(v is None or isinstance(v, torch.dtype)
                                                                 for v in value):
        return tuple(value)
    raise ValueError(f"autocast must be a dtype (e.g. torch.bfloat16), None, or one dtype-or-None per stage "
                     f"({n} stages); got {value!r}")


def _make_runtime(name: str, plan: Plan, lowered: Lowered, config: TrainConfig, *, depth: int, queue: str,
                  threads_per_stage: int | None, timeout: float, decoupled: bool) -> Runtime:
    """The runtime called ``name``, with its runners built for ``plan``."""
    if name == "distributed":
        return DistributedRuntime(plan, lowered, config, depth=depth, queue=queue, timeout=timeout,
                                  decoupled=decoupled)
    if name in DNA_RUNTIMES:
        return DNA_RUNTIMES[name](plan, lowered, config, timeout=timeout)
    k = plan.num_stages
    runners = make_runners(plan, lowered, config, range(k), [torch.device(d) for d in plan.devices])
    link_local(runners, lowered)
    if name == "sequential":
        return SequentialRuntime(runners)
    share = threads_per_stage or max(1, (os.cpu_count() or 1) // k)
    return ThreadsRuntime(runners, depth=depth, queue=queue, threads_per_stage=share, decoupled=decoupled)


class Trainer:
    """Trains a compiled pipeline by local learning, or a student by blockwise distillation (a ``pipebd``
    plan); build it with :meth:`CompiledPipeline.trainer`.

    ``step(inputs, target)`` feeds one batch and returns, per stage, the losses of the batches that stage
    finished since the last call; ``finish()`` drains the pipeline. The model is trained in place.
    Every stage sends its output on as soon as its forward made it, before its backward and step (early
    forwarding). ``queue``: ``"fifo"`` (every input in order: the same computation as ``sequential``),
    ``"latest"`` (a stage takes the newest waiting input and drops the older ones, counted in :attr:`dropped`;
    the stage before it never waits) or ``"reuse"`` (FIFO, and a stage with no waiting input trains again on
    a recent one, counted in :attr:`reused`; schedulers do not step on those unless ``schedule_reused=True``).
    ``decoupled=False`` (pipelined runtimes, FIFO) puts a barrier of all the stages before every optimizer
    step: Pipe-BD's "teacher relaying only" ablation. ``runtime="dna"`` (``pipebd`` plans) is the DNA baseline.
    ``trace=True`` records every stage's spans (receive, forward, backward, step, send); :meth:`timeline` returns them.

    ``seed`` (default 0): every stage's training forward draws its randomness (dropout, drop-path) from
    torch's default generators seeded by (``seed``, stage, batch index[, replica]), so every runtime trains
    the same computation with dropout on; the caller's generator states are restored after each forward.
    Under ``threads`` the forwards of stages that draw random numbers hold one lock (they do not overlap);
    stages that draw none run in parallel. ``seed=None`` leaves torch's global generator unseeded.
    """

    def __init__(self, plan: Plan, lowered: Lowered, *,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 runtime: str = "sequential", loss: Callable[[Any, Tensor], Tensor] | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 clip_grad_norm: float | None = None, autocast: Any = None, queue_depth: int = 2,
                 queue: str = "fifo", nan_check: bool = False, threads_per_stage: int | None = None,
                 timeout: float = 300.0, decoupled: bool = True, trace: bool = False, seed: int | None = 0,
                 schedule_reused: bool = False) -> None:
        _check_options(plan, runtime=runtime, queue=queue, optimizer=optimizer, queue_depth=queue_depth, loss=loss,
                       decoupled=decoupled, trace=trace, seed=seed)
        self.plan = plan
        self.lowered = lowered
        """The modules this trainer trains, shared with the compiled pipeline."""
        self.runtime_name = runtime
        config = TrainConfig(optimizer=optimizer, scheduler=scheduler, loss=loss, clip_grad_norm=clip_grad_norm,
                             autocast=_autocast(autocast, plan.num_stages), nan_check=nan_check, seed=seed,
                             schedule_reused=bool(schedule_reused))
        self.seed = seed
        """Seed of the stages' training randomness (``None``: unseeded); recorded in checkpoints."""
        self._carry_raw = lowered.carries_input
        _claim(lowered)
        lowered.train()
        self._runtime: Runtime = _make_runtime(runtime, plan, lowered, config, depth=queue_depth,
                                               queue=queue, threads_per_stage=threads_per_stage,
                                               timeout=timeout, decoupled=decoupled)
        _TRAINERS[lowered] = weakref.ref(self)
        weakref.finalize(self, self._runtime.abandon)  # dropped without close(): the workers end too
        self.closed = False
        """Whether :meth:`close` was called (or a ``with`` block ended)."""
        self.batches = 0
        """Batches fed in so far (by this process, under ``distributed`` the first stage's)."""
        self.tracing = trace
        """Whether the stages record their spans (``trace=True``)."""
        if trace:
            for r in self.runners:
                r.recorder = Recorder(r.index, self._runtime.replica, r.device)

    @property
    def runners(self) -> list[Runner]:
        """The stages this process trains, each with its block, head, optimizer, scheduler and counters."""
        return self._runtime.runners

    @property
    def stages(self) -> tuple[int, ...]:
        """Indices of the stages this process trains (all of them, except under ``distributed``)."""
        return tuple(r.index for r in self.runners)

    @property
    def reads_data(self) -> bool:
        """Whether this process feeds batches (under ``distributed`` only rank 0 does)."""
        return self._runtime.reads_data

    @property
    def is_main(self) -> bool:
        """Whether this process reports progress: the one running the last stage (its first replica)."""
        return self._runtime.is_main

    @property
    def steps(self) -> dict[int, int]:
        """Optimizer steps per stage run here."""
        return {r.index: r.steps for r in self.runners}

    def stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Parameters stage ``index`` trains (wherever it runs): its modules' and its head's."""
        return self.lowered.stage_parameters(self.plan.stages[index])

    @property
    def reused(self) -> dict[int, int]:
        """Inputs each stage run here trained on again instead of waiting (``queue="reuse"``)."""
        return {r.index: r.reused for r in self.runners}

    @property
    def dropped(self) -> dict[int, int]:
        """Inputs each stage run here dropped untrained because a newer one had arrived (``queue="latest"``)."""
        return {r.index: r.dropped for r in self.runners}

    def message(self, inputs: Any, target: Any = None) -> Message:
        """The message stage 0 receives for one training batch, built as :meth:`step` builds it, without feeding it.

        It is numbered as the next batch and counts in :attr:`batches`. A hook for measuring single stages:
        pass it to ``trainer.runners[0].train_step`` (or ``forward_loss``) and the message each returns on.
        """
        return self._message(inputs, target, TRAIN)

    def _message(self, inputs: Any, target: Any, kind: str) -> Message:
        msg = batch_message(self.plan, self.lowered, inputs, target, index=self.batches, kind=kind,
                            carry_raw=self._carry_raw)
        if kind == TRAIN:
            self.batches += 1
        return msg

    def step(self, inputs: Any = None, target: Any = None) -> Losses:
        """Train on one batch; per stage, the losses of the batches it finished since the last call.

        ``inputs`` is the model's input (a tensor, a tuple of positional inputs or a dict of keyword inputs).
        Under ``distributed`` only the first stage's rank reads them; the other ranks may pass ``None``.
        """
        msg = self._message(inputs, target, TRAIN) if self.reads_data else None
        return self._runtime.step(msg)

    def finish(self) -> Losses:
        """Wait until every batch fed in has gone through every stage; the losses not returned yet."""
        return self._runtime.finish()

    def _messages(self, loader: Iterable[Any], kind: str) -> Iterable[Message] | None:
        if not self.reads_data:
            return None
        return (self._message(*loader_pair(item), kind) for item in loader)

    def fit(self, loader: Iterable[Any], epochs: int = 1, progress: bool | str = True) -> list[dict[str, Any]]:
        """Train ``epochs`` passes over ``loader`` (``(inputs, target)`` pairs); per epoch, losses and throughput.

        ``progress``: a tqdm bar per epoch, labelled ``epoch k/epochs``; a string labels the bars instead (a loop
        that calls ``fit(loader, 1, progress=f"epoch {k}/{n}")`` once per epoch); ``False``: none.

        Each epoch's record holds ``epoch``, ``samples``, ``seconds``, ``samples_per_s`` and ``loss`` (every
        stage's mean loss; under ``distributed`` gathered from all ranks at the end of the epoch).
        """
        if isinstance(self._runtime, DNAPerBlockRuntime):  # block after block, each over every epoch
            history, self.batches = self._runtime.fit(loader, epochs, first=self.batches, progress=progress)
            return history
        history = []
        total = len(loader) if hasattr(loader, "__len__") else None  # type: ignore[arg-type]
        for epoch in range(epochs):
            sums = [0.0] * self.plan.num_stages
            counts = [0] * self.plan.num_stages
            seen = [0]
            label = progress if isinstance(progress, str) else f"epoch {epoch + 1}/{epochs}"
            bar = progress_bar(total, label, bool(progress) and self.is_main)
            start = time.perf_counter()

            def on_step(losses: Losses, size: int) -> None:
                for i, ls in enumerate(losses):
                    sums[i] += sum(ls)
                    counts[i] += len(ls)
                seen[0] += size
                if bar is not None:
                    rate = seen[0] / max(time.perf_counter() - start, 1e-9)
                    shown = {f"s{i}": f"{sums[i] / counts[i]:.3f}" for i in range(len(sums)) if counts[i]}
                    bar.set_postfix(shown | {"samples/s": f"{rate:.0f}"}, refresh=False)
                    bar.update(1 if size else 0)

            try:
                self._runtime.epoch(self._messages(loader, TRAIN), on_step)
            finally:
                if bar is not None:
                    bar.close()
            seconds = time.perf_counter() - start
            history.append({"epoch": epoch + 1, "samples": seen[0], "seconds": seconds,
                            "samples_per_s": seen[0] / seconds if seconds > 0 else math.nan,
                            "loss": [sums[i] / counts[i] if counts[i] else None for i in range(len(sums))]})
        return history

    def evaluate(self, loader: Iterable[Any]) -> dict[str, Any]:
        """Top-1 accuracy on ``loader`` of the final head (``accuracy``) and of every head (``stage_accuracy``).

        A head whose output is not class scores for class labels gets ``None``. Finishes pending batches first.
        A pipebd plan gives instead every block's mean distillation loss (``block_loss``) and their sum (``loss``).
        """
        counts = self._runtime.evaluate(self._messages(loader, EVAL))  # type: ignore[arg-type]
        if self.plan.mode == "pipebd":
            n = counts[-1][1]
            block = [total / n if n else None for tally, _ in counts for total in (tally or ())]
            return {"block_loss": block, "loss": sum(block) if n else None, "samples": n}
        acc = [None if not tally or not n else tally[0] / n for tally, n in counts]
        return {"accuracy": acc[-1], "stage_accuracy": acc, "samples": counts[-1][1]}

    def timeline(self) -> Timeline:
        """The spans every stage recorded so far (``trace=True``), from 0 at the earliest; ``.save(path)`` writes
        them as a Chrome trace file for ``ppll-plan --gantt`` or Perfetto.

        Under ``distributed`` it gathers the spans of every process, so every process must call it.
        """
        if not self.tracing:
            raise PPLLError("this trainer records no timeline; build it with compiled.trainer(..., trace=True)")
        mine = [e for r in self.runners for e in r.recorder.events]  # type: ignore[union-attr]
        events = [e for part in self._runtime.gather(mine) for e in part]
        return Timeline.of(events, "measured", model=self.plan.model, mode=self.plan.mode, runtime=self.runtime_name,
                           stages=self.plan.num_stages, batch_size=self.plan.batch_size)

    def save(self, path: str | os.PathLike, keep: int = 1) -> Path:
        """Write every stage's state (block, head, optimizer, scheduler, counters) as the newest checkpoint
        under the directory ``path``; the checkpoint's own directory.

        Pending batches are finished first. The checkpoint is written beside the previous one and becomes
        the newest by an atomic switch of ``path/latest`` once every process's files are complete, so a save
        killed at any moment leaves the previous checkpoint loadable (see :mod:`.checkpoint`). ``keep``
        complete checkpoints stay (the newest first); leftovers of interrupted saves are removed. The
        manifest records the batch count and the trainer's ``seed``.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1 (how many complete checkpoints stay), got {keep!r}")
        self.finish()
        rt = self._runtime
        temp = rt.gather(self._agree("start the save", lambda: checkpoint.begin(path), here=rt.is_main_writer))[0]
        work = Path(path) / temp
        mine = self._agree("write its stages", lambda: [checkpoint.save_stage(work, s) for s in rt.states()])
        files = [f for part in rt.gather(mine) for f in part]
        trainer = {"batches": self.batches, "seed": self.seed}
        self._agree("finish the save", lambda: checkpoint.commit(path, temp, self._identity(), files, trainer, keep),
                    here=rt.is_main_writer)
        return Path(path) / checkpoint.final_name(temp)

    def _agree(self, doing: str, fn: Callable[[], Any], *, here: bool = True) -> Any:
        """``fn()`` on this process (where ``here``; else ``None``). When it raised on any process, every process
        raises: this one its own error, the others a CheckpointError naming the process and the error."""
        value, error = None, None
        try:
            if here:
                value = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, once every process knows
            error = e
        try:
            texts = self._runtime.gather(None if error is None else f"{type(error).__name__}: {error}")
        except StageError:
            raise
        except Exception as e:  # noqa: BLE001 - a process that died without a word (killed, out of memory)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise checkpoint.CheckpointError(f"could not {doing}: another process of the pipeline is gone "
                                             f"({type(e).__name__}: {first}); the checkpoint that 'latest' names "
                                             f"is the newest one completed") from e
        if error is not None:
            raise error
        for rank, text in enumerate(texts):
            if text is not None:
                raise checkpoint.CheckpointError(f"the process of rank {rank} could not {doing}: {text}")
        return value

    def _identity(self) -> dict[str, Any]:
        return checkpoint.identity(self.plan, [self.stage_parameters(i) for i in range(self.plan.num_stages)],
                                   [o for r in self.runners for o in r.optimizers])

    def _read(self, path: str | os.PathLike) -> tuple[Path, dict[str, Any], dict[int, dict[str, Any]]]:
        """The checkpoint directory read, its trainer state and this process's stage states, every one checked
        against its stage."""
        found, trainer, states = checkpoint.read(path, self._identity(), list(self.stages))
        problems = [p for r in self.runners for p in checkpoint.check_state(states[r.index], r.state_dict())]
        if problems:
            raise checkpoint.CheckpointError(f"checkpoint {str(found)!r} does not fit this trainer: "
                                             + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
                                             + ". Load it into a trainer built as the one that saved it")
        return found, trainer, states

    def load(self, path: str | os.PathLike) -> Path:
        """Restore the newest complete checkpoint under ``path`` (or the checkpoint directory ``path``) written
        by :meth:`save` under any runtime for the same model and plan; the directory it was read from.

        Everything is checked first, on every process (the identity of model, plan, heads and optimizer
        class; every tensor's name, shape and dtype; files against their digests): on any error every
        process raises :class:`~.checkpoint.CheckpointError` and no state has changed. The batch count is
        restored too, so the stages' random streams continue where they stopped; a checkpoint saved with
        another ``seed`` loads with a warning (training continues on other streams).
        """
        self.finish()
        found, trainer, states = self._agree("read the checkpoint", lambda: self._read(path))
        for r in self._runtime.runners:
            r.load_state_dict(states[r.index])
        self.batches = int(trainer["batches"])
        if "seed" in trainer and trainer["seed"] != self.seed:
            warnings.warn(f"checkpoint {str(path)!r} was trained with seed={trainer['seed']!r}; this trainer has "
                          f"seed={self.seed!r}, so dropout and other training randomness continue on other "
                          f"streams than an uninterrupted run (build the trainer with seed={trainer['seed']!r} "
                          f"to continue it exactly)", stacklevel=2)
        self._runtime.barrier()
        return found

    def close(self) -> None:
        """Finish pending batches, then release worker threads or the process group; the compiled pipeline
        may then get another trainer. After a :class:`StageError` (already raised) or a KeyboardInterrupt it only
        releases."""
        try:
            if not self._runtime.stopped:
                self.finish()
        finally:
            self._release()

    def _release(self) -> None:
        self._runtime.close()
        self.closed = True

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._release()

    def __repr__(self) -> str:
        return (f"Trainer({self.plan.model}, runtime={self.runtime_name!r}, stages here={list(self.stages)}, "
                f"batches={self.batches})")


def _claim(lowered: Lowered) -> None:
    """Refuse a second trainer of the same modules while the first is open: both would train the same
    parameters at once."""
    ref = _TRAINERS.get(lowered)
    other = ref() if ref is not None else None
    if other is not None and not other.closed:
        raise PPLLError(f"this compiled pipeline already has an open trainer ({other!r}); two would train the same "
                        f"parameters at once. Close it first (trainer.close(), or use it in a with block), or "
                        f"compile the model again for an independent pipeline")


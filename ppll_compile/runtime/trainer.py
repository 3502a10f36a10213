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

from ..errors import CutError, PPLLError, StageError
from ..lowered import Lowered
from ..plan import Plan
from ..timeline import Recorder, Timeline
from . import checkpoint
from .base import Losses, Runtime, progress_bar
from .config import TrainConfig, optimizer_mismatch
from .distributed import DistributedRuntime
from .dna import DNA_RUNTIMES, DNAPerBlockRuntime
from .inputs import batch_message, loader_pair
from .messages import EVAL, TRAIN, Message
from .runner import Runner
from .momentum import link_local
from .rebalance import (REBALANCE_STEPS, REBALANCE_THRESHOLD, Move, StateSnapshot, carry_state, check_rebalance,
                        choose_move, head_seed, median_seconds)
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
    runners = _runners(plan, lowered, config, range(k))
    link_local(runners, lowered)
    if name == "sequential":
        return SequentialRuntime(runners)
    share = threads_per_stage or max(1, (os.cpu_count() or 1) // k)
    return ThreadsRuntime(runners, depth=depth, queue=queue, threads_per_stage=share, decoupled=decoupled)


def _runners(plan: Plan, lowered: Lowered, config: TrainConfig, indices: Sequence[int]) -> list[Runner]:
    """Runners for the stages ``indices`` of ``plan``, each on its device (one process, no replicas)."""
    return make_runners(plan, lowered, config, indices, [torch.device(plan.devices[i]) for i in indices])


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

    ``rebalance=True`` (runtimes ``sequential`` and ``threads``, ``ppll`` plans): every stage measures its own work per
    step (forward, backward, optimizer step; not its waiting) over the first ``rebalance_steps`` batches (default 20);
    then, between two batches, the trainer estimates from the medians whether moving one cut to a neighbouring legal
    cut makes the slowest stage faster by more than ``rebalance_threshold`` (default 0.1, i.e. 10%) and if so moves
    it (see :mod:`.rebalance`), then measures again; it stops at the first check that moves nothing.
    A move drains the pipeline first (every batch fed goes through every stage with the old cuts, so FIFO runs stay the
    sequential computation), re-splits the two stages beside the cut (the model's own parameter objects, each with its
    optimizer state), builds the head at the new cut from the policy (``rebalance_policy``, else the plan's) with a
    generator seeded by (``seed``, batch), and keeps every other head, stage and optimizer. :attr:`plan` is then
    the new plan (and the compiled pipeline's too); :attr:`rebalances` lists the moves. :meth:`replan` and
    :meth:`move_cut` make a move when asked, under either runtime, with or without ``rebalance``: a sequential run that
    moves the cut a threads run moved, before the same batch, is the same computation. ``replanner`` (set by
    :meth:`~ppll_compile.pipeline.CompiledPipeline.trainer`) plans and splits the model for a move.

    The optimizers the factory builds are compared with the plan's ``optimizer``: one that keeps another number of
    state tensors per parameter (SGD 0, with momentum 1, Adam 2) warns once, with every stage's optimizer-state memory
    against the plan's and the way out.
    """

    def __init__(self, plan: Plan, lowered: Lowered, *,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 runtime: str = "sequential", loss: Callable[[Any, Tensor], Tensor] | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 clip_grad_norm: float | None = None, autocast: Any = None, queue_depth: int = 2,
                 queue: str = "fifo", nan_check: bool = False, threads_per_stage: int | None = None,
                 timeout: float = 300.0, decoupled: bool = True, trace: bool = False, seed: int | None = 0,
                 schedule_reused: bool = False, rebalance: bool = False, rebalance_steps: int = REBALANCE_STEPS,
                 rebalance_threshold: float = REBALANCE_THRESHOLD, rebalance_policy: Any = None,
                 replanner: Any = None) -> None:
        _check_options(plan, runtime=runtime, queue=queue, optimizer=optimizer, queue_depth=queue_depth, loss=loss,
                       decoupled=decoupled, trace=trace, seed=seed)
        self._rebalance = check_rebalance(rebalance, rebalance_steps, rebalance_threshold, rebalance_policy,
                                          runtime=runtime, plan=plan)
        if self._rebalance is not None:
            if replanner is None:
                raise ValueError("rebalance=True re-splits the compiled pipeline's model; build the trainer with "
                                 "compiled.trainer(..., rebalance=True)")
            replanner.check()
        self._replanner = replanner
        self.plan = plan
        self.lowered = lowered
        """The modules this trainer trains, shared with the compiled pipeline."""
        self.runtime_name = runtime
        config = TrainConfig(optimizer=optimizer, scheduler=scheduler, loss=loss, clip_grad_norm=clip_grad_norm,
                             autocast=_autocast(autocast, plan.num_stages), nan_check=nan_check, seed=seed,
                             schedule_reused=bool(schedule_reused))
        self._config = config
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
        self.rebalances: list[Move] = []
        """The cuts moved so far (``rebalance=True``, :meth:`replan`): batch, old and new cuts, measured times."""
        self.stage_times: tuple[float | None, ...] | None = None
        """Median measured seconds of every stage's step at the last rebalancing check (``None`` before one)."""
        self._next_check: int | None = None
        self._visited: set[tuple[str, ...]] = {plan.cuts}
        if self._rebalance is not None:
            self._watch(self.batches + self._rebalance.steps)
        mismatch = optimizer_mismatch(plan.optimizer, [(r.index, plan.stages[r.index].grad_bytes, r.optimizers[0])
                                                       for r in self.runners if r.optimizers])
        if mismatch is not None:
            warnings.warn(mismatch, stacklevel=3)  # the caller of compiled.trainer(...)

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

    def replan(self, split_points: Sequence[str]) -> Plan:
        """Move the cuts to ``split_points`` (legal cuts of the plan by node name, one per cut, in order) before the
        next batch; the new plan (also :attr:`plan`). Pending batches finish first with the old cuts.

        Stages whose two cuts stay and heads at cuts that stay keep their modules, optimizers and state; the stages
        beside a moved cut are split afresh (the model's own parameter objects), every parameter's optimizer state
        moved with it, their learning rates, schedulers and counters kept; a new cut's head is the policy's, built
        with a generator seeded by (``seed``, batch). Under ``sequential`` and ``threads`` only.
        """
        cuts = self._checked_cuts(split_points)
        if cuts != self.plan.cuts:
            self._move(cuts, times=None, estimated=None)
        return self.plan

    def move_cut(self, stage: int, cut: str) -> Plan:
        """Move the cut after stage ``stage`` (where stage ``stage`` ends and ``stage + 1`` begins) to the legal cut
        ``cut`` (a node name) before the next batch; the new plan. See :meth:`replan`."""
        last = self.plan.num_stages - 2
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= last:
            raise ValueError(f"stage must be the index of a stage followed by a cut, 0..{last} (the cut after stage i "
                             f"ends it), got {stage!r}")
        cuts = list(self.plan.cuts)
        cuts[stage] = cut
        return self.replan(cuts)

    def _checked_cuts(self, split_points: Sequence[str]) -> tuple[str, ...]:
        """``split_points`` as the plan's cuts, checked (legal, one per cut, in graph order), if this trainer can move
        cuts."""
        why = None
        if self.plan.mode != "ppll":
            why = "a pipebd plan's stages are distillation blocks; re-plan it with blocks=... instead"
        elif self.runtime_name not in ("sequential", "threads"):
            why = (f"under runtime={self.runtime_name!r} every stage is another process; move cuts under 'sequential' "
                   f"or 'threads', or compile again with split_points=[...]")
        elif self._replanner is None:
            why = "it was not built by a compiled pipeline; use compiled.trainer(...)"
        if why is not None:
            raise PPLLError(f"this trainer cannot move cuts: {why}")
        self._replanner.check()  # type: ignore[union-attr]
        if isinstance(split_points, str) or not isinstance(split_points, Sequence):
            raise TypeError(f"split_points must be a list of cut names, one per cut, got {split_points!r}")
        legal = self.plan.legal_cuts
        if len(split_points) != len(self.plan.cuts):
            raise ValueError(f"split_points lists {len(split_points)} cut(s), but the plan has {self.plan.num_stages} "
                             f"stages, so {len(self.plan.cuts)} cut(s) {list(self.plan.cuts)}; a move keeps the "
                             f"number of stages (compile again for another number)")
        for c in split_points:
            if c not in legal:
                raise CutError(f"{c!r} is not a legal cut of the plan; its legal cuts, in graph order: "
                               f"{', '.join(map(repr, legal))}")
        at = [legal.index(c) for c in split_points]
        if any(b <= a for a, b in zip(at, at[1:])):
            raise CutError(f"split_points {list(split_points)} are not in graph order, or name a cut twice; the legal "
                           f"cuts, in order: {', '.join(map(repr, legal))}")
        return tuple(split_points)

    def _watch(self, until: int | None) -> None:
        """Measure every stage's steps until batch ``until`` (``None``: stop measuring)."""
        self._next_check = until
        for r in self.runners:
            r.step_times = [] if until is not None else None

    def _rebalance_due(self) -> None:
        """Between two batches: the rebalancing check, once its steps are measured."""
        if self._next_check is not None and self.batches >= self._next_check:
            self._check()

    def _check(self) -> None:
        """Drain, estimate the best move of one cut from the measured stage times, and make it if it is worth it."""
        assert self._rebalance is not None and self._replanner is not None
        self._runtime.drain()  # type: ignore[attr-defined]
        times = tuple(median_seconds(r.step_times) for r in self.runners)
        self.stage_times = times
        if any(t is None for t in times):  # a stage trained on nothing yet ("latest" queues): measure again
            self._watch(self.batches + self._rebalance.steps)
            return

        def candidate(cuts: tuple[str, ...]) -> Plan | None:
            if cuts in self._visited:
                return None
            try:
                return self._replanner.candidate(cuts)
            except (PPLLError, ValueError) as e:  # over the memory limit, or the head cannot be built
                warnings.warn(f"rebalancing does not consider cuts {list(cuts)}: {e}", stacklevel=2)
                return None

        choice = choose_move(times, self.plan, self._rebalance.threshold, candidate)  # type: ignore[arg-type]
        if choice is None:
            self._watch(None)
            return
        cuts, estimated = choice
        self._move(cuts, times=times, estimated=tuple(estimated))  # type: ignore[arg-type]
        self._watch(self.batches + self._rebalance.steps)

    def _move(self, cuts: tuple[str, ...], *, times: tuple[float, ...] | None,
              estimated: tuple[float, ...] | None) -> None:
        """Drain, re-split at ``cuts``, give the re-built stages the state of the ones they replace, go on."""
        rt = self._runtime
        rt.drain()  # type: ignore[attr-defined]
        old_plan, old_lowered, runners = self.plan, self.lowered, list(self.runners)
        snapshot = StateSnapshot.of(runners)
        moved = ", ".join(f"the cut after {a!r} to {b!r}" for a, b in zip(old_plan.cuts, cuts) if a != b)
        how = "measured" if times is not None else "asked"
        plan, lowered = self._replanner.recut(  # type: ignore[union-attr]
            cuts, seed=head_seed(self.seed, self.batches),
            note=f"rebalanced before batch {self.batches} ({how}): moved {moved}")
        changed = [j for j in range(plan.num_stages)
                   if lowered.modules[j] is not old_lowered.modules[j] or lowered.heads[j] is not old_lowered.heads[j]]
        fresh = _runners(plan, lowered, self._config, changed)
        carry_state(snapshot, fresh)
        for j, r in zip(changed, fresh):
            r.step_times = runners[j].step_times
            runners[j] = r
        needs = [bool(getattr(h, "needs_input", False)) for h in lowered.heads]
        for j, r in enumerate(runners):
            r.plan, r.carry_raw = plan.stages[j], any(needs[j + 1:])
        rt.replace_runners(runners)  # type: ignore[attr-defined]
        lowered.train()
        _TRAINERS.pop(old_lowered, None)
        _TRAINERS[lowered] = weakref.ref(self)
        self.plan, self.lowered, self._carry_raw = plan, lowered, lowered.carries_input
        self._visited.add(cuts)
        self.rebalances.append(Move(batch=self.batches, old_cuts=old_plan.cuts, new_cuts=cuts, times=times,
                                    estimated=estimated))

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
        self._rebalance_due()
        msg = self._message(inputs, target, TRAIN) if self.reads_data else None
        return self._runtime.step(msg)

    def finish(self) -> Losses:
        """Wait until every batch fed in has gone through every stage; the losses not returned yet."""
        return self._runtime.finish()

    def _messages(self, loader: Iterable[Any], kind: str) -> Iterable[Message] | None:
        if not self.reads_data:
            return None
        if kind == TRAIN and self._next_check is not None:
            return self._checked_messages(loader)
        return (self._message(*loader_pair(item), kind) for item in loader)

    def _checked_messages(self, loader: Iterable[Any]) -> Iterable[Message]:
        """Training messages, the rebalancing check run before each (between two batches)."""
        for item in loader:
            self._rebalance_due()
            yield self._message(*loader_pair(item), TRAIN)

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


"""The trainer: one training-loop API over every registered runtime (sequential, threads, distributed, the DNA
baselines); checkpoints and moved cuts are delegated to a :class:`.checkpointer.Checkpointer` and a
:class:`.rebalancer.Rebalancer`, the loops over a loader (``fit``, ``evaluate``) live in :class:`.loops.DataLoops`."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..allocator import keep_freed_memory
from ..errors import PPLLError
from ..lower.stages import Lowered
from ..plans.plan import Plan
from ..plans.timeline import Recorder, Timeline
from .base import Losses, Runtime, RuntimeSetup
from .checkpoint.checkpointer import Checkpointer
from .checkpoint.model_state import ModelState
from .config import TrainConfig, optimizer_mismatch
from .inputs import batch_message
from .loops import DataLoops
from .messages import TRAIN, Message
from .rebalance import REBALANCE_STEPS, REBALANCE_THRESHOLD, Move, Replanning, check_rebalance
from .rebalancer import Rebalancer
from .registry import autocast_per_stage, aux_loss_per_head, check_options, check_pure
from .runner import Runner

_TRAINERS: weakref.WeakKeyDictionary[Lowered, tuple[weakref.ref[Trainer], weakref.ref[Runtime]]] = \
    weakref.WeakKeyDictionary()
"""The last trainer built on each compiled pipeline's modules (one may be open at a time), and its runtime (alive
while a worker thread of it runs, even once the trainer is gone)."""
_WARN_AFTER = 1.0
"""Seconds a new trainer waits for a previous one's worker threads before it warns that it is waiting."""


class Trainer(DataLoops, ModelState):
    """Trains a compiled pipeline by local learning, or a student by blockwise distillation (a ``pipebd``
    plan); build it with :meth:`CompiledPipeline.trainer`.

    ``step(inputs, target)`` feeds one batch and returns, per stage, the losses of the batches that stage
    finished since the last call; ``finish()`` drains the pipeline. The model is trained in place, except under
    ``distributed``: there each process's ``model`` is up to date for its own :attr:`stages` only, and
    :meth:`model_state_dict` (the whole trained model, on rank 0) and :meth:`save_model` gather every stage's.
    ``loss=fn(output, target)``: the last stage's loss (default: the task's); ``aux_loss=fn(scores, target)`` (or one
    per auxiliary head, ``None``: the task's): every head's. The task's rule: :func:`~ppll_compile.heads.build.task_loss`.
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

    ``rebalance=True`` (runtimes that can move cuts: ``sequential``, ``threads``; ``ppll`` plans): every stage measures
    its own work per step (forward, backward, optimizer step; not its waiting) over the first ``rebalance_steps``
    batches (default 20); then, between two batches, a cut moves to a neighbouring legal cut when the medians say that
    makes the slowest stage faster by more than ``rebalance_threshold`` (default 0.1, i.e. 10%; see :mod:`.rebalance`),
    and the stages are measured again, until a check moves nothing. :meth:`replan` and :meth:`move_cut` move cuts when
    asked, with or without ``rebalance``; how a move keeps the computation and every parameter's state:
    :mod:`.rebalancer`. :attr:`plan` is then the new plan (the compiled pipeline's too); :attr:`rebalances` lists the
    moves. ``replanner`` (set by :meth:`~ppll_compile.pipeline.CompiledPipeline.trainer`) plans and splits the model.

    ``autocast`` follows the plan's precision (``plan(..., precision=...)``, see :mod:`~ppll_compile.plans.precision`): a
    ``bf16`` or ``bf16-pure`` plan trains every stage's forward and loss under ``torch.autocast`` in bfloat16, an
    ``fp16`` one in float16, an ``fp32`` one under none; ``autocast=`` may repeat the plan's dtype, and any other
    value on a low-precision plan is refused (one option: the plan's). On an ``fp32`` plan ``autocast`` (a dtype, or
    one dtype-or-None per stage) runs that dtype anyway, with a warning that the costs are float32's. Under autocast
    the parameters, gradients and optimizer state stay float32 (a ``bf16-pure`` plan's are bfloat16: it refuses
    float32 parameters, naming the first). ``torch.float16``
    gives every stage its own ``torch.amp.GradScaler``: the loss is scaled before backward, the gradients unscaled
    before ``clip_grad_norm``; a step it skips (inf/NaN gradients) does not step the scheduler; its state is saved
    in checkpoints. ``torch.bfloat16`` needs no scaler. ``accumulate=n`` (default 1): every stage adds up the
    gradients of ``n`` consecutive batches it trains on, each loss scaled by ``1/n``, and steps its optimizer and
    scheduler once per ``n`` (with equal batches: one step on their concatenation), the same in every runtime.
    The end of the data (:meth:`finish`, every ``fit`` epoch, and so ``evaluate``) steps a partial group on its
    mean; :meth:`save` inside a group is refused; :attr:`steps` counts batches, :attr:`updates` optimizer steps.
    Moving cuts and ``pipebd`` plans refuse ``accumulate > 1``.

    ``compile_stages=True`` (or torch.compile's keywords) runs every stage under torch.compile: :mod:`.compiled`.
    The loops (:meth:`fit`: ``epochs`` total, ``max_steps``, ``callbacks``, ``evaluate``; :attr:`lr`): :mod:`.loops`.

    The optimizers the factory builds are compared with the plan's ``optimizer``: one that keeps another number of
    state tensors per parameter (SGD 0, with momentum 1, Adam 2) warns once, with every stage's optimizer-state memory
    against the plan's and the way out.
    """

    def __init__(self, plan: Plan, lowered: Lowered, *,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 runtime: str = "sequential", loss: Callable[[Any, Tensor], Tensor] | None = None,
                 aux_loss: Any = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 clip_grad_norm: float | None = None, autocast: Any = None, queue_depth: int = 2,
                 queue: str = "fifo", nan_check: bool = False, threads_per_stage: int | None = None,
                 timeout: float = 300.0, decoupled: bool = True, trace: bool = False, seed: int | None = 0,
                 schedule_reused: bool = False, rebalance: bool = False, rebalance_steps: int = REBALANCE_STEPS,
                 rebalance_threshold: float = REBALANCE_THRESHOLD, rebalance_policy: Any = None,
                 replanner: Replanning | None = None, accumulate: int = 1, compile_stages: Any = False) -> None:
        kind = check_options(plan, runtime=runtime, queue=queue, optimizer=optimizer, queue_depth=queue_depth,
                             loss=loss, decoupled=decoupled, trace=trace, seed=seed, accumulate=accumulate,
                             rebalance=rebalance, threads_per_stage=threads_per_stage, clip_grad_norm=clip_grad_norm,
                             timeout=timeout, compile_stages=compile_stages)
        settings = check_rebalance(rebalance, rebalance_steps, rebalance_threshold, rebalance_policy,
                                   runtime=runtime, kind=kind, plan=plan, replanner=replanner)
        self.plan = plan
        self.lowered = lowered
        """The modules this trainer trains, shared with the compiled pipeline."""
        self.runtime_name = runtime
        config = TrainConfig(optimizer=optimizer, scheduler=scheduler, loss=loss, compile_stages=compile_stages,
                             aux_loss=aux_loss_per_head(aux_loss, plan), clip_grad_norm=clip_grad_norm,
                             autocast=autocast_per_stage(autocast, plan), nan_check=nan_check, seed=seed,
                             schedule_reused=bool(schedule_reused), accumulate=accumulate)
        check_pure(plan, [[(k.removeprefix("module."), p) for k, p in m.named_parameters()]
                          for m in lowered.modules])
        self.accumulate = accumulate
        """Batches per optimizer step of every stage (``accumulate=``)."""
        self._open = 0  # training batches fed since the stages last ended their data (stepped a partial group)
        self.seed = seed
        """Seed of the stages' training randomness (``None``: unseeded); recorded in checkpoints."""
        self._carry_raw = lowered.carries_input
        _check_unclaimed(lowered, timeout)
        lowered.train()
        self._runtime: Runtime = kind.build(RuntimeSetup(
            plan=plan, lowered=lowered, config=config, depth=queue_depth, queue=queue,
            threads_per_stage=threads_per_stage, timeout=timeout, decoupled=decoupled))
        _claim(lowered, self)
        weakref.finalize(self, _abandon, weakref.ref(self._runtime))  # dropped without close(): the workers end too
        self._training = False  # the allocator is set before the first training step (see ppll_compile.allocator)
        self.closed = False
        """Whether :meth:`close` was called (or a ``with`` block ended)."""
        self.batches = 0
        """Batches fed in so far (by this process, under ``distributed`` the first stage's)."""
        self.epoch, self._into_epoch, self.should_stop = 0, 0, False  # see DataLoops
        self.tracing = trace
        """Whether the stages record their spans (``trace=True``)."""
        if trace:
            for r in self.runners:
                r.recorder = Recorder(r.index, self._runtime.replica, r.device)
        self._checkpoints = Checkpointer(self._runtime)
        self._rebalancer = Rebalancer(self._runtime, config, name=runtime, plan=plan, settings=settings,
                                      replanner=replanner)
        _warn_optimizer_mismatch(plan, self.runners)

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
        """Batches trained on per stage run here (the optimizer steps too with ``accumulate=1``; see :attr:`updates`)."""
        return {r.index: r.steps for r in self.runners}

    @property
    def updates(self) -> dict[int, int]:
        """Optimizer steps per stage run here (one per ``accumulate`` batches; see :attr:`.Runner.updates`)."""
        return {r.index: r.updates for r in self.runners}

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

    @property
    def rebalances(self) -> list[Move]:
        """The cuts moved so far (``rebalance=True``, :meth:`replan`): batch, old and new cuts, measured times."""
        return self._rebalancer.rebalances

    @property
    def stage_times(self) -> tuple[float | None, ...] | None:
        """Median measured seconds of every stage's step at the last rebalancing check (``None`` before one)."""
        return self._rebalancer.stage_times

    def replan(self, split_points: Sequence[str]) -> Plan:
        """Move the cuts to ``split_points`` (legal cuts of the plan by node name, one per cut, in order) before the
        next batch; the new plan (also :attr:`plan`). Pending batches finish first with the old cuts.

        Only the stages beside a moved cut are split afresh, every parameter keeping its optimizer state; a new cut's
        head is seeded by (``seed``, batch) (see :mod:`.rebalancer`). Under ``sequential`` and ``threads`` only.
        """
        self._adopt(self._rebalancer.replan(self.plan, self.lowered, split_points, self.batches))
        return self.plan

    def move_cut(self, stage: int, cut: str) -> Plan:
        """Move the cut after stage ``stage`` (where stage ``stage`` ends and ``stage + 1`` begins) to the legal cut
        ``cut`` (a node name) before the next batch; the new plan. See :meth:`replan`."""
        self._adopt(self._rebalancer.move_cut(self.plan, self.lowered, stage, cut, self.batches))
        return self.plan

    def _adopt(self, moved: tuple[Plan, Lowered] | None) -> None:
        """Train the plan and modules a moved cut gave (``None``: nothing moved) from the next batch on."""
        if moved is None:
            return
        plan, lowered = moved
        lowered.train()
        _claim(lowered, self, given_up=self.lowered)
        self.plan, self.lowered, self._carry_raw = plan, lowered, lowered.carries_input

    def _start_training(self) -> None:
        """Before the first training step of any runtime: freed memory stays in the process for the next step."""
        if not self._training:
            keep_freed_memory()
            self._training = True

    def _message(self, inputs: Any, target: Any, kind: str) -> Message:
        msg = batch_message(self.plan, self.lowered, inputs, target, index=self.batches, kind=kind,
                            carry_raw=self._carry_raw)
        if kind == TRAIN:
            self.batches += 1
            self._open += 1
        return msg

    def step(self, inputs: Any = None, target: Any = None) -> Losses:
        """Train on one batch; per stage, the losses of the batches it finished since the last call.

        ``inputs`` is the model's input (a tensor, a tuple of positional inputs or a dict of keyword inputs).
        Under ``distributed`` only the first stage's rank reads them; the other ranks may pass ``None``.
        The result is a :class:`~.base.Losses` (a list per stage), its ``.sizes`` the batch size of every loss.
        """
        self._adopt(self._rebalancer.between_batches(self.plan, self.lowered, self.batches))
        msg = self._message(inputs, target, TRAIN) if self.reads_data else None
        self._start_training()
        return Losses.of(self._runtime.step(msg), msg.size if msg is not None else None, self.stages[0])

    def finish(self) -> Losses:
        """Wait until every batch fed in has gone through every stage; the losses not returned yet. With
        ``accumulate > 1`` this is the end of the data: every stage steps on its partial accumulation group."""
        self._open = 0
        return Losses.of(self._runtime.finish())

    def timeline(self) -> Timeline:
        """The spans every stage recorded so far (``trace=True``), from 0 at the earliest; ``.save(path)`` writes
        them as a Chrome trace file for ``ppll-plan --gantt`` or Perfetto. Under ``distributed`` it gathers the spans
        of every process, so every process must call it."""
        if not self.tracing:
            raise PPLLError("this trainer records no timeline; build it with compiled.trainer(..., trace=True)")
        mine = [e for r in self.runners if r.recorder is not None for e in r.recorder.events]
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
        manifest records the batch count and the trainer's ``seed``. A save inside an accumulation group
        (``accumulate=``) raises :class:`~ppll_compile.PPLLError`, saving nothing: :meth:`finish` first.
        """
        return self._checkpoints.save(path, keep, plan=self.plan, lowered=self.lowered, fed=self._open,
                                      trainer={"batches": self.batches, "seed": self.seed})

    def load(self, path: str | os.PathLike) -> Path:
        """Restore the newest complete checkpoint under ``path`` (or the checkpoint directory ``path``) written
        by :meth:`save` under any runtime for the same model and plan; the directory it was read from.

        Everything is checked first, on every process (the identity of model, plan, heads and optimizer
        class; every tensor's name, shape and dtype; files against their digests): on any error every
        process raises :class:`~.checkpoint.CheckpointError` and no state has changed. The batch count is
        restored too, so the stages' random streams continue where they stopped; a checkpoint saved with
        another ``seed`` loads with a warning (training continues on other streams). The optimizers take the
        checkpoint's hyperparameters (lr, momentum, ...); one warning names each that differs from the factory's.
        """
        found, self.batches = self._checkpoints.load(path, plan=self.plan, lowered=self.lowered, seed=self.seed)
        self._open = 0
        return found

    def close(self) -> None:
        """Finish pending batches, then release worker threads or the process group; the compiled pipeline may then
        get another trainer. After a :class:`StageError` (already raised) or a KeyboardInterrupt it only releases: a
        worker still inside a stage's forward is cancelled (it never steps), and a new trainer waits up to its
        ``timeout=`` seconds for it to end, else refuses."""
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


def _warn_optimizer_mismatch(plan: Plan, runners: list[Runner]) -> None:
    """Warn when the optimizers the factory built keep another number of state tensors than the plan costed."""
    mismatch = optimizer_mismatch(plan.optimizer, [(r.index, plan.stages[r.index].grad_bytes, r.optimizers[0])
                                                   for r in runners if r.optimizers])
    if mismatch is not None:
        warnings.warn(mismatch, stacklevel=4)  # the caller of compiled.trainer(...)


def _abandon(runtime: weakref.ref[Runtime]) -> None:
    """A trainer was dropped without ``close()``: its runtime, if a worker thread still holds it, stops and cancels
    its stages. Only a weak reference is kept, so that a runtime holding its trainer (a stored error's traceback)
    does not keep both alive for ever."""
    alive = runtime()
    if alive is not None:
        alive.abandon()


def _claim(lowered: Lowered, trainer: Trainer, given_up: Lowered | None = None) -> None:
    """Make ``trainer`` the one trainer of ``lowered`` (and of ``given_up`` no more: a moved cut's old modules)."""
    if given_up is not None:
        _TRAINERS.pop(given_up, None)
    _TRAINERS[lowered] = (weakref.ref(trainer), weakref.ref(trainer._runtime))


def _check_unclaimed(lowered: Lowered, timeout: float) -> None:
    """Refuse a second trainer of the same modules while the first is open: both would train the same
    parameters at once. Once it is closed or dropped, wait up to ``timeout`` seconds for the worker threads it left
    inside a stage's own code (a forward that waits or hangs) to end, and refuse if one still runs."""
    claim = _TRAINERS.get(lowered)
    if claim is None:
        return
    other, runtime = claim[0](), claim[1]()
    if other is not None and not other.closed:
        raise PPLLError(f"this compiled pipeline already has an open trainer ({other!r}); two would train the same "
                        f"parameters at once. Close it first (trainer.close(), or use it in a with block), or "
                        f"compile the model again for an independent pipeline")
    running = runtime.wait_stopped(min(timeout, _WARN_AFTER)) if runtime is not None else []
    if running and timeout > _WARN_AFTER:
        warnings.warn(f"{_still_running(running)}; waiting up to {timeout:g} s (timeout=) for it to end before "
                      f"building the new trainer", stacklevel=4)
        running = runtime.wait_stopped(timeout - _WARN_AFTER)  # type: ignore[union-attr]
    if running:
        raise PPLLError(f"{_still_running(running)} after {timeout:g} s: it is inside the stage's own code (a forward "
                        f"that waits or hangs), which cannot be interrupted. Closing that trainer cancelled it, so it "
                        f"will never step again, but it "
                        f"would still run the stage's modules beside the new trainer's. Make that code return, or "
                        f"build the trainer with a longer timeout= (the seconds it waits), or restart the process "
                        f"(and load the last checkpoint there)")


def _still_running(stages: list[int]) -> str:
    """Which worker threads of the previous trainer still run (``stages``: their stage indices)."""
    if len(stages) == 1:
        return f"stage {stages[0]}'s worker thread of this compiled pipeline's previous trainer is still running"
    names = f"{', '.join(map(str, stages[:-1]))} and {stages[-1]}"
    return f"the worker threads of stages {names} of this compiled pipeline's previous trainer are still running"


"""``Runner``: what every kind of stage shares (device, messages, autocast, randomness, counters, checkpoints); its
optimizers, schedulers and steps are :class:`~.updates.GradientUpdates`'s."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import PPLLError
from ..lower.stages import Stage, move
from ..plans.plan import StagePlan
from ..plans.timeline import Recorder, span
from .compiled import StageCompiler, backward_error, raised_by_compiler, stage_compiler
from .config import TrainConfig
from .messages import Message, dtype_of
from .rng import StageRNG, stream_seed
from .updates import GradientUpdates


def _check_output(out: Any) -> None:
    """``nan_check=True``: raise before a stage sends an output holding NaN or infinity on (the stage that made it
    fails, not the next one, which early forwarding would let get there first)."""
    values = out if isinstance(out, (tuple, list)) else (out,)
    for k, v in enumerate(values):
        if isinstance(v, Tensor) and v.is_floating_point() and not bool(torch.isfinite(v.detach()).all()):
            what = "nan" if bool(torch.isnan(v.detach()).any()) else "inf"
            which = "output" if len(values) == 1 else f"output {k}"
            raise FloatingPointError(f"{which} holds {what} (nan_check=True); lower the learning rate, clip "
                                     f"gradients (clip_grad_norm=...) or check the data")


class StageCancelled(PPLLError):
    """Raised by a stage whose trainer was closed, interrupted or dropped (:attr:`Runner.cancelled`) when it would
    touch its parameters again: a worker thread still inside that stage's forward ends there, without a step."""


class Runner(GradientUpdates):
    """What every kind of stage shares: its device, autocast, messages, randomness and counters, and (from
    :class:`~.updates.GradientUpdates`) its optimizers, schedulers and gradient updates.

    A replicated stage (``plan.replicas > 1``) runs under DDP in its replica ``group``; each replica
    trains on a slice of the batch, its loss scaled so that the all-reduced gradient is the whole batch's.
    Subclasses set ``index`` and ``plan``, call :meth:`_setup`, and define :meth:`modules`, :meth:`_forward`,
    ``eval_step``, :meth:`_state` and :meth:`_load`.

    A training forward draws its randomness (dropout, drop-path) from torch's default generators seeded by
    :func:`~.rng.stream_seed` of (``config.seed``, stage, batch index, reuse, replica): see :meth:`randomness`.
    """

    index: int
    plan: StagePlan
    carry_raw: bool = False
    """Whether the message sent on keeps the raw input (a later head needs it)."""
    recorder: Recorder | None = None
    """Where the stage's spans go when the trainer traces (``trace=True``)."""
    replica: int = 0
    """Which replica of its stage this runner is (distributed runtime; the rank under ``dna``): seeds its stream."""
    copy_sent: bool = False
    """Send copies of the output tensors: the next stage runs in this process while this one's backward may still
    read them (early forwarding), and it may write into its input (an in-place ReLU after the cut)."""
    take_weights: Callable[[], list[Tensor] | None] | None = None
    """Set on a stage with a momentum head: the next stage's newest published weights, if new (see :mod:`.momentum`)."""
    publish_weights: Callable[[], None] | None = None
    """Set on a stage whose predecessor has a momentum head: publish the weights it follows."""
    publish_every: int = 1
    """Optimizer steps between two calls of :attr:`publish_weights`."""
    before_step: Callable[[], None] | None = None
    """Called after every backward, before the optimizer steps (``decoupled=False``: a barrier over the stages)."""
    step_times: list[float] | None = None
    """When a list (the trainer sets one while it rebalances), :meth:`train_step` appends the seconds of each training
    step's own work: forward, loss, backward and optimizer step, from the received input to the stepped parameters.
    Waiting is left out: for the input, for the seeded-randomness lock, at a ``decoupled=False`` barrier. On a CPU the
    seconds are the stage thread's CPU time (``time.thread_time``: under ``threads``, a stage waiting for the
    interpreter lock or for a core is not working); on a CUDA device they are wall-clock seconds between two
    synchronisations of the stage's stream, less the waits; elsewhere wall-clock seconds less the waits."""
    cancelled: bool = False
    """Set when the stage's trainer is closed, interrupted (Ctrl-C) or dropped: from then on the stage never changes
    its parameters, gradients, optimizers or schedulers again (a worker thread still inside its forward raises
    :class:`StageCancelled` before its backward or step), so a late step cannot overwrite what a new trainer
    trains or loads."""
    _waited: float = 0.0

    def check_live(self) -> None:
        """Raise :class:`StageCancelled` once the stage is :attr:`cancelled`; called right before every gradient
        accumulation (backward), optimizer step, scheduler step and momentum pull."""
        if self.cancelled:
            raise StageCancelled(f"stage {self.index} belongs to a trainer that was closed, interrupted or dropped: it "
                                 f"no longer trains; build a new trainer (and load a checkpoint) to go on training")

    def _setup(self, *, device: torch.device, config: TrainConfig, groups: list[list[nn.Parameter]],
               trainable: nn.Module, group: Any) -> None:
        self.device = device
        self.config = config
        self.params = [p for g in groups for p in g]
        if not self.params:
            raise PPLLError(f"stage {self.index} has no parameters to train; compile with fewer stages "
                            f"or other split points")
        dtype = config.autocast[self.index] if config.autocast else None
        self._setup_updates(config, groups, device, dtype)
        self.steps = 0
        """Batches trained on (reused inputs included); with ``accumulate=1`` also the optimizer steps."""
        self.reused = 0
        """Inputs trained on again because no new one had arrived (``queue="reuse"``)."""
        self.dropped = 0
        """Inputs that arrived and were never trained on, because a newer one had arrived (``queue="latest"``)."""
        self._autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None \
            else contextlib.nullcontext
        self._out_dtypes = tuple(dtype_of(t) for t in self.plan.boundary)
        self._net: nn.Module = trainable
        self._rng = StageRNG(device)
        self.compiler: StageCompiler | None = stage_compiler(self.index, self._named_modules(), device,
                                                             config.compile_stages)
        """The compiled forwards of the stage's modules (``compile_stages``), or ``None`` (eager)."""
        if group is not None:
            self._net = DistributedDataParallel(trainable, process_group=group,
                                                device_ids=[device] if device.type == "cuda" else None)

    @property
    def is_last(self) -> bool:
        """Whether this is the pipeline's last stage (it sends nothing on)."""
        return self.plan.is_last

    def modules(self) -> list[nn.Module]:
        """The modules this stage trains (their train/eval mode follows the trainer's)."""
        raise NotImplementedError

    def train_mode(self, mode: bool) -> None:
        """Put this stage's trained modules in training (``True``) or eval mode."""
        for m in self.modules():
            m.train(mode)

    @property
    def draws_random(self) -> bool | None:
        """Whether this stage's training forward draws random numbers (then it runs seeded, under the RNG lock).

        ``None`` until its first training forward, which runs seeded and locked to find out (always
        ``None`` with ``seed=None``).
        """
        return self._rng.draws_random

    def randomness(self, msg: Message) -> contextlib.AbstractContextManager:
        """The context of a training forward on ``msg``: torch's default generators seeded for this stage.

        The seed is :func:`~.rng.stream_seed` of the trainer's ``seed``, the stage, the batch index
        (``msg.index``), whether the input is a reused one, and the replica; the caller's generator states
        are restored afterwards. A no-op with ``seed=None`` or once the stage is known to draw nothing.
        """
        if self.config.seed is None or self._rng.draws_random is False:
            return contextlib.nullcontext()
        return self._rng.seeded(stream_seed(self.config.seed, self.index, msg.index, reused=msg.reused,
                                            replica=self.replica))

    def _named_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules this stage trains, each with what an error calls it (block, student block k, head)."""
        def what(m: nn.Module) -> str:
            if not isinstance(m, Stage):
                return "auxiliary head"
            return f"student block {m.index}" if self.plan.blocks else "block"
        return [(what(m), m) for m in self.modules()]

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context every forward of this stage (training, :meth:`forward_loss`, evaluation) runs under: autocast
        (a no-op unless the trainer has ``autocast=``) and, with ``compile_stages``, the stage's modules compiled."""
        with self._autocast(), (self.compiler.active() if self.compiler is not None else contextlib.nullcontext()):
            yield

    def _receive(self, msg: Message) -> tuple[tuple[Any, ...], Any, Tensor | None]:
        if msg.events:  # produced on another stage's CUDA stream (threads runtime)
            stream = torch.cuda.current_stream(self.device)
            tensors = [v for v in (*msg.values, msg.target, msg.raw) if isinstance(v, Tensor) and v.is_cuda]
            if all(t.device == self.device for t in tensors):
                for e in msg.events:
                    stream.wait_event(e)
                for t in tensors:
                    t.record_stream(stream)  # the producer's allocator must not reuse them before we are done
            else:  # a copy from another GPU: wait until the producer's stream has written them
                for e in msg.events:
                    e.synchronize()
        return move(msg.values, self.device), move(msg.target, self.device), move(msg.raw, self.device)

    def _sent(self, v: Any, dtype: torch.dtype | None) -> Any:
        if not isinstance(v, Tensor):
            return v
        # the plan fixes the boundary dtypes (and so the receive buffers); autocast may have changed them
        if dtype is not None and v.dtype != dtype:
            return v.detach().to(dtype)
        return v.detach().clone() if self.copy_sent else v.detach()

    def _send(self, msg: Message, out: tuple[Any, ...], raw: Tensor | None) -> Message:
        values = tuple(self._sent(v, d) for v, d in zip(out, self._out_dtypes))
        events = []
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            events.append(event)
        return Message(index=msg.index, values=values, target=msg.target, kind=msg.kind, events=events,
                       raw=msg.raw if self.carry_raw else None, whole=msg.whole)

    def _forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None,
                 rng: contextlib.AbstractContextManager, ready: Callable[[Any], None] | None = None
                 ) -> tuple[Any, Tensor]:
        """The stage's output (what travels on) and its loss, a mean over the batch; trained modules run in ``rng``.

        ``ready(output)`` is called as soon as the output exists, before the rest of the loss is computed.
        """
        raise NotImplementedError

    def forward_loss(self, msg: Message) -> tuple[Any, Tensor]:
        """The output and local loss of one batch, as :meth:`train_step` computes them, without backward or step.

        Autograd records the forward (its saved activations stay alive while the loss does), so it serves to
        measure what a training step holds; the parameters and counters do not change.
        """
        values, target, raw = self._receive(msg)
        with self.autocast():
            return self._forward(values, target, raw, self.randomness(msg))

    def train_step(self, msg: Message, send: Callable[[Message], None] | None = None
                   ) -> tuple[Message | None, Tensor]:
        """Forward, local loss, backward and optimizer steps on one batch; the message sent on and the loss.

        Early forwarding: the message for the next stage is made (and handed to ``send``) as soon as the
        forward output exists, before the loss's backward and the optimizer step. It holds the same tensors
        it would hold afterwards, so FIFO runs stay the same computation as sequential ones.
        """
        self.check_live()
        if self.take_weights is not None and (weights := self.take_weights()) is not None:
            self.pull(weights)
        values, target, raw = self._receive(msg)
        sent: list[Message] = []

        def ready(out: Any) -> None:
            if not self.is_last:
                if self.config.nan_check:
                    _check_output(out)
                sent.append(self._send(msg, out, raw))
                if send is not None:
                    send(sent[0])

        timed = self.step_times is not None
        start, self._waited = (self._clock() if timed else 0.0), 0.0
        rng = self._unwaited(self.randomness(msg)) if timed else self.randomness(msg)
        with span(self.recorder, "forward", msg.index), self.autocast():
            _, loss = self._forward(values, target, raw, rng, ready)
        stepped = self._update(loss, msg)
        self.steps += 1
        if stepped and self.publish_weights is not None and self.updates % self.publish_every == 0:
            self.publish_weights()
        if timed and self.step_times is not None:
            waited = self._waited if self.device.type != "cpu" else 0.0  # blocked threads take no CPU time
            self.step_times.append(max(0.0, self._clock() - start - waited))
        return (sent[0] if sent else None), loss.detach()

    def _update(self, loss: Tensor, msg: Message) -> bool:
        """Backward of ``loss`` and, at the end of an accumulation group, the optimizer step: whether it stepped. A
        backward that torch.compile (``compile_stages``) fails to compile, at its first call, is named as such."""
        try:
            # a replica's slice: scaled so that DDP's mean over replicas is the whole batch's gradient
            return self.update(loss, msg.size * self.plan.replicas / msg.whole if msg.whole else 1.0,
                               batch=msg.index, schedule=not msg.reused or self.config.schedule_reused)
        except Exception as e:
            if self.compiler is None or not raised_by_compiler(e):
                raise
            raise backward_error(self.index, self.compiler.options, e) from e

    def _clock(self) -> float:
        """The clock of :attr:`step_times`: this thread's CPU seconds on a CPU, else wall-clock seconds once this
        stage's CUDA stream has done the work queued so far."""
        if self.device.type == "cpu":
            return time.thread_time()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def _unwaited(self, context: contextlib.AbstractContextManager) -> Iterator[None]:
        """``context``, the time it takes to enter (the seeded-randomness lock) counted as waiting."""
        start = time.perf_counter()
        with context:
            self._waited += time.perf_counter() - start
            yield

    def pull(self, weights: list[Tensor]) -> None:
        """One EMA step of this stage's momentum head towards the next stage's ``weights``."""
        raise NotImplementedError

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """This stage's modules, optimizers, schedulers and counters, for a checkpoint."""
        return {"stage": self.index, **self._state(), "optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers], "steps": self.steps, "reused": self.reused,
                "dropped": self.dropped, "updates": self.updates} \
            | ({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._load(state)
        for o, sd in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(sd)
        for sch, sd in zip(self.schedulers, state["schedulers"]):
            sch.load_state_dict(sd)
        self.steps = int(state["steps"])
        self.reused = int(state["reused"])
        self.dropped = int(state.get("dropped", 0))  # checkpoints written before the counter existed
        self.updates = int(state.get("updates", self.steps))  # written before accumulate: one step per batch
        self.pending = 0
        if self.scaler is not None and "scaler" in state:  # a checkpoint without one: the scaler starts afresh
            self.scaler.load_state_dict(state["scaler"])


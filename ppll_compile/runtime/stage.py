"""One stage's share of local learning: run the block, take the local loss, step its own optimizer, send on detached."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import PPLLError
from ..heads import head_loss
from ..lowered import Stage, move
from ..plan import StagePlan
from ..timeline import Recorder, span

__all__ = ["Message", "Runner", "StageRunner", "add_counts", "StageError", "TrainConfig", "Recent", "dtype_of",
           "TRAIN",
           "EVAL"]

TRAIN, EVAL = "train", "eval"


class StageError(PPLLError, RuntimeError):
    """A stage raised (or produced a non-finite loss) while the pipeline ran; it names the stage and batch."""

    def __init__(self, stage: int, batch: int | None, message: str, traceback: str = "") -> None:
        at = f" at batch {batch}" if batch is not None else ""
        text = f"stage {stage} failed{at}: {message}"
        if traceback:
            text += f"\n--- traceback of stage {stage} ---\n{traceback.rstrip()}"
        super().__init__(text)
        self.stage = stage
        self.batch = batch
        self.traceback = traceback


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How every stage trains: optimizer and scheduler factories, loss, clipping, autocast, fault checks."""

    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    """``fn(params) -> Optimizer``, called once per stage with that stage's block and head parameters."""
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """``fn(optimizer) -> LRScheduler`` per stage, stepped after every optimizer step of that stage."""
    loss: Callable[[Any, Tensor], Tensor] | None = None
    """Loss of the last stage, ``fn(model_output, target)``; default cross-entropy."""
    clip_grad_norm: float | None = None
    """Clip each stage's gradient norm (block and head together) to this value."""
    autocast: tuple[torch.dtype | None, ...] = ()
    """Autocast dtype per stage (``None`` = full precision); empty = none anywhere."""
    nan_check: bool = False
    """Fail the pipeline when a stage's loss is not finite."""


@dataclass(kw_only=True)
class Message:
    """What travels between stages for one batch: the boundary values, the labels and, when a head needs it, the input."""

    index: int
    """Sequence number of the batch, from 0."""
    values: tuple[Any, ...]
    """The receiving stage's inputs: the model inputs for stage 0, else the previous boundary (detached)."""
    target: Any
    """Labels (or whatever the last stage's loss takes)."""
    raw: Tensor | None = None
    """The model's first input, for heads that reconstruct it (InfoPro); ``None`` when no later head needs it."""
    kind: str = TRAIN
    """``train`` or ``eval``."""
    events: list[Any] = field(default_factory=list)
    """CUDA events the receiver waits on before reading the tensors (threads runtime on GPUs)."""
    whole: int | None = None
    """Rows of the whole batch when this message is one replica's slice of it (distributed runtime)."""

    @property
    def size(self) -> int:
        """Batch size: the first dimension of the target."""
        return int(self.target.shape[0]) if isinstance(self.target, Tensor) and self.target.dim() else 1


class Recent:
    """``queue="latest"``: a stage's two newest inputs, each trained on again at most once when none is waiting."""

    def __init__(self) -> None:
        self._entries: list[list[Any]] = []  # [pristine copy, reused?], newest first

    @staticmethod
    def _copy(m: Message) -> Message:
        # a stage may modify its input in place (a ReLU right after the cut): keep and hand out copies
        return Message(index=m.index, values=tuple(v.clone() if isinstance(v, Tensor) else v for v in m.values),
                       target=m.target, raw=m.raw, kind=m.kind, whole=m.whole)

    def remember(self, msg: Message) -> None:
        """Keep a copy of a new input (call it before the stage runs on ``msg``)."""
        self._entries = [[self._copy(msg), False]] + self._entries[:1]

    def reuse(self) -> Message | None:
        """A copy of the newest, else the second newest, input not yet reused; ``None`` if there is none."""
        for entry in self._entries:
            if not entry[1]:
                entry[1] = True
                return self._copy(entry[0])
        return None

    def clear(self) -> None:
        self._entries = []


def dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype a TensorSpec names, or ``None`` for a Python scalar (``int``, ``float``, ``bool``)."""
    if name in ("int", "float", "bool"):  # getattr(torch, "int") would be torch.int32
        return None
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _detach(v: Any) -> Any:
    return v.detach() if isinstance(v, Tensor) else v


def _finite(loss: Tensor) -> bool:
    return math.isfinite(float(loss))


class _Trainable(nn.Module):
    """The modules a stage trains, as one module that DDP can wrap: ``forward`` gives (output, loss)."""

    def __init__(self, stage: Stage, head: nn.Module | None, loss: Callable[[Any, Tensor], Tensor]) -> None:
        super().__init__()
        self.stage = stage
        self.head = head
        self._loss = loss

    def forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None) -> tuple[Any, Tensor]:
        out = self.stage(*values)
        if self.head is None:
            return out, self._loss(out, target)
        return out, head_loss(self.head, out[0], target, raw)


class Runner:
    """What every kind of stage shares: its device, optimizers, schedulers, autocast, messages and counters.

    A replicated stage (``plan.replicas > 1``) runs under DDP in its replica ``group``; each replica
    trains on a slice of the batch, its loss scaled so that the all-reduced gradient is the whole batch's.
    """

    index: int
    plan: StagePlan
    carry_raw: bool = False
    """Whether the message sent on keeps the raw input (a later head needs it)."""
    recorder: Recorder | None = None
    """Where the stage's spans go when the trainer traces (``trace=True``)."""

    def _setup(self, *, device: torch.device, config: TrainConfig, groups: list[list[nn.Parameter]],
               trainable: nn.Module, group: Any) -> None:
        self.device = device
        self.config = config
        self.params = [p for g in groups for p in g]
        if not self.params:
            raise PPLLError(f"stage {self.index} has no parameters to train; compile with fewer stages "
                            f"or other split points")
        self._groups = groups
        self.optimizers = [config.optimizer(g) for g in groups]
        """One optimizer per independently trained part (a PPLL stage: one; a Pipe-BD stage: one per block)."""
        self.schedulers = [config.scheduler(o) for o in self.optimizers] if config.scheduler is not None else []
        self.steps = 0
        """Optimizer steps taken (batches trained on, reused inputs included)."""
        self.reused = 0
        """Inputs trained on again because no new one had arrived (``queue="latest"``)."""
        dtype = config.autocast[self.index] if config.autocast else None
        self._autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None \
            else contextlib.nullcontext
        self._out_dtypes = tuple(dtype_of(t.dtype) for t in self.plan.boundary)
        self._net: nn.Module = trainable
        if group is not None:
            from torch.nn.parallel import DistributedDataParallel
            self._net = DistributedDataParallel(trainable, process_group=group,
                                                device_ids=[device] if device.type == "cuda" else None)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first (for a PPLL stage the only) optimizer."""
        return self.optimizers[0]

    @property
    def scheduler(self) -> Any:
        return self.schedulers[0] if self.schedulers else None

    @property
    def is_last(self) -> bool:
        return self.plan.is_last

    def modules(self) -> list[nn.Module]:
        raise NotImplementedError

    def train_mode(self, mode: bool) -> None:
        for m in self.modules():
            m.train(mode)

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

    def _send(self, msg: Message, out: tuple[Any, ...], raw: Tensor | None) -> Message:
        # the plan fixes the boundary dtypes (and so the receive buffers); autocast may have changed them
        values = tuple(v.detach().to(d) if isinstance(v, Tensor) and d is not None and v.dtype != d else _detach(v)
                       for v, d in zip(out, self._out_dtypes))
        events = []
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            events.append(event)
        return Message(index=msg.index, values=values, target=msg.target, kind=msg.kind, events=events,
                       raw=msg.raw if self.carry_raw else None, whole=msg.whole)

    def _forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None) -> tuple[Any, Tensor]:
        """The stage's output (what travels on) and its loss, a mean over the batch."""
        raise NotImplementedError

    def train_step(self, msg: Message) -> tuple[Message | None, Tensor]:
        """Forward, local loss, backward and optimizer steps on one batch; the message sent on and the loss."""
        values, target, raw = self._receive(msg)
        with span(self.recorder, "forward", msg.index), self._autocast():
            out, loss = self._forward(values, target, raw)
        # a replica's slice: scaled so that DDP's mean over replicas is the whole batch's gradient
        self.update(loss, msg.size * self.plan.replicas / msg.whole if msg.whole else 1.0, batch=msg.index)
        self.steps += 1
        return (None if self.is_last else self._send(msg, out, raw)), loss.detach()

    def update(self, loss: Tensor, scale: float = 1.0, parts: Sequence[int] | None = None, *,
               batch: int = -1) -> None:
        """Backward ``loss`` times ``scale``, then clip and step the optimizers (and schedulers) of ``parts``.

        ``parts`` indexes :attr:`optimizers` (default: all of them); ``batch`` names the spans when tracing.
        """
        if self.config.nan_check and not _finite(loss):
            raise FloatingPointError(f"loss is {float(loss)} (nan_check=True); lower the learning rate, clip "
                                     f"gradients (clip_grad_norm=...) or check the data")
        parts = range(len(self.optimizers)) if parts is None else parts
        for i in parts:
            self.optimizers[i].zero_grad(set_to_none=True)
        with span(self.recorder, "backward", batch):
            (loss * scale if scale != 1.0 else loss).backward()
        with span(self.recorder, "step", batch):
            for i in parts:
                if self.config.clip_grad_norm is not None:
                    nn.utils.clip_grad_norm_(self._groups[i], self.config.clip_grad_norm)
                self.optimizers[i].step()
                if self.schedulers:
                    self.schedulers[i].step()

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.index, **self._state(), "optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers], "steps": self.steps, "reused": self.reused}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load(state)
        for o, sd in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(sd)
        for sch, sd in zip(self.schedulers, state["schedulers"]):
            sch.load_state_dict(sd)
        self.steps = int(state["steps"])
        self.reused = int(state["reused"])


class StageRunner(Runner):
    """Owns one PPLL stage on one device: its block, aux head (none for the last stage), optimizer and counters."""

    def __init__(self, *, stage: Stage, head: nn.Module | None, plan: StagePlan, device: torch.device,
                 config: TrainConfig, carry_raw: bool, group: Any = None) -> None:
        self.index = stage.index
        self.stage = stage.to(device)
        self.head = head.to(device) if head is not None else None
        self.plan = plan
        self.carry_raw = carry_raw
        params = list(self.stage.parameters()) + (list(self.head.parameters()) if self.head else [])
        self._setup(device=device, config=config, groups=[params], group=group,
                    trainable=_Trainable(self.stage, self.head, config.loss or nn.functional.cross_entropy))

    def modules(self) -> list[nn.Module]:
        return [self.stage] + ([self.head] if self.head is not None else [])

    def _forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None) -> tuple[Any, Tensor]:
        return self._net(values, target, raw)

    @torch.no_grad()
    def eval_step(self, msg: Message) -> tuple[Message | None, tuple[int] | None]:
        """Forward in eval mode; the message for the next stage and how many labels this stage's head predicts right.

        The count is ``None`` when the head's output is not N x C class scores for N class labels.
        """
        values, target, _ = self._receive(msg)
        with self._autocast():
            out = self.stage(*values)
            logits = out if self.head is None else self.head(out[0])
        correct = _correct(logits, target)
        return (None if self.is_last else self._send(msg, out, None)), None if correct is None else (correct,)

    def _state(self) -> dict[str, Any]:
        return {"backbone": self.stage.state_dict(), "head": self.head.state_dict() if self.head is not None else None}

    def _load(self, state: dict[str, Any]) -> None:
        self.stage.load_state_dict(state["backbone"])
        if self.head is not None:
            self.head.load_state_dict(state["head"])


def add_counts(total: Any, more: Any) -> Any:
    """Sum of two evaluation tallies (tuples of numbers, elementwise); ``None`` when either is ``None``."""
    if total is None or more is None:
        return None
    return more if total == () else tuple(a + b for a, b in zip(total, more))


def _correct(logits: Any, target: Any) -> int | None:
    """Right top-1 predictions of class ``logits`` (N x C) against labels; ``None`` when the output is not that."""
    if not (isinstance(logits, Tensor) and isinstance(target, Tensor) and logits.dim() == 2
            and target.dim() == 1 and logits.shape[0] == target.shape[0]):
        return None
    return int((logits.argmax(1) == target).sum())

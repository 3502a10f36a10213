"""A stage's gradient updates: its optimizers, schedulers and gradient scaler, the backward of each loss, gradient
accumulation, clipping and the optimizer steps (:class:`GradientUpdates`, a mixin of :class:`~.runner.Runner`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..plans.timeline import Recorder, span
from .config import TrainConfig


def _finite(loss: Tensor) -> bool:
    return math.isfinite(float(loss))


def _clip_and_step(parts: Sequence[tuple[torch.optim.Optimizer, list[nn.Parameter]]], scaler: Any,
                   clip: float | None, live: Callable[[], None] = lambda: None) -> bool:
    """Unscale (``scaler``: a GradScaler or ``None``), clip to ``clip`` and step every (optimizer, its parameters) of
    ``parts``; ``False`` when the scaler skipped the step (infinite or NaN gradients). ``live()`` is called right
    before each optimizer's gradients and parameters change (it raises once the stage is cancelled)."""
    for optimizer, params in parts:
        live()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip is not None:
            nn.utils.clip_grad_norm_(params, clip)
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is None:
        return True
    before = scaler.get_scale()
    scaler.update()
    return scaler.get_scale() >= before  # the scale backs off after a skipped step


class GradientUpdates:
    """How a stage turns its losses into parameter updates: one optimizer (and scheduler) per independently trained
    part, ``accumulate`` batches of gradients per optimizer step, clipping, and float16's gradient scaler.

    A mixin of :class:`~.runner.Runner`, which holds the state it uses (declared below): the trainer's ``config``, the
    parameters, the recorder of spans, the hook run before every step, the seconds waited in the current training
    step, and :meth:`~.runner.Runner.check_live`, called before anything here changes a gradient, a parameter, an
    optimizer or a scheduler.
    """

    index: int
    config: TrainConfig
    params: list[nn.Parameter]
    recorder: Recorder | None
    before_step: Callable[[], None] | None
    _waited: float
    check_live: Callable[[], None]

    def _setup_updates(self, config: TrainConfig, groups: list[list[nn.Parameter]], device: torch.device,
                       dtype: torch.dtype | None) -> None:
        """The optimizers and schedulers of ``groups`` (one of each per group), the counters, and the gradient scaler
        of autocast in ``dtype`` on ``device``."""
        self._groups = groups
        self.optimizers = [config.optimizer(g) for g in groups]
        """One optimizer per independently trained part (a PPLL stage: one; a Pipe-BD stage: one per block)."""
        self.schedulers = [config.scheduler(o) for o in self.optimizers] if config.scheduler is not None else []
        self.updates = 0
        """Optimizer steps: one per ``accumulate`` batches, one per partial group at an end of the data (a float16
        step the scaler skipped counts too)."""
        self.accumulate, self.pending, self._group_schedules = config.accumulate, 0, True
        """Batches per optimizer step (``accumulate=``); those of the current group trained on so far."""
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        """The stage's gradient scaler under float16 autocast (``None``: bfloat16 keeps float32's range)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first (for a PPLL stage the only) optimizer."""
        return self.optimizers[0]

    @property
    def scheduler(self) -> Any:
        """The first scheduler, or ``None`` when the trainer has none."""
        return self.schedulers[0] if self.schedulers else None

    def update(self, loss: Tensor, scale: float = 1.0, parts: Sequence[int] | None = None, *,
               batch: int = -1, schedule: bool = True) -> bool:
        """Backward ``loss`` times ``scale / accumulate``; once ``accumulate`` batches are in, clip and step the
        optimizers (and schedulers) of ``parts``; whether they stepped.

        ``parts`` indexes :attr:`optimizers` (default: all); ``batch`` names the spans when tracing; ``schedule=False``
        (said by a group's last batch) leaves the schedulers. Under float16 the loss is scaled by :attr:`scaler` and
        the gradients unscaled before clipping; a step it skips (inf/NaN gradients) leaves the schedulers too.
        :attr:`before_step` (when set) runs between the last backward and the optimizer steps.
        """
        if self.config.nan_check and not _finite(loss):
            raise FloatingPointError(f"loss is {float(loss)} (nan_check=True); lower the learning rate, clip "
                                     f"gradients (clip_grad_norm=...) or check the data")
        parts = range(len(self.optimizers)) if parts is None else parts
        self.check_live()
        if self.pending == 0:
            for i in parts:
                self.optimizers[i].zero_grad(set_to_none=True)
        scale = scale / self.accumulate
        with span(self.recorder, "backward", batch):
            scaled = loss * scale if scale != 1.0 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self.pending += 1
        self._group_schedules = schedule
        if self.pending < self.accumulate:
            return False
        self._step_group(parts, batch)
        return True

    def flush(self) -> bool:
        """The end of the data (``finish``, a ``fit`` epoch's end): step on a partial accumulation group of ``k``
        batches, its gradients times ``accumulate / k`` (their mean); whether the optimizers stepped."""
        if self.pending == 0:
            return False
        self.check_live()
        factor = self.accumulate / self.pending
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)
        self._step_group(range(len(self.optimizers)), -1)
        return True

    def _step_group(self, parts: Sequence[int], batch: int) -> None:
        """Clip and step the optimizers (and schedulers) of ``parts`` on the gradients accumulated so far."""
        if self.before_step is not None:
            start = time.perf_counter()
            self.before_step()
            self._waited += time.perf_counter() - start
        with span(self.recorder, "step", batch):
            stepped = _clip_and_step([(self.optimizers[i], self._groups[i]) for i in parts], self.scaler,
                                     self.config.clip_grad_norm, self.check_live)
            if self.schedulers and self._group_schedules and stepped:
                for i in parts:
                    self.check_live()
                    self.schedulers[i].step()
        self.pending = 0
        self.updates += 1

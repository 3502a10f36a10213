"""``TrainConfig``: how every stage trains (optimizer and scheduler factories, loss, clipping, autocast, seed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["TrainConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How every stage trains: optimizer and scheduler factories, loss, clipping, autocast, fault checks, seed."""

    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    """``fn(params) -> Optimizer``, called once per stage with that stage's block and head parameters."""
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """``fn(optimizer) -> LRScheduler`` per stage, stepped after every optimizer step of that stage on a new input."""
    schedule_reused: bool = False
    """Step the schedulers after steps on reused inputs too (``queue="reuse"``)."""
    loss: Callable[[Any, Tensor], Tensor] | None = None
    """Loss of the last stage, ``fn(model_output, target)``; default :func:`~ppll_compile.heads.model_loss`."""
    clip_grad_norm: float | None = None
    """Clip each stage's gradient norm (block and head together) to this value."""
    autocast: tuple[torch.dtype | None, ...] = ()
    """Autocast dtype per stage (``None`` = full precision); empty = none anywhere."""
    nan_check: bool = False
    """Fail the pipeline when a stage's loss is not finite."""
    seed: int | None = 0
    """Seed of every stage's training randomness (see :mod:`.rng`); ``None``: torch's global stream, unseeded."""

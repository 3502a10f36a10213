"""``TrainConfig``: how every stage trains (optimizer and scheduler factories, loss, clipping, autocast, seed), and how
the optimizers it builds compare with the one the plan costed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..cost.optimizers import OPTIMIZER_STATES, kind_of, states_of
from ..plans.units import format_bytes


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
    """Loss of the last stage, ``fn(model_output, target)``; default :func:`~ppll_compile.heads.build.model_loss`. It also
    scores the auxiliary heads of float targets (0/1 ones included: it keeps a regression whose targets may all be 0
    or 1 in a batch): ``fn(head_scores, target)``, the scores reshaped to
    the target's shape."""
    aux_loss: tuple[Callable[[Any, Tensor], Tensor] | None, ...] = ()
    """Loss of every auxiliary head, ``fn(head_scores, target)``, one per stage but the last (``None``: the task's,
    :func:`~ppll_compile.heads.build.task_loss`); empty: the task's everywhere."""
    clip_grad_norm: float | None = None
    """Clip each stage's gradient norm (block and head together) to this value."""
    autocast: tuple[torch.dtype | None, ...] = ()
    """Autocast dtype per stage (``None`` = full precision); empty = none anywhere. A float16 stage gets a gradient
    scaler."""
    accumulate: int = 1
    """Batches whose gradients every stage adds up before one optimizer step (each loss scaled by ``1/accumulate``)."""
    nan_check: bool = False
    """Fail the pipeline when a stage's loss is not finite."""
    seed: int | None = 0
    """Seed of every stage's training randomness (see :mod:`.rng`); ``None``: torch's global stream, unseeded."""
    compile_stages: bool | Mapping[str, Any] = False
    """True: every stage's forward (block and head) under ``torch.compile`` (inductor); a dict: torch.compile's
    keywords (``backend``, ``mode``, ``options``, ``dynamic``, ``fullgraph``); see :mod:`ppll_compile.runtime.compiled`."""


def _described(optimizer: torch.optim.Optimizer) -> str:
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        momentum = next((g["momentum"] for g in optimizer.param_groups if g.get("momentum")), 0)
        return f"{name} with momentum {momentum:g}" if momentum else f"{name} without momentum"
    return name


def optimizer_mismatch(planned: str, stages: Sequence[tuple[int, int, torch.optim.Optimizer]]) -> str | None:
    """What to tell the user when the optimizers the trainer built keep another number of state tensors per parameter
    than the plan's ``optimizer`` (a kind of :data:`~ppll_compile.cost.optimizers.OPTIMIZERS`) costed; ``None`` when they
    agree, when the optimizer is not one :func:`~ppll_compile.cost.optimizers.states_of` knows, or when no stage has
    gradients.

    ``stages``: (stage index, the plan's gradient bytes of its backbone, its first optimizer) per stage run here.
    """
    counted = [(i, b, o, n) for i, b, o in stages if (n := states_of(o)) is not None]
    wrong = [(i, b, o, n) for i, b, o, n in counted if kind_of(o) != planned]
    if not wrong or not any(b for _, b, _, _ in wrong):
        return None
    _, _, first, n = wrong[0]
    kind = kind_of(first)
    per_stage = "; ".join(f"stage {i}'s optimizer state is {format_bytes(b * m)}, not "
                          f"{format_bytes(b * OPTIMIZER_STATES[planned])} as planned" for i, b, _, m in wrong if b)
    return (f"the trainer builds {_described(first)}, which keeps {n} state tensor{'s' if n != 1 else ''} per "
            f"parameter (optimizer={kind!r} in a plan), but the plan costs optimizer={planned!r} "
            f"({OPTIMIZER_STATES[planned]} per parameter): {per_stage}. Plan with optimizer={kind!r} "
            f"(ppll_compile.compile(model, ..., optimizer={kind!r})) so that its memory and step costs count this "
            f"state")

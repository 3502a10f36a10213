"""One PPLL stage: run the block, take the local loss, step its own optimizer, send the output on detached."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.losses import logits_of, model_loss
from ..heads.modules import head_scored_loss
from ..lower.stages import Stage
from ..plans.plan import StagePlan
from .config import TrainConfig
from .messages import Message
from .runner import Runner
from .scores import eval_tally


class _Trainable(nn.Module):
    """The modules a stage trains, as one module that DDP can wrap: ``forward`` gives (output, loss).

    The last stage's loss is ``loss(output, target)`` (the trainer's ``loss=``, else the task's,
    :func:`~ppll_compile.heads.build.model_loss`); an auxiliary head's is ``aux_loss(scores, target)`` when given, else the
    task's (:func:`~ppll_compile.heads.build.task_loss`, float targets scored by ``regression``: the trainer's ``loss=``)."""

    def __init__(self, stage: Stage, head: nn.Module | None, loss: Callable[[Any, Tensor], Tensor] | None,
                 aux_loss: Callable[[Any, Tensor], Tensor] | None = None) -> None:
        super().__init__()
        self.stage = stage
        self.head = head
        i = stage.index
        self._loss = loss or functools.partial(model_loss, where=f"stage {i}, the last (the model's output),")
        self._aux = aux_loss
        self._regression = loss
        self._where = f"stage {i}'s auxiliary head"

    def scored_loss(self, out: Any, target: Any, raw: Tensor | None, scores: bool = True) -> tuple[Any, Tensor]:
        """The scores (the head's, or the model output's :func:`~ppll_compile.heads.build.logits_of`; ``scores=False``:
        maybe ``None``) and the local loss of the stage's output ``out``."""
        if self.head is None:
            return logits_of(out), self._loss(out, target)
        made, loss = head_scored_loss(self.head, out[0], target, raw, loss=self._aux, regression=self._regression,
                                      where=self._where)
        return (self.head(out[0]) if made is None and scores else made), loss

    def forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None,
                ready: Callable[[Any], None] | None = None) -> tuple[Any, Tensor]:
        out = self.stage(*values)
        if ready is not None:  # early forwarding: the output goes on before the head's forward
            ready(out)
        return out, self.scored_loss(out, target, raw, scores=False)[1]


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
        aux = config.aux_loss[self.index] if self.head is not None and config.aux_loss else None
        self._trainable = _Trainable(self.stage, self.head, config.loss, aux)
        self._setup(device=device, config=config, groups=[params], group=group, trainable=self._trainable)

    def modules(self) -> list[nn.Module]:
        """The block and, except on the last stage, its auxiliary head."""
        return [self.stage] + ([self.head] if self.head is not None else [])

    def _forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None,
                 rng: contextlib.AbstractContextManager, ready: Callable[[Any], None] | None = None
                 ) -> tuple[Any, Tensor]:
        with rng:
            return self._net(values, target, raw, ready=ready)

    @torch.no_grad()
    def eval_step(self, msg: Message, metrics: Sequence[Callable[[Any, Any], Any]] = ()
                  ) -> tuple[Message | None, tuple[float, ...] | None]:
        """Forward in eval mode; the message for the next stage and this stage's tally of the batch (see
        :func:`.scores.eval_tally`): its local loss (the head's, or the last stage's loss), right top-1 predictions
        where the target is class labels, and (last stage) every user metric of the model's output.

        The tally is ``None`` for a batch without a target."""
        values, target, raw = self._receive(msg)
        with self.autocast():
            out = self.stage(*values)
            tally = None
            if target is not None:
                scores, loss = self._trainable.scored_loss(out, target, raw)
                tally = eval_tally(scores, target, loss, msg.size,
                                   [fn(out, target) for fn in metrics] if self.is_last else ())
        return (None if self.is_last else self._send(msg, out, None)), tally

    def pull(self, weights: list[Tensor]) -> None:
        """One EMA step of the momentum head towards the next stage's ``weights``."""
        self.head.pull(weights)  # type: ignore[union-attr]

    def _state(self) -> dict[str, Any]:
        return {"backbone": self.stage.state_dict(), "head": self.head.state_dict() if self.head is not None else None}

    def _load(self, state: dict[str, Any]) -> None:
        self.stage.load_state_dict(state["backbone"])
        if self.head is not None:
            self.head.load_state_dict(state["head"])

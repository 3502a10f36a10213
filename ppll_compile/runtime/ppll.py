"""One PPLL stage: run the block, take the local loss, step its own optimizer, send the output on detached."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..heads import head_loss, model_loss
from ..lowered import Stage
from ..plan import StagePlan
from .config import TrainConfig
from .messages import Message
from .runner import Runner


class _Trainable(nn.Module):
    """The modules a stage trains, as one module that DDP can wrap: ``forward`` gives (output, loss)."""

    def __init__(self, stage: Stage, head: nn.Module | None, loss: Callable[[Any, Tensor], Tensor]) -> None:
        super().__init__()
        self.stage = stage
        self.head = head
        self._loss = loss

    def forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None,
                ready: Callable[[Any], None] | None = None) -> tuple[Any, Tensor]:
        out = self.stage(*values)
        if ready is not None:  # early forwarding: the output goes on before the head's forward
            ready(out)
        if self.head is None:
            return out, self._loss(out, target)
        return out, head_loss(self.head, out[0], target, raw)


def _correct(logits: Any, target: Any) -> int | None:
    """Right top-1 predictions of class ``logits`` (N x C) against labels; ``None`` when the output is not that."""
    if not (isinstance(logits, Tensor) and isinstance(target, Tensor) and logits.dim() == 2
            and target.dim() == 1 and logits.shape[0] == target.shape[0]):
        return None
    return int((logits.argmax(1) == target).sum())


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
                    trainable=_Trainable(self.stage, self.head, config.loss or model_loss))

    def modules(self) -> list[nn.Module]:
        """The block and, except on the last stage, its auxiliary head."""
        return [self.stage] + ([self.head] if self.head is not None else [])

    def _forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None,
                 rng: contextlib.AbstractContextManager, ready: Callable[[Any], None] | None = None
                 ) -> tuple[Any, Tensor]:
        with rng:
            return self._net(values, target, raw, ready=ready)

    @torch.no_grad()
    def eval_step(self, msg: Message) -> tuple[Message | None, tuple[int] | None]:
        """Forward in eval mode; the message for the next stage and how many labels this stage's head predicts right.

        The count is ``None`` when the head's output is not N x C class scores for N class labels.
        """
        values, target, _ = self._receive(msg)
        with self.autocast():
            out = self.stage(*values)
            logits = out if self.head is None else self.head(out[0])
        correct = _correct(logits, target)
        return (None if self.is_last else self._send(msg, out, None)), None if correct is None else (correct,)

    def pull(self, weights: list[Tensor]) -> None:
        """One EMA step of the momentum head towards the next stage's ``weights``."""
        self.head.pull(weights)  # type: ignore[union-attr]

    def _state(self) -> dict[str, Any]:
        return {"backbone": self.stage.state_dict(), "head": self.head.state_dict() if self.head is not None else None}

    def _load(self, state: dict[str, Any]) -> None:
        self.stage.load_state_dict(state["backbone"])
        if self.head is not None:
            self.head.load_state_dict(state["head"])

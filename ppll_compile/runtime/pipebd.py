"""One Pipe-BD stage: relay the frozen teacher's activations and train each student block to match its teacher block."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.losses import logits_of
from ..lower.stages import Stage
from ..plans.plan import StagePlan
from .config import TrainConfig
from .messages import Message
from .runner import Runner


def _fresh(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Copies of the tensors: a block may modify its input in place, and each activation is also a target."""
    return tuple(v.clone() if isinstance(v, Tensor) else v for v in values)


def _main(out: Any) -> Any:
    """The tensor a block's output is compared on: a stage boundary's main tensor, or the model output's
    scores (a Hugging Face output object's ``logits``)."""
    return logits_of(out)


@torch.no_grad()
def teacher_pass(teacher: Sequence[Stage], values: tuple[Any, ...]) -> list[Any]:
    """The inputs of every teacher block and, last, the output of the final one (frozen, no autograd)."""
    acts: list[Any] = [values]
    for block in teacher:
        values = block(*_fresh(values))
        acts.append(values)
    return acts


class Students(nn.Module):
    """Student blocks as one module DDP can wrap: each block on its teacher input, each block's loss.

    ``forward(acts)`` takes the teacher activations around the blocks (``len(blocks) + 1`` of them, as
    :func:`teacher_pass` returns) and gives the stacked per-block losses.
    """

    def __init__(self, blocks: Sequence[Stage], losses: Sequence[Callable[[Tensor, Tensor], Tensor]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self._losses = list(losses)

    def forward(self, acts: list[Any]) -> Tensor:
        return torch.stack([loss(_main(block(*_fresh(x))), _main(y)).float()
                            for block, loss, x, y in zip(self.blocks, self._losses, acts, acts[1:])])


class DistillRunner(Runner):
    """Owns one Pipe-BD stage on one device: teacher blocks (frozen), student blocks, one optimizer per block.

    ``train_step`` runs the stage's teacher blocks once on the relayed activation, trains every student
    block on its (teacher input, teacher output) pair, and sends the teacher's last activation on. The
    loss it returns is the sum of the stage's block losses.
    """

    def __init__(self, *, stage: StagePlan, teacher: Sequence[Stage], student: Sequence[Stage],
                 losses: Sequence[Callable[[Tensor, Tensor], Tensor]], device: torch.device, config: TrainConfig,
                 group: Any = None) -> None:
        self.index = stage.index
        self.plan = stage
        self.teacher = [t.to(device).eval() for t in teacher]
        self.student = [s.to(device) for s in student]
        self.losses = list(losses)
        """Each block's distillation loss, ``fn(student_out, teacher_out)``."""
        self._students = Students(self.student, losses)
        self._setup(device=device, config=config, groups=[list(s.parameters()) for s in self.student],
                    trainable=self._students, group=group)

    def modules(self) -> list[nn.Module]:
        """The student blocks (the teacher stays in eval mode)."""
        return list(self.student)

    def _forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None,
                 rng: contextlib.AbstractContextManager, ready: Callable[[Any], None] | None = None
                 ) -> tuple[Any, Tensor]:
        acts = teacher_pass(self.teacher, values)  # the frozen teacher (eval mode) draws nothing: outside ``rng``
        if ready is not None:  # teacher relaying: the next stage's input goes on before the students train
            ready(acts[-1])
        with rng:
            return acts[-1], self._net(acts).sum()

    @torch.no_grad()
    def eval_step(self, msg: Message, metrics: Sequence[Any] = ()) -> tuple[Message | None, tuple[float, ...]]:
        """Eval-mode losses of every block on one batch, each times the batch size (a sum over its examples);
        ``metrics`` must be empty (a pipebd plan takes none)."""
        values, _, _ = self._receive(msg)
        with self.autocast():
            acts = teacher_pass(self.teacher, values)
            losses = self._students(acts)
        return (None if self.is_last else self._send(msg, acts[-1], None)), \
            tuple(float(v) * msg.size for v in losses)

    def _state(self) -> dict[str, Any]:
        return {"blocks": [s.state_dict() for s in self.student]}

    def _load(self, state: dict[str, Any]) -> None:
        for s, sd in zip(self.student, state["blocks"]):
            s.load_state_dict(sd)

"""What ``compile`` returns: the plan with the modules it lowered to, callable like the model, and its trainer."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .lowered import Lowered, Stage
from .plan import Plan
from .runtime import Trainer

__all__ = ["CompiledPipeline", "DistillPipeline"]


class CompiledPipeline:
    """A model compiled into pipeline stages: ``plan``, ``stages``, ``heads``; calling it runs the stages in order.

    The stages share the original model's parameter objects, so training them trains the model in place.
    """

    def __init__(self, *, model: nn.Module, graph_module: fx.GraphModule, plan: Plan, lowered: Lowered):
        self.model = model
        self.graph_module = graph_module
        """The traced model the stages were split from."""
        self.plan = plan
        self.lowered = lowered
        """The modules the runtime trains (stages, heads, devices, the input binder)."""

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stage modules (``pipebd``: the student blocks), in order."""
        return self.lowered.modules

    @property
    def heads(self) -> tuple[nn.Module | None, ...]:
        """The auxiliary head of every stage; ``None`` for the last (the model's own output)."""
        return self.lowered.heads

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The device of every stage (its first replica's)."""
        return tuple(torch.device(d) for d in self.plan.devices)

    def train(self, mode: bool = True) -> CompiledPipeline:
        """Set the mode of every stage and head, and of the model: switch modes here rather than on the model
        alone, as operations captured inside the model's ``forward`` (functional dropout, attention dropout)
        follow their stage's mode."""
        self.model.train(mode)
        self.lowered.train(mode)
        return self

    def eval(self) -> CompiledPipeline:
        """Eval mode for every stage and head, and for the model."""
        return self.train(False)

    def stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Parameters stage ``index`` trains: its backbone slice and its auxiliary head (``pipebd``: its blocks)."""
        return self.lowered.stage_parameters(self.plan.stages[index])

    def trainer(self, **options: Any) -> Trainer:
        """A :class:`~ppll_compile.runtime.Trainer` for this pipeline; ``options`` are its keyword arguments.

        ``optimizer`` (a factory ``fn(params) -> Optimizer``) is required; ``runtime`` is ``sequential``
        (default), ``threads`` or ``distributed``.
        """
        return Trainer(self.plan, self.lowered, **options)

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The model inputs in stage 0's order, from a call with the model's own signature."""
        return self.lowered.inputs.bind(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.lowered(*args, **kwargs)

    def __repr__(self) -> str:
        name = f"{type(self).__name__}({type(self.model).__name__}, {len(self.plan.stages)} stages)"
        return f"{name}\n{self.plan.table()}"


class DistillPipeline(CompiledPipeline):
    """A teacher/student pair compiled into aligned blocks: ``plan``, ``teacher_blocks``, ``student_blocks``.

    The student blocks share the student's parameter objects, so training them trains the student in
    place; each block sits on its stage's device. Calling the pipeline runs the *student* blocks in order
    (the student's own output); the trainer trains each student block on the teacher's relayed activations.
    """

    def __init__(self, *, model: nn.Module, teacher: nn.Module, graph_module: fx.GraphModule, plan: Plan,
                 lowered: Lowered) -> None:
        super().__init__(model=model, graph_module=graph_module, plan=plan, lowered=lowered)
        self.teacher = teacher

    @property
    def teacher_blocks(self) -> tuple[Stage, ...]:
        """The frozen teacher's blocks, one per distillation block."""
        return self.lowered.teacher

    @property
    def student_blocks(self) -> tuple[Stage, ...]:
        """The student's blocks, one per distillation block."""
        return self.lowered.modules

    @property
    def losses(self) -> tuple[Any, ...]:
        """Each block's distillation loss, ``fn(student_out, teacher_out)``."""
        return self.lowered.losses

    @property
    def block_devices(self) -> tuple[torch.device, ...]:
        """The device of every block: its stage's (first replica's)."""
        return self.lowered.devices

"""One Pipe-BD stage: relay the frozen teacher's activations and train each student block to match its teacher block."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..lowered import Lowered, Stage, move
from ..plan import Plan
from ..plan import StagePlan
from ..timeline import span
from .local import Counts, Losses, Runtime
from .stage import Message, Runner, TrainConfig

__all__ = ["DistillRunner", "DNARuntime", "teacher_pass"]


def _fresh(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Copies of the tensors: a block may modify its input in place, and each activation is also a target."""
    return tuple(v.clone() if isinstance(v, Tensor) else v for v in values)


def _main(out: Any) -> Any:
    """The tensor a block's output is compared on: a stage boundary is a 1-tuple, the model output itself."""
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def teacher_pass(teacher: Sequence[Stage], values: tuple[Any, ...]) -> list[Any]:
    """The inputs of every teacher block and, last, the output of the final one (frozen, no autograd)."""
    acts: list[Any] = [values]
    for block in teacher:
        values = block(*_fresh(values))
        acts.append(values)
    return acts


class _Students(nn.Module):
    """A stage's student blocks as one module DDP can wrap: each block on its teacher input, each block's loss."""

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
        self._students = _Students(self.student, losses)
        self._setup(device=device, config=config, groups=[list(s.parameters()) for s in self.student],
                    trainable=self._students, group=group)

    def modules(self) -> list[nn.Module]:
        return list(self.student)

    def _forward(self, values: tuple[Any, ...], target: Any, raw: Tensor | None) -> tuple[Any, Tensor]:
        acts = teacher_pass(self.teacher, values)
        return acts[-1], self._net(acts).sum()

    @torch.no_grad()
    def eval_step(self, msg: Message) -> tuple[Message | None, tuple[float, ...]]:
        """Eval-mode losses of every block on one batch, each times the batch size (a sum over its examples)."""
        values, _, _ = self._receive(msg)
        with self._autocast():
            acts = teacher_pass(self.teacher, values)
            losses = self._students(acts)
        return (None if self.is_last else self._send(msg, acts[-1], None)), \
            tuple(float(v) * msg.size for v in losses)

    def _state(self) -> dict[str, Any]:
        return {"blocks": [s.state_dict() for s in self.student]}

    def _load(self, state: dict[str, Any]) -> None:
        for s, sd in zip(self.student, state["blocks"]):
            s.load_state_dict(sd)


class DNARuntime(Runtime):
    """The DNA-style baseline: every block re-runs the teacher from the input; all processes data-parallel.

    For each batch and each block ``k`` in turn, the teacher runs blocks ``0..k`` from the input and student
    block ``k`` trains on the pair (the teacher work grows with the block index, as in DNA). Under torchrun
    every process reads the same batches, trains on its slice of each, and all-reduces each block's
    gradients with DDP. Interleaving the blocks per batch gives the same parameters as training them one
    after another over the data, because each block depends only on the frozen teacher.
    """

    def __init__(self, plan: Plan, lowered: Lowered, config: TrainConfig, *, timeout: float) -> None:
        from .distributed import _device, _init_group
        from .runners import make_runners
        self._owns_group = False
        self.world, self.rank = 1, 0
        self.device = torch.device(plan.devices[0])
        if "WORLD_SIZE" in os.environ or dist.is_initialized():
            self._owns_group = _init_group(plan.num_stages, timeout)
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            self.device = _device(self.rank)
        k = plan.num_stages
        self.num_stages = k
        self.is_main_writer = self.is_main = self.rank == 0
        self.runners = make_runners(plan, lowered, config, range(k), [self.device] * k)
        self._teacher = [t for r in self.runners for t in r.teacher]
        self._parts = []  # per block: its stage's runner, its index there, the module the gradients go through
        for r in self.runners:
            for i, block in enumerate(r.student):
                net: nn.Module = _Students([block], [r.losses[i]])
                if self.world > 1:
                    from torch.nn.parallel import DistributedDataParallel
                    net = DistributedDataParallel(net, device_ids=[self.device] if self.device.type == "cuda"
                                                  else None)
                self._parts.append((r, i, net))

    def _slice(self, msg: Message) -> Message:
        if self.world == 1:
            return msg
        rows = torch.tensor_split(torch.arange(msg.size), self.world)[self.rank]
        take = lambda v: v[rows] if isinstance(v, Tensor) and v.dim() and v.shape[0] == msg.size else v  # noqa: E731
        return Message(index=msg.index, values=tuple(take(v) for v in msg.values), target=take(msg.target),
                       kind=msg.kind, whole=msg.size)

    def step(self, msg: Message | None) -> Losses:
        assert msg is not None
        msg = self._slice(msg)
        values = move(msg.values, self.device)
        losses = [0.0] * self.num_stages
        for k, (r, i, net) in enumerate(self._parts):
            with span(r.recorder, "forward", msg.index), r._autocast():
                acts = teacher_pass(self._teacher[:k + 1], values)  # the teacher again from the input
                loss = net(acts[-2:]).sum()
            r.update(loss, msg.size * self.world / msg.whole if msg.whole else 1.0, [i], batch=msg.index)
            losses[r.index] += float(loss.detach())
        for r in self.runners:
            r.steps += 1
        return [[v] for v in losses]

    def finish(self) -> Losses:
        return [[] for _ in self.runners]

    def evaluate(self, messages: Iterable[Message]) -> Counts:
        counts = super().evaluate(self._slice(m) for m in messages)
        if self.world == 1:
            return counts
        parts = self.gather(counts)
        return [(tuple(sum(p[j][0][b] for p in parts) for b in range(len(counts[j][0]))), sum(p[j][1] for p in parts))
                for j in range(self.num_stages)]

    def states(self) -> list[dict[str, Any]]:
        return super().states() if self.rank == 0 else []

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

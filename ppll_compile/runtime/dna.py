"""The DNA baseline of blockwise distillation: each block re-runs the teacher from the input, data-parallel."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..lowered import Lowered, move
from ..plan import Plan
from ..timeline import span
from .base import Counts, Losses, Runtime
from .config import TrainConfig
from .group import init_group, rank_device
from .messages import Message
from .pipebd import Students, teacher_pass
from .runners import make_runners

__all__ = ["DNARuntime"]


class DNARuntime(Runtime):
    """The DNA-style baseline: every block re-runs the teacher from the input; all processes data-parallel.

    For each batch and each block ``k`` in turn, the teacher runs blocks ``0..k`` from the input and student
    block ``k`` trains on the pair (the teacher work grows with the block index, as in DNA). Under torchrun
    every process reads the same batches, trains on its slice of each, and all-reduces each block's
    gradients with DDP. Interleaving the blocks per batch gives the same parameters as training them one
    after another over the data, because each block depends only on the frozen teacher. A stage's blocks
    draw their randomness from one stream per batch, in block order, as the pipelined runtimes draw it.
    """

    def __init__(self, plan: Plan, lowered: Lowered, config: TrainConfig, *, timeout: float) -> None:
        self._owns_group = False
        self.world, self.rank = 1, 0
        self.device = torch.device(plan.devices[0])
        if "WORLD_SIZE" in os.environ or dist.is_initialized():
            self._owns_group = init_group(plan.num_stages, timeout)
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            self.device = rank_device(self.rank)
        k = plan.num_stages
        self.num_stages = k
        self.is_main_writer = self.is_main = self.rank == 0
        self.runners = make_runners(plan, lowered, config, range(k), [self.device] * k)
        for r in self.runners:
            r.replica = self.rank  # each process trains its own slice: its own random stream
        self._teacher = [t for r in self.runners for t in r.teacher]
        self._parts = []  # per block: its stage's runner, its index there, the module the gradients go through
        for r in self.runners:
            for i, block in enumerate(r.student):
                net: nn.Module = Students([block], [r.losses[i]])
                if self.world > 1:
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
        """Train every block on this process's slice of ``msg``, the teacher re-run from the input for each."""
        assert msg is not None
        msg = self._slice(msg)
        values = move(msg.values, self.device)
        losses = [0.0] * self.num_stages
        k = 0
        for r, parts in itertools.groupby(self._parts, key=lambda part: part[0]):
            with r.randomness(msg):  # one stream per stage over its blocks in order, as DistillRunner draws it
                for _, i, net in parts:
                    with span(r.recorder, "forward", msg.index), r.autocast():
                        acts = teacher_pass(self._teacher[:k + 1], values)  # the teacher again from the input
                        loss = net(acts[-2:]).sum()
                    r.update(loss, msg.size * self.world / msg.whole if msg.whole else 1.0, [i], batch=msg.index)
                    losses[r.index] += float(loss.detach())
                    k += 1
        for r in self.runners:
            r.steps += 1
        return [[v] for v in losses]

    def finish(self) -> Losses:
        """Nothing is pending."""
        return [[] for _ in self.runners]

    def evaluate(self, messages: Iterable[Message]) -> Counts:
        """Every block's summed eval loss over this process's slices, summed over the processes."""
        counts = super().evaluate(self._slice(m) for m in messages)
        if self.world == 1:
            return counts
        parts = self.gather(counts)
        return [(tuple(sum(p[j][0][b] for p in parts) for b in range(len(counts[j][0]))), sum(p[j][1] for p in parts))
                for j in range(self.num_stages)]

    def states(self) -> list[dict[str, Any]]:
        """Every stage's state, written by rank 0 only (the processes hold the same parameters)."""
        return super().states() if self.rank == 0 else []

    def barrier(self) -> None:
        """Wait for every process (when there are several)."""
        if self.world > 1:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every process, in rank order."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        """Destroy the process group if this runtime made it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

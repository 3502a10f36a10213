"""The DNA baselines of blockwise distillation: every block re-runs the teacher from the input, data-parallel.

Two schedules: ``dna`` trains every block on each batch in turn (data read once per batch); ``dna-per-block``
is DNA as published, each block trained over all the epochs before the next, the data read again per block.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import PPLLError
from ..lower.stages import Lowered, move
from ..plans.plan import Plan
from ..plans.timeline import span
from .base import Counts, Losses, Runtime, progress_bar
from .config import TrainConfig
from .distributed.group import init_group, rank_device
from .inputs import batch_message, loader_pair
from .messages import TRAIN, Message
from .pipebd import Students, teacher_pass
from .rng import StageRNG, stream_seed
from .runner import Runner
from .runners import make_runners


class DNARuntime(Runtime):
    """Data-parallel blockwise distillation, the teacher re-run per block (``runtime="dna"``): a baseline.

    For each batch and each block ``k`` in turn, the teacher runs blocks ``0..k`` from the input and student
    block ``k`` trains on the pair (the teacher work grows with the block index, as in DNA). The data is read
    once per batch for all the blocks; DNA as published trains the blocks one after another over whole epochs
    and reads the data again per block: that is :class:`DNAPerBlockRuntime`. Under torchrun every process
    reads the same batches, trains on its slice of each, and all-reduces each block's gradients with DDP.
    Interleaving the blocks per batch gives the same parameters as training them one after another over the
    data, because each block depends only on the frozen teacher. A stage's blocks draw their randomness from
    one stream per batch, in block order, as the pipelined runtimes draw it.
    """

    modes = ("pipebd",)

    @classmethod
    def build(cls, setup: Runtime.Setup) -> DNARuntime:
        """Every block on this process (data-parallel under torchrun)."""
        return cls(setup.plan, setup.lowered, setup.config, timeout=setup.timeout)

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
        self._parts: list[tuple[Runner, int, nn.Module]] = []
        """Per block: its stage's runner, its index there, the module the gradients go through."""
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

    def _train_block(self, k: int, msg: Message, values: tuple[Any, ...],
                     rng: Callable[[list[Any]], contextlib.AbstractContextManager] | None = None) -> float:
        """Block ``k`` trained on this process's slice ``msg`` (inputs ``values``), the teacher run from the input;
        its loss. ``rng(acts)``, if given, is the context of the student's forward (given the teacher's activations)."""
        r, i, net = self._parts[k]
        with span(r.recorder, "forward", msg.index), r.autocast():
            acts = teacher_pass(self._teacher[:k + 1], values)  # the teacher again from the input
            with rng(acts) if rng is not None else contextlib.nullcontext():
                loss = net(acts[-2:]).sum()
        r.update(loss, msg.size * self.world / msg.whole if msg.whole else 1.0, [i], batch=msg.index)
        return float(loss.detach())

    def step(self, msg: Message | None) -> Losses:
        """Train every block on this process's slice of ``msg``, the teacher re-run from the input for each."""
        assert msg is not None
        msg = self._slice(msg)
        values = move(msg.values, self.device)
        losses = [0.0] * self.num_stages
        k = 0
        for r, parts in itertools.groupby(self._parts, key=lambda part: part[0]):
            with r.randomness(msg):  # one stream per stage over its blocks in order, as DistillRunner draws it
                for _ in parts:
                    losses[r.index] += self._train_block(k, msg, values)
                    k += 1
        for r in self.runners:
            r.steps += 1
            r.updates = r.steps  # counted per batch as under the pipelined runtimes (accumulate=1 for pipebd)
        return Losses([[v] for v in losses], [[msg.whole or msg.size]] * len(losses))

    def finish(self) -> Losses:
        """Nothing is pending."""
        return Losses([[] for _ in self.runners])

    def evaluate(self, messages: Iterable[Message], metrics: Sequence[Any] = ()) -> Counts:
        """Every block's summed eval loss over this process's slices, summed over the processes."""
        counts = super().evaluate((self._slice(m) for m in messages), metrics)
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


class DNAPerBlockRuntime(DNARuntime):
    """DNA's published schedule (``runtime="dna-per-block"``): block after block, each over every epoch.

    :meth:`fit` trains block 0 over all the epochs, then block 1, and so on; for every block and epoch it
    iterates the loader again, and the teacher runs blocks ``0..k`` from the input for student block ``k``.
    Data-parallel under torchrun as ``dna``. It needs the whole data at once, so :meth:`step` refuses.

    A block's training sees exactly the batches, batch indices and random streams it sees under ``dna``, so
    both give the same parameters when the loader yields the same batches on every pass (a shuffling loader
    draws another order per pass, as DNA's own loaders do). A stage's blocks share one random stream per
    batch, drawn in block order: to continue it where the earlier blocks of its stage left off, a block
    replays their forwards first (without gradients, their buffers restored), when they draw random numbers.
    Replaying advances the generator as the first draw did if the number of random values drawn depends only
    on the shapes (dropout, drop-path), not on the values.
    """

    whole_fit = True

    def __init__(self, plan: Plan, lowered: Lowered, config: TrainConfig, *, timeout: float) -> None:
        super().__init__(plan, lowered, config, timeout=timeout)
        self._plan, self._lowered, self._seed = plan, lowered, config.seed
        self._rngs = [StageRNG(self.device) for _ in self._parts]
        """Per block: its seeded forwards (which find out whether the block draws random numbers)."""

    def step(self, msg: Message | None) -> Losses:
        """Refused: this schedule trains each block over every epoch before the next."""
        raise PPLLError('runtime="dna-per-block" trains each block over all the epochs before the next, so it needs '
                        'the whole data at once: call trainer.fit(loader, epochs) instead of step(), or use '
                        'runtime="dna" (every block on each batch in turn, the same parameters)')

    @contextlib.contextmanager
    def _randomness(self, k: int, msg: Message, acts: list[Any]) -> Iterator[None]:
        """Block ``k``'s forward on ``msg``: its stage's stream, advanced past the stage's earlier blocks."""
        r, i, _ = self._parts[k]
        rng = self._rngs[k]
        if self._seed is None or rng.draws_random is False:
            yield
            return
        with rng.seeded(stream_seed(self._seed, r.index, msg.index, replica=r.replica)):
            for j in range(k - i, k):  # the earlier blocks of the stage, done with every epoch: draws known
                if self._rngs[j].draws_random:
                    _replay(self._parts[j][0].student[self._parts[j][1]], acts[j])
            yield

    def _block_pass(self, k: int, loader: Iterable[Any], first: int, bar: Any) -> list[tuple[int, float]]:
        """Block ``k`` trained on one pass over ``loader``, its batches numbered from ``first``; per batch its
        size (the whole batch's) and the block's loss (on this process's slice)."""
        r, i, _ = self._parts[k]
        out = []
        for n, item in enumerate(loader):
            inputs, target = loader_pair(item)
            whole = batch_message(self._plan, self._lowered, inputs, target, index=first + n, kind=TRAIN,
                                  carry_raw=self._lowered.carries_input)
            msg = self._slice(whole)
            loss = self._train_block(k, msg, move(msg.values, self.device),
                                     lambda acts, msg=msg: self._randomness(k, msg, acts))
            if i == len(r.student) - 1:  # the stage's last block: the stage is done with this batch
                r.steps += 1
                r.updates = r.steps  # per batch, as under the pipelined runtimes
            out.append((whole.size, loss))
            if bar is not None:
                bar.update(1)
        return out

    def fit(self, loader: Iterable[Any], epochs: int, *, first: int = 0,
            progress: bool | str = False) -> tuple[list[dict[str, Any]], int]:
        """Train every block in turn over ``epochs`` passes of ``loader``; per epoch the record that
        :meth:`Trainer.fit` gives, and the batch count after (batches are numbered from ``first``).

        An epoch's record sums over the blocks: ``seconds`` of their passes of that epoch, ``samples`` of one
        pass, and per stage the mean over batches of its blocks' summed losses (as under ``dna``).
        """
        stages = self.num_stages
        sums = [[0.0] * stages for _ in range(epochs)]
        counts = [[0] * stages for _ in range(epochs)]
        samples, seconds, batches = [0] * epochs, [0.0] * epochs, []
        total = len(loader) if hasattr(loader, "__len__") else None  # type: ignore[arg-type]
        for k, (r, i, _) in enumerate(self._parts):
            for e in range(epochs):
                bar = progress_bar(total, f"block {k + 1}/{len(self._parts)}, epoch {e + 1}/{epochs}",
                                   bool(progress) and self.is_main)
                start = time.perf_counter()
                try:
                    done = self._block_pass(k, loader, first + sum(batches[:e]), bar)
                finally:
                    if bar is not None:
                        bar.close()
                seconds[e] += time.perf_counter() - start
                if k == 0:
                    batches.append(len(done))
                    samples[e] = sum(size for size, _ in done)
                elif len(done) != batches[e]:
                    raise PPLLError(f'runtime="dna-per-block" reads the loader again for every block and epoch; in '
                                    f'epoch {e + 1} it gave {len(done)} batches to block {k} but {batches[e]} to '
                                    f'block 0. Use a loader that yields the same batches on every pass (a list or a '
                                    f'DataLoader, not a generator), or runtime="dna" (every block on each batch in '
                                    f'turn)')
                sums[e][r.index] += sum(loss for _, loss in done)
                counts[e][r.index] += len(done) if i == 0 else 0
        history = [{"epoch": e + 1, "samples": samples[e], "seconds": seconds[e],
                    "samples_per_s": samples[e] / seconds[e] if seconds[e] > 0 else math.nan,
                    "loss": [sums[e][j] / counts[e][j] if counts[e][j] else None for j in range(stages)]}
                   for e in range(epochs)]
        return history, first + sum(batches)


@torch.no_grad()
def _replay(block: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Run ``block`` in training mode for its random draws only: no gradients, its buffers restored after."""
    saved = [b.detach().clone() for b in block.buffers()]
    block(*(v.clone() if isinstance(v, Tensor) else v for v in inputs))
    for b, value in zip(block.buffers(), saved):
        b.copy_(value)


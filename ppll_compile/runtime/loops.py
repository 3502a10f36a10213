"""A trainer's loops over a whole loader: :meth:`DataLoops.fit` (training epochs, with their losses and throughput)
and :meth:`DataLoops.evaluate` (every stage in eval mode, with exact mean losses and metrics).

Both turn the loader's ``(inputs, target)`` pairs into the messages stage 0 receives, numbered as the trainer's batches
are, and hand them to the runtime; with ``rebalance=True`` the training loop runs the rebalancing check between two
batches, as :meth:`~.trainer.Trainer.step` does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sized
from typing import Any

from ..lowered import Lowered
from ..plan import Plan
from .base import Losses, Runtime, progress_bar
from .inputs import loader_pair
from .messages import EVAL, TRAIN, Message
from .rebalancer import Rebalancer
from .scores import check_metrics, scores


class DataLoops:
    """The loader loops of a trainer: :meth:`fit` and :meth:`evaluate`.

    A mixin of :class:`~.trainer.Trainer`, which holds the state they use (declared below) and builds every message
    (``_message``), adopts a moved cut (``_adopt``) and sets the allocator before the first training step
    (``_start_training``).
    """

    plan: Plan
    lowered: Lowered
    batches: int
    reads_data: bool
    is_main: bool
    _open: int
    _runtime: Runtime
    _rebalancer: Rebalancer
    _message: Callable[[Any, Any, str], Message]
    _adopt: Callable[[tuple[Plan, Lowered] | None], None]
    _start_training: Callable[[], None]

    def _messages(self, loader: Iterable[Any], kind: str) -> Iterable[Message] | None:
        if not self.reads_data:
            return None
        if kind == TRAIN and self._rebalancer.measuring:
            return self._checked_messages(loader)
        return (self._message(*loader_pair(item), kind) for item in loader)

    def _checked_messages(self, loader: Iterable[Any]) -> Iterable[Message]:
        """Training messages, the rebalancing check run before each (between two batches)."""
        for item in loader:
            self._adopt(self._rebalancer.between_batches(self.plan, self.lowered, self.batches))
            yield self._message(*loader_pair(item), TRAIN)

    def fit(self, loader: Iterable[Any], epochs: int = 1, progress: bool | str = True) -> list[dict[str, Any]]:
        """Train ``epochs`` passes over ``loader`` (``(inputs, target)`` pairs); per epoch, losses and throughput.

        ``progress``: a tqdm bar per epoch, labelled ``epoch k/epochs``; a string labels the bars instead (a loop
        that calls ``fit(loader, 1, progress=f"epoch {k}/{n}")`` once per epoch); ``False``: none.

        Each epoch's record holds ``epoch``, ``samples``, ``seconds``, ``samples_per_s`` and ``loss`` (every
        stage's mean loss; under ``distributed`` gathered from all ranks at the end of the epoch).
        """
        self._start_training()
        if self._runtime.whole_fit:  # e.g. block after block, each over every epoch
            history, self.batches = self._runtime.fit(loader, epochs, first=self.batches, progress=progress)
            return history
        total = len(loader) if isinstance(loader, Sized) else None
        history = []
        for epoch in range(epochs):
            label = progress if isinstance(progress, str) else f"epoch {epoch + 1}/{epochs}"
            bar = progress_bar(total, label, bool(progress) and self.is_main)
            record = _epoch(self._runtime, self._messages(loader, TRAIN), self.plan.num_stages, bar)
            self._open = 0  # every epoch ends the data: a partial accumulation group steps
            history.append({"epoch": epoch + 1} | record)
        return history

    def evaluate(self, loader: Iterable[Any], metrics: dict[str, Callable[[Any, Any], Any]] | None = None
                 ) -> dict[str, Any]:
        """Every stage in eval mode over ``loader`` (``(inputs, target)`` pairs); a dict of: ``loss`` (mean loss of the
        output: ``loss=``, else the task's), ``stage_loss`` (every stage's mean local loss, the last is ``loss``),
        ``accuracy``/``stage_accuracy`` (top-1 where the targets are class labels, per token over the labels not
        -100; else ``None``), ``perplexity`` (``exp(loss)`` for per-token labels; else ``None``), ``samples``, and one
        entry per ``metrics={"name": fn}``: ``fn(output, target)`` (a float or one-value tensor) on the model's output,
        averaged over the batches weighted by their sizes (under ``distributed``, by each replica's slice).

        The means are exact: a batch's loss counts times its labels not -100 (class labels) or its size, so a mean
        loss gives the loss of the whole data as one batch. Every runtime gives the same numbers (under
        ``distributed`` on every rank, each of which must call it). Pending batches finish first. A pipebd plan
        gives every block's mean distillation loss (``block_loss``), their sum (``loss``) and ``samples``.
        """
        named = check_metrics(metrics, self.plan.mode)
        messages = self._messages(loader, EVAL)
        self._open = 0
        counts = self._runtime.evaluate(messages if messages is not None else (), [fn for _, fn in named])
        return scores(counts, self.plan.mode, [name for name, _ in named])


def _epoch(runtime: Runtime, messages: Iterable[Message] | None, stages: int, bar: Any) -> dict[str, Any]:
    """One epoch of ``runtime`` over ``messages``, shown on the tqdm ``bar`` (if any) as losses come; its samples,
    seconds, throughput and every stage's mean loss."""
    sums, counts, seen = [0.0] * stages, [0] * stages, [0]
    start = time.perf_counter()

    def on_step(losses: Losses, size: int) -> None:
        for i, ls in enumerate(losses):
            sums[i] += sum(ls)
            counts[i] += len(ls)
        seen[0] += size
        if bar is not None:
            rate = seen[0] / max(time.perf_counter() - start, 1e-9)
            shown = {f"s{i}": f"{sums[i] / counts[i]:.3f}" for i in range(stages) if counts[i]}
            bar.set_postfix(shown | {"samples/s": f"{rate:.0f}"}, refresh=False)
            bar.update(1 if size else 0)

    try:
        runtime.epoch(messages, on_step)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    return {"samples": seen[0], "seconds": seconds, "samples_per_s": seen[0] / seconds if seconds > 0 else math.nan,
            "loss": [sums[i] / counts[i] if counts[i] else None for i in range(stages)]}

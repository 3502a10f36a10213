"""What :meth:`~.trainer.Trainer.evaluate` measures: every stage's tally of one eval batch, and the scores a sum of
tallies gives (mean losses, accuracies, perplexity, the user's metrics).

A PPLL stage's tally is a tuple of floats summed over batches (and over the replicas of a stage):
``(loss_sum, loss_weight, correct, labelled, per_token, *metric_sums)``. The loss of a batch counts times its
weight: the labels not :data:`~ppll_compile.heads.build.IGNORE_INDEX` for class labels (per example or per token), the
batch size otherwise; so when the loss is a mean (as every default one is), the mean over the data equals the loss
of the whole data as one batch. A metric counts times the batch size.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from ..errors import PPLLError
from ..heads.losses import IGNORE_INDEX, task_of

BUILT_IN = ("loss", "stage_loss", "accuracy", "stage_accuracy", "perplexity", "samples")
"""The keys :meth:`~.trainer.Trainer.evaluate` returns for a ``ppll`` plan (a user metric takes another name)."""
_METRICS = 5
"""Where the metric sums start in a tally."""


def eval_tally(scores: Any, target: Any, loss: Tensor, size: int, metrics: Sequence[Any] = ()) -> tuple[float, ...]:
    """One stage's tally of one eval batch of ``size`` examples: its local ``loss`` (a mean) times its weight, the
    right top-1 predictions of ``scores`` where ``target`` holds class labels, and each value of ``metrics`` times
    ``size`` (see the module's docstring)."""
    task = task_of(scores, target)
    correct = labelled = 0
    weight = size
    if task in ("classes", "tokens"):
        kept = target != IGNORE_INDEX
        labelled = weight = int(kept.sum())
        correct = int(((scores.argmax(-1) == target) & kept).sum())
    value = float(loss) * weight if weight else 0.0  # a batch of ignored labels only has a NaN mean: it counts 0
    return (value, float(weight), float(correct), float(labelled), 1.0 if task == "tokens" else 0.0,
            *(_number(m) * size for m in metrics))


def _number(value: Any) -> float:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.detach())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise PPLLError(f"a metric returned {reprlib.repr(value)}; evaluate(metrics={{name: fn}}) takes "
                        f"fn(output, target) -> a float or a one-value tensor") from None


def check_metrics(metrics: Any, mode: str) -> tuple[tuple[str, Callable[[Any, Any], Any]], ...]:
    """``evaluate``'s ``metrics=`` as (name, fn) pairs, checked: a mapping of new names to callables."""
    if metrics is None:
        return ()
    if mode != "ppll":
        raise PPLLError("evaluate(metrics=...) scores a ppll pipeline's output; a pipebd plan evaluates its blocks' "
                        "distillation losses: drop metrics=")
    if not isinstance(metrics, Mapping):
        raise PPLLError(f"metrics must be a dict {{name: fn(output, target) -> float}}, got {reprlib.repr(metrics)}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or name in BUILT_IN:
            raise PPLLError(f"metrics name {name!r} is not a free name: use a string other than evaluate's own keys "
                            f"({', '.join(BUILT_IN)})")
        if not callable(fn):
            raise PPLLError(f"metrics[{name!r}] is {reprlib.repr(fn)}, not a callable fn(output, target) -> float")
    return tuple(metrics.items())


def scores(counts: Sequence[tuple[tuple[float, ...] | None, int]], mode: str,
           names: Sequence[str] = ()) -> dict[str, Any]:
    """What :meth:`~.trainer.Trainer.evaluate` returns for every stage's summed tally and examples seen: mean losses,
    accuracies, perplexity and the ``names`` metrics (``ppll``); block losses (``pipebd``)."""
    if mode == "pipebd":
        n = counts[-1][1]
        block = [total / n if n else None for tally, _ in counts for total in (tally or ())]
        return {"block_loss": block, "loss": sum(block) if n else None, "samples": n}
    tallies = [t if t else None for t, _ in counts]
    losses = [t[0] / t[1] if t and t[1] else None for t in tallies]
    acc = [t[2] / t[3] if t and t[3] else None for t in tallies]
    last, n = tallies[-1], counts[-1][1]
    perplexity = None
    if last and last[4] and losses[-1] is not None:
        perplexity = math.exp(losses[-1]) if losses[-1] < 700 else math.inf
    mine = {name: last[_METRICS + k] / n if last and n else None for k, name in enumerate(names)}
    return {"loss": losses[-1], "stage_loss": losses, "accuracy": acc[-1], "stage_accuracy": acc,
            "perplexity": perplexity, "samples": n} | mine

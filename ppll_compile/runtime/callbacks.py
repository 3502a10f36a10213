"""Callbacks of a trainer's loops and what ends a fit: the :class:`Callback` hooks ``fit`` and ``evaluate`` call (after
every step, every epoch and every evaluation) and the records they are given, :class:`EarlyStopping`, ``fit``'s
counts (``epochs``, ``max_steps``) checked, and the arguments of one ``fit`` call (:class:`Run`)."""

from __future__ import annotations

import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import PPLLError

HOOKS = ("on_step_end", "on_epoch_end", "on_evaluate", "on_fit_end")
"""The methods a callback may have; each one it lacks is not called."""


class Callback:
    """A hook into :meth:`~.trainer.Trainer.fit` and :meth:`~.trainer.Trainer.evaluate`: subclass it and override
    the methods you need (each does nothing here). Every process calls them (under ``distributed`` each with its own
    view, see below); a logger writes on the main process only (``trainer.is_main``).

    Records are plain dicts; per-stage values are lists indexed by stage, ``None`` for a stage with no value here.
    """

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        """After every batch fed (and once more at the end of an epoch's data when losses come in then).

        ``record``: ``kind`` (``"step"``), ``epoch`` (the epoch in progress, from 1), ``batch`` (batches fed so far,
        :attr:`~.trainer.Trainer.batches`; a process that reads no data: batches its first stage trained), ``step``
        (optimizer steps of this process's first stage, :attr:`~.trainer.Trainer.updates`), ``samples`` (rows of
        the batch fed; 0 at the end of the data), ``samples_per_s`` (over the epoch so far), ``losses`` and
        ``sizes`` (per stage the losses of the batches it finished since the last call and their batch sizes: with
        pipelining a stage finishes a batch later than it is fed; under ``distributed`` a process sees its own
        stage's as they come and every stage's at the end of the epoch), ``loss`` (per stage the mean of
        ``losses``, ``None`` when empty) and ``lr`` (per stage its learning rate, :attr:`~.trainer.Trainer.lr`).
        """

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        """After every epoch of ``fit``; ``record`` is the epoch's record as ``fit`` returns it (``epoch``,
        ``samples``, ``seconds``, ``samples_per_s``, ``loss`` per stage; ``evaluate``: the evaluation's results with
        ``fit(evaluate=...)``) with ``kind`` (``"epoch"``), ``batch`` and ``step`` as in :meth:`on_step_end`."""

    def on_evaluate(self, trainer: Any, results: dict[str, Any]) -> None:
        """After every evaluation (``trainer.evaluate(..., callbacks=...)``, and after every epoch of
        ``fit(evaluate=...)``); ``results`` is what :meth:`~.trainer.Trainer.evaluate` returns (the same on every
        process)."""

    def on_fit_end(self, trainer: Any, history: list[dict[str, Any]]) -> None:
        """When ``fit`` returns (also when it trained nothing); ``history`` is what it returns."""


class EarlyStopping(Callback):
    """Ends ``fit`` after an epoch whose evaluation (``fit(..., evaluate=val_loader)``) has not improved on the best
    so far for ``patience`` evaluations in a row.

    ``monitor``: a key of :meth:`~.trainer.Trainer.evaluate`'s results (``"loss"``, ``"accuracy"``, a name of
    ``metrics=``); ``mode``: ``"min"`` (lower is better) or ``"max"``; an evaluation improves when it beats the best
    by more than ``min_delta``. It sets ``trainer.should_stop``; the results are the same on every process, so every
    process stops after the same epoch. :attr:`best`, :attr:`wait` and :attr:`stopped_epoch` say where it stands.
    """

    def __init__(self, monitor: str = "loss", *, patience: int = 3, min_delta: float = 0.0, mode: str = "min") -> None:
        if not isinstance(monitor, str) or not monitor:
            raise PPLLError(f"EarlyStopping(monitor=...) names a result of trainer.evaluate (e.g. 'loss', 'accuracy' "
                            f"or a name of metrics=), got {monitor!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise PPLLError(f"EarlyStopping(patience=...) is the number of evaluations in a row without improvement "
                            f"after which fit stops, a whole number >= 1, got {patience!r}; pass e.g. patience=3")
        if isinstance(min_delta, bool) or not isinstance(min_delta, numbers.Real) or not 0 <= min_delta < math.inf:
            raise PPLLError(f"EarlyStopping(min_delta=...) is how much better than the best a result must be to count "
                            f"as an improvement, a finite number >= 0, got {min_delta!r}; pass e.g. min_delta=0.001")
        if mode not in ("min", "max"):
            raise PPLLError(f"EarlyStopping(mode=...) is 'min' (lower {monitor} is better) or 'max' (higher is "
                            f"better), got {mode!r}")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, float(min_delta), mode
        self.best: float | None = None
        """The best result so far."""
        self.wait = 0
        """Evaluations since the best one."""
        self.stopped_epoch: int | None = None
        """The epoch after which it stopped ``fit`` (``None``: it has not)."""

    def on_evaluate(self, trainer: Any, results: dict[str, Any]) -> None:
        """Compare ``results[monitor]`` with the best so far; stop ``fit`` after ``patience`` without improvement."""
        value = results.get(self.monitor)
        if self.monitor not in results or isinstance(value, bool) or not isinstance(value, numbers.Real):
            known = sorted(k for k, v in results.items() if isinstance(v, numbers.Real) and not isinstance(v, bool))
            raise PPLLError(f"EarlyStopping(monitor={self.monitor!r}) found {value!r} in the evaluation's results, "
                            f"not a number; results with numbers: {known}. Pass monitor= one of them (a metric of "
                            f"your own: fit(..., metrics={{name: fn}}))")
        better = (self.best is None or (value < self.best - self.min_delta if self.mode == "min"
                                        else value > self.best + self.min_delta))
        if better:
            self.best, self.wait = float(value), 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.should_stop = True
            self.stopped_epoch = trainer.epoch


def check_callbacks(value: Any, where: str) -> tuple[Any, ...]:
    """``callbacks=`` of ``where`` (``"fit"``, ``"evaluate"``) as a tuple: ``None``, a callback, or a list of them;
    a callback is an object with at least one of :data:`HOOKS`."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, type) or not any(callable(getattr(item, h, None)) for h in HOOKS):
            raise PPLLError(f"{where}(callbacks=...) takes Callback objects (a list, or one): subclasses of "
                            f"ppll_compile.Callback such as CSVLogger('log.csv'), or objects with one of "
                            f"{', '.join(HOOKS)}; got {item!r}" + ("; pass an instance, e.g. "
                                                                     f"{item.__name__}(...)" if isinstance(item, type)
                                                                     else ""))
    return tuple(items)


def notify(callbacks: Sequence[Any], hook: str, trainer: Any, value: Any) -> None:
    """Call ``hook(trainer, value)`` of every callback that has it, in order."""
    for c in callbacks:
        fn = getattr(c, hook, None)
        if callable(fn):
            fn(trainer, value)


def overrides(callback: Any, hook: str) -> bool:
    """Whether ``callback`` does something in ``hook`` (a method of its own, not :class:`Callback`'s)."""
    fn = getattr(type(callback), hook, None)
    return callable(getattr(callback, hook, None)) and fn is not getattr(Callback, hook, None)


class StepLog:
    """The step records of one epoch of ``fit`` for its callbacks: ``on_step_end`` after every batch fed."""

    def __init__(self, trainer: Any, callbacks: Sequence[Any], epoch: int) -> None:
        self.trainer, self.callbacks, self.epoch = trainer, callbacks, epoch
        self.samples, self.start = 0, time.perf_counter()

    def __call__(self, losses: Any, size: int) -> None:
        """One call of the runtime's ``on_step``: the losses finished since the last and the rows fed."""
        self.samples += size
        if not self.callbacks or (not size and not any(losses)):
            return
        t = self.trainer
        rate = self.samples / max(time.perf_counter() - self.start, 1e-9)
        sizes = getattr(losses, "sizes", None) or [[None] * len(ls) for ls in losses]
        record = position(t, "step") | {
            "epoch": self.epoch, "samples": size, "samples_per_s": rate,
            "losses": [list(ls) for ls in losses], "sizes": [list(s) for s in sizes],
            "loss": [sum(ls) / len(ls) if ls else None for ls in losses], "lr": per_stage(t, t.lr)}
        notify(self.callbacks, "on_step_end", t, record)


def position(trainer: Any, kind: str) -> dict[str, Any]:
    """``kind``, ``batch`` and ``step`` of a record (see :meth:`Callback.on_step_end`)."""
    runners = trainer.runners
    batch = trainer.batches if trainer.reads_data else (runners[0].steps if runners else 0)
    return {"kind": kind, "batch": batch, "step": runners[0].updates if runners else 0}


def per_stage(trainer: Any, values: dict[int, Any]) -> list[Any]:
    """``values`` by stage index as a list over every stage of the plan (``None`` for stages not run here)."""
    return [values.get(i) for i in range(trainer.plan.num_stages)]


@dataclass(kw_only=True)
class Run:
    """The arguments of one ``fit`` call, and the records of the epochs it trained."""

    loader: Iterable[Any]
    epochs: int
    progress: bool | str
    max_steps: int | None
    callbacks: tuple[Any, ...]
    evaluate: Iterable[Any] | None
    metrics: dict[str, Callable[[Any, Any], Any]] | None
    sync: bool
    """Whether rank 0's view is gathered after every epoch (callbacks or ``max_steps`` may stop the fit)."""
    history: list[dict[str, Any]] = field(default_factory=list)


class Feed:
    """The items of ``items``, at most ``limit`` (``None``: all); counts those given and sees the end."""

    def __init__(self, items: Iterable[Any], limit: int | None) -> None:
        self._items, self.limit, self.given, self.ended = iter(items), limit, 0, False

    def __iter__(self) -> Iterator[Any]:
        while self.limit is None or self.given < self.limit:
            try:
                item = next(self._items)
            except StopIteration:
                self.ended = True
                return
            self.given += 1
            yield item


def check_counts(epochs: Any, max_steps: Any) -> None:
    """``fit``'s ``epochs`` (a whole number >= 1) and ``max_steps`` (``None`` or a whole number >= 1)."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise PPLLError(f"epochs must be a whole number >= 1 (the total number of epochs from the start of "
                        f"training), got {epochs!r}; pass e.g. epochs=2 (for part of an epoch: max_steps=)")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise PPLLError(f"max_steps must be None or a whole number >= 1 (optimizer steps of the first stage from the "
                        f"start of training, as trainer.updates counts them), got {max_steps!r}; pass e.g. "
                        f"max_steps=1000, or leave it out to train whole epochs")


def rank0(trainer: Any, value: Any, sync: bool) -> Any:
    """Rank 0's ``value`` on every rank (``sync=False``: this process's, which agrees without a collective)."""
    return trainer._runtime.gather(value)[0] if sync else value


def steps_left(trainer: Any, run: Run, first: bool) -> int | None:
    """Batches the first stage may still train before ``max_steps`` (``None``: no limit); rank 0's view. On the
    ``first`` epoch of the call a limit already reached warns."""
    if run.max_steps is None:
        return None
    if rank0(trainer, trainer._open, True):  # batches fed by step(): their data ends first
        trainer.finish()
    steps = rank0(trainer, trainer.runners[0].updates if trainer.reads_data else None, True)
    if steps >= run.max_steps and first:
        _nothing(f"fit(max_steps={run.max_steps}) trains nothing: the first stage has already taken {steps} "
                 f"optimizer step(s) (trainer.updates); max_steps counts the total from the start of training "
                 f"(with or without checkpoint=), so pass a larger max_steps= to train on")
    return max(run.max_steps - steps, 0) * trainer.accumulate


def done_already(trainer: Any, run: Run) -> bool:
    """Whether ``epochs`` are done already (warned)."""
    if run.epochs > trainer.epoch:
        return False
    _nothing(f"fit(epochs={run.epochs}) trains nothing: this trainer has already trained {trainer.epoch} epoch(s); "
             f"epochs counts the total from the start of training (with or without checkpoint=), so pass "
             f"epochs={trainer.epoch + 1} to train one more; in an epoch loop: for e in range(n): "
             f"trainer.fit(loader, epochs=e + 1)")
    return True


def _nothing(text: str) -> None:
    """Warn that a ``fit`` call trains nothing, at the line that called ``fit``."""
    warnings.warn(text, stacklevel=5)  # _nothing < a check < _fit_... < fit < the caller

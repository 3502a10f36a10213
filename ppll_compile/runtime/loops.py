"""A trainer's loops over a whole loader: :meth:`DataLoops.fit` (training epochs, with their losses and throughput)
and :meth:`DataLoops.evaluate` (every stage in eval mode, with exact mean losses and metrics).

Both turn the loader's ``(inputs, target)`` pairs into the messages stage 0 receives, numbered as the trainer's batches
are, and hand them to the runtime; with ``rebalance=True`` the training loop runs the rebalancing check between two
batches, as :meth:`~.trainer.Trainer.step` does. ``fit(..., checkpoint=dir)`` resumes from and saves into ``dir``
(:class:`Saves`, :func:`reseed`: where the data stands, the shuffling order of every epoch, the saves and their
failures); :mod:`.callbacks` holds what else ends a fit (``max_steps``, ``EarlyStopping``) and what it reports.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from ..errors import CheckpointError, PPLLError
from ..lower.stages import Lowered
from ..plans.plan import Plan
from .base import Losses, Runtime, progress_bar
from .callbacks import (EarlyStopping, Feed, Run, StepLog, check_callbacks, check_counts, done_already, notify,
                        overrides, position, rank0, steps_left)
from .checkpoint.store import latest
from .inputs import loader_pair
from .messages import EVAL, TRAIN, Message
from .rebalancer import Rebalancer
from .rng import stream_seed
from .scores import check_metrics, scores

FAILED_SAVES = 3
"""Consecutive failed saves after which ``fit(..., checkpoint=...)`` stops (training would go on unprotected)."""
LOG = logging.getLogger("ppll_compile")
"""Where ``fit`` logs where it resumed."""


class DataLoops:
    """The loader loops of a trainer: :meth:`fit` and :meth:`evaluate`.

    A mixin of :class:`~.trainer.Trainer`, which holds the state they use (declared below) and builds every message
    (``_message``), adopts a moved cut (``_adopt``), sets the allocator before the first training step
    (``_start_training``) and saves and loads checkpoints (``save``, ``load``).
    """

    plan: Plan
    lowered: Lowered
    batches: int
    epoch: int
    """Epochs :meth:`fit` has completed, counted from the start of training (``fit(checkpoint=...)`` sets it from the
    data position it resumes at): the next ``fit(loader, epochs=E)`` trains epochs ``epoch`` to ``E - 1``."""
    should_stop: bool
    """Set by a callback (e.g. :class:`~.callbacks.EarlyStopping`) to end :meth:`fit` after the current epoch."""
    _into_epoch: int  # batches of epoch `epoch` trained by a fit that max_steps stopped inside it
    accumulate: int
    seed: int | None
    runtime_name: str
    save: Callable[..., Path]
    load: Callable[..., Path]
    reads_data: bool
    is_main: bool
    runners: list[Any]
    _open: int
    _runtime: Runtime
    _rebalancer: Rebalancer
    _message: Callable[[Any, Any, str], Message]
    _adopt: Callable[[tuple[Plan, Lowered] | None], None]
    _start_training: Callable[[], None]

    @property
    def lr(self) -> dict[int, float]:
        """The learning rate per stage run here (as :attr:`steps`): its first optimizer's first parameter group's (the
        one a scheduler drives), as it is now."""
        return {r.index: float(r.optimizers[0].param_groups[0]["lr"]) for r in self.runners if r.optimizers}

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

    def fit(self, loader: Iterable[Any], epochs: int = 1, progress: bool | str = True, *,
            checkpoint: str | os.PathLike | None = None, every: int | None = None, keep: int = 1,
            max_steps: int | None = None, callbacks: Any = None, evaluate: Iterable[Any] | None = None,
            metrics: dict[str, Callable[[Any, Any], Any]] | None = None) -> list[dict[str, Any]]:
        """Train over ``loader`` (``(inputs, target)`` pairs) until ``epochs`` epochs are done; per epoch trained,
        losses and throughput.

        ``epochs`` counts the total from the start of training, with or without ``checkpoint=`` (as Lightning's
        ``max_epochs``): a call trains epochs :attr:`epoch` (those done) to ``epochs - 1``, so a run killed and started
        again with the same call ends where it would have, and an epoch loop passes the epoch's number: ``for e in
        range(n): trainer.fit(loader, epochs=e + 1)``. A call that trains nothing (``epochs`` already done, or
        ``max_steps`` reached) warns, saying what is done and the way out, and returns ``[]``. ``max_steps``: stop
        once the first stage has taken that many optimizer steps from the start of training (:attr:`updates`: one
        per ``accumulate`` batches and one per partial group at an epoch's end; every stage's under FIFO queues),
        inside an epoch if need be; that epoch is not done, and the next ``fit`` goes on after its batches trained.
        Under ``distributed`` rank 0's loader and counters decide on every rank; ``dna-per-block`` refuses it.

        ``progress``: a tqdm bar per epoch, labelled ``epoch k/epochs``; a string labels the bars instead; ``False``:
        none. ``callbacks``: :class:`~.callbacks.Callback` objects (:class:`~.loggers.CSVLogger`,
        :class:`~.loggers.TensorBoardLogger`, :class:`~.callbacks.EarlyStopping`, your own), called after every step,
        epoch and evaluation and when ``fit`` returns. ``evaluate=val_loader``: :meth:`evaluate` (with ``metrics=``)
        after every epoch, its results in the epoch's record under ``evaluate``; a callback that sets
        :attr:`should_stop` (``EarlyStopping``) ends ``fit`` after that epoch.

        Each epoch's record holds ``epoch`` (from 1), ``samples``, ``seconds``, ``samples_per_s`` and ``loss`` (every
        stage's mean loss; under ``distributed`` gathered from all ranks at the end of the epoch).

        ``checkpoint="dir"`` makes the run resumable (:meth:`~.trainer.Trainer.save` and ``load`` underneath):

        - At the start, when ``dir`` holds a complete checkpoint, it is loaded (:meth:`~.trainer.Trainer.load`) and
          ``fit`` says where it resumed (printed to stderr on the main process, and logged by the ``ppll_compile``
          logger on every process: the checkpoint, the batch, the epoch and the batches done within it). The data
          position is then the trainer's batch count :attr:`batches` (the checkpoint's; without a checkpoint in
          ``dir``, the trainer's own): with ``L = len(loader)``, :attr:`epoch` is ``batches // L`` and training goes
          on in that epoch, whose first ``batches % L`` batches are skipped, not trained (from a plain ``DataLoader``
          over a map-style dataset only their indices are drawn; any other loader gives them and they are dropped).
          The records cover the batches trained in this call.
        - It saves (``trainer.save(dir, keep)``) after every ``every`` batches of an epoch (counted from the
          epoch's first batch: batches ``every``, ``2 * every``, ... of it), at the end of every epoch and where
          ``max_steps`` stops; ``every=None`` (default): at the end of every epoch only. Each save first finishes the
          batches in flight (under ``distributed`` every rank takes part), which does not change the computation with
          FIFO queues.
        - Shuffling is made repeatable: for a ``torch.utils.data.DataLoader`` whose ``sampler`` (or
          ``batch_sampler.sampler``) is a ``RandomSampler`` without a generator, every epoch ``e`` draws its order
          from a new ``torch.Generator`` seeded with :func:`.rng.stream_seed` ``(seed or 0, -1, e)`` (``seed``: the
          trainer's); the sampler gets its generator ``None`` back when ``fit`` returns. A ``DistributedSampler``
          gets ``set_epoch(e)``. Any other loader must give the same batches in the same order on every pass.
        - A save that fails with an ``OSError`` or :class:`~ppll_compile.CheckpointError` warns, naming the error
          and the last complete checkpoint, and training goes on; after 3 failed saves in a row ``fit`` raises
          :class:`~ppll_compile.PPLLError` (training is no longer protected), naming the last complete checkpoint
          and the cause.

        So a run that is killed and started again with the same call ends with the parameters of a run that never
        stopped (FIFO queues; ``sequential``, ``threads`` and ``distributed``, where every rank makes the call and
        rank 0's loader and batch count decide). ``checkpoint=`` needs a loader with ``len()``, ``every`` a
        positive number of batches that is a multiple of ``accumulate``, and a runtime that trains batch by batch
        (not ``dna-per-block``); ``keep``: complete checkpoints kept in ``dir``. The loader must give the same
        batches (length, contents, unshuffled order) on every run; randomness inside the dataset (augmentations) is
        not replayed. With ``rebalance=True`` a checkpoint saved after a cut moved holds the new cuts: resume it in a
        pipeline compiled with that plan (``trainer.plan``; ``compile(model, plan=...)``).
        """
        calls = check_callbacks(callbacks, "fit")
        run = Run(loader=loader, epochs=epochs, progress=progress, max_steps=max_steps, callbacks=calls,
                  evaluate=evaluate, metrics=metrics, sync=max_steps is not None or bool(calls))
        check_fit(self, run, checkpoint, every)
        saves = Saves(checkpoint, every, keep, self.accumulate) if checkpoint is not None else None
        self.should_stop = False
        self._start_training()
        if self._runtime.whole_fit:  # e.g. block after block, each over every epoch
            self._fit_whole(run)
        elif saves is not None:
            self._fit_saving(run, saves)
        else:
            self._fit_plain(run)
        notify(calls, "on_fit_end", self, run.history)
        return run.history

    def _fit_plain(self, run: Run) -> None:
        """``fit`` without checkpoints: epochs :attr:`epoch` to ``epochs - 1`` (the first after the batches a fit
        stopped by ``max_steps`` trained)."""
        if done_already(self, run):
            return
        total = len(run.loader) if isinstance(run.loader, Sized) else None
        for epoch in range(self.epoch, run.epochs):
            left = steps_left(self, run, first=epoch == self.epoch)
            if left == 0:
                return
            skip = self._into_epoch
            feed = Feed(_skipped(run.loader, skip) if skip and self.reads_data else run.loader, left)
            record = self._run_epoch(run, epoch, [self._messages(feed, TRAIN)], total, skip, lambda: None)
            self._open = 0  # every epoch ends the data: a partial accumulation group steps
            done = left is None or feed.ended or (total is not None and skip + feed.given == total)
            done, into = rank0(self, (done, skip + feed.given), run.sync)
            self._into_epoch = 0 if done else into
            if self._end_epoch(run, epoch, record, done):
                return

    def _fit_saving(self, run: Run, saves: Saves) -> None:
        """``fit(..., checkpoint=...)``: resume from the newest complete checkpoint, then train what is left of
        ``epochs``, saving as :meth:`fit` says."""
        loader = run.loader
        found = latest(saves.root)
        if self._runtime.gather(found is not None)[0]:  # rank 0's view decides on every rank
            saves.last, saves.last_batches = self.load(saves.root), self.batches
            if self.reads_data and any(s.generator is not None for s in _samplers(loader, RandomSampler)):
                warnings.warn("this DataLoader shuffles with a generator of its own: after resuming from "
                              f"{str(saves.last)!r}, its epochs are drawn from that generator's present state, "
                              "not in the order of a run that never stopped; build the DataLoader without "
                              "generator= (fit then seeds every epoch's order from the trainer's seed) to resume "
                              "exactly", stacklevel=3)  # the caller of fit(...)
        batches, size = self._runtime.gather((self.batches, len(loader) if isinstance(loader, Sized) else None))[0]
        if size is None:
            raise PPLLError(f"fit(checkpoint=...) needs a loader with len(): the point to resume from is a "
                            f"position in an epoch, and {type(loader).__name__} has no length. Give a list of "
                            f"batches or a DataLoader over a map-style dataset, or leave checkpoint= out and call "
                            f"trainer.save(DIR) yourself")
        if size == 0:
            raise PPLLError("fit(checkpoint=...) was given an empty loader (len() is 0): there is no batch to "
                            "train or to resume at; give a loader with at least one batch")
        self.epoch, self._into_epoch = divmod(batches, size)
        if saves.last is not None:
            say_resumed(self, saves.last, batches, size)
        if done_already(self, run):
            return
        shuffled: list[RandomSampler] = []
        try:
            for epoch in range(batches // size, run.epochs):
                left = steps_left(self, run, first=epoch == batches // size)
                if left == 0:
                    return
                done = max(batches - epoch * size, 0)
                stop = size if left is None else min(size, done + left)
                shuffled = reseed(loader, self.seed, epoch, shuffled)
                ends = [m for m in range(saves.every or size, size, saves.every or size) if done < m < stop] + [stop]
                data = _skipped(loader, done) if self.reads_data else None
                parts = (self._messages(itertools.islice(data, end - start), TRAIN) if data is not None else None
                         for start, end in zip([done] + ends, ends))
                position = iter(ends)

                def after_part(epoch: int = epoch, position: Iterator[int] = position) -> None:
                    self._open = 0  # each part ended the data: a partial accumulation group stepped
                    saves.save(self.save, epoch * size + next(position))

                record = self._run_epoch(run, epoch, parts, size, done, after_part)
                batches, self._into_epoch = epoch * size + stop, stop % size
                if self._end_epoch(run, epoch, record, stop == size):
                    return
        finally:
            for sampler in shuffled:
                sampler.generator = None

    def _fit_whole(self, run: Run) -> None:
        """``fit`` under a runtime that trains over every epoch at once (``dna-per-block``)."""
        if done_already(self, run):
            return
        history, self.batches = self._runtime.fit(run.loader, run.epochs - self.epoch, first=self.batches,
                                                  progress=run.progress)
        for record in history:
            record["epoch"] += self.epoch
        self.epoch = run.epochs
        for record in history:
            notify(run.callbacks, "on_epoch_end", self, position(self, "epoch") | record)
        run.history += history

    def _run_epoch(self, run: Run, epoch: int, parts: Iterable[Iterable[Message] | None], total: int | None,
                   done: int, after_part: Callable[[], None]) -> dict[str, Any]:
        """One epoch over ``parts`` (see :func:`_epoch`), its bar advanced past the ``done`` batches skipped."""
        label = run.progress if isinstance(run.progress, str) else f"epoch {epoch + 1}/{run.epochs}"
        bar = progress_bar(total, label, bool(run.progress) and self.is_main)
        if bar is not None and done:
            bar.update(done)
        return _epoch(self._runtime, parts, self.plan.num_stages, bar, after_part,
                      StepLog(self, run.callbacks, epoch + 1))

    def _end_epoch(self, run: Run, epoch: int, record: dict[str, Any], done: bool) -> bool:
        """After epoch ``epoch`` (``done``: to its end): evaluate, record, call the callbacks; whether to stop."""
        record = {"epoch": epoch + 1} | record
        if done:
            self.epoch = epoch + 1
        if run.evaluate is not None:
            record["evaluate"] = self.evaluate(run.evaluate, run.metrics, callbacks=run.callbacks)
        run.history.append(record)
        notify(run.callbacks, "on_epoch_end", self, position(self, "epoch") | record)
        return rank0(self, self.should_stop or not done, run.sync)

    def evaluate(self, loader: Iterable[Any], metrics: dict[str, Callable[[Any, Any], Any]] | None = None, *,
                 callbacks: Any = None) -> dict[str, Any]:
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
        ``callbacks``: their ``on_evaluate(trainer, results)`` is called with the results.
        """
        calls = check_callbacks(callbacks, "evaluate")
        named = check_metrics(metrics, self.plan.mode)
        messages = self._messages(loader, EVAL)
        self._open = 0
        counts = self._runtime.evaluate(messages if messages is not None else (), [fn for _, fn in named])
        results = scores(counts, self.plan.mode, [name for name, _ in named])
        notify(calls, "on_evaluate", self, results)
        return results


def check_fit(trainer: Any, run: Run, checkpoint: Any, every: Any) -> None:
    """Refuse what ``fit`` cannot do with these arguments, naming the way out."""
    check_counts(run.epochs, run.max_steps)
    if checkpoint is None and every is not None:
        raise PPLLError(f"fit(every={every!r}) saves every {every!r} batches, but no checkpoint directory was "
                        f"given; pass checkpoint=\"DIR\" too, or leave every= out")
    if run.evaluate is None and (run.metrics is not None or any(isinstance(c, EarlyStopping)
                                                                for c in run.callbacks)):
        what = "metrics=" if run.metrics is not None else "EarlyStopping"
        raise PPLLError(f"fit(...) was given {what}, which needs an evaluation after every epoch, but no "
                        f"evaluate= loader; pass evaluate=val_loader (its (inputs, target) pairs)")
    if run.evaluate is not None:
        check_metrics(run.metrics, trainer.plan.mode)
    if not trainer._runtime.whole_fit:
        return
    name = trainer.runtime_name
    if checkpoint is not None:
        raise PPLLError(f"fit(checkpoint=...) saves between batches, but runtime={name!r} trains over every epoch at "
                        f"once (block after block); leave checkpoint= out and call trainer.save(DIR) after fit, or "
                        f"train batch by batch (runtime=\"dna\" gives the same parameters)")
    if run.max_steps is not None:
        raise PPLLError(f"fit(max_steps={run.max_steps}) stops after that many optimizer steps, but runtime={name!r} "
                        f"trains each block over every epoch before the next, so no step of it ends training of "
                        f"the whole model; leave max_steps= out (whole epochs), or use runtime=\"dna\" (the same "
                        f"parameters, every block on each batch in turn)")
    if run.evaluate is not None:
        raise PPLLError(f"fit(evaluate=...) evaluates after every epoch, but runtime={name!r} trains each block over "
                        f"every epoch before the next, so no epoch ends with the whole model trained on it; leave "
                        f"evaluate= out and call trainer.evaluate(loader) after fit, or use runtime=\"dna\" (the "
                        f"same parameters)")
    for c in run.callbacks:
        if overrides(c, "on_step_end"):
            warnings.warn(f"runtime={trainer.runtime_name!r} trains block after block over every epoch, so "
                          f"{type(c).__name__}.on_step_end is never called (on_epoch_end is, once fit is done); "
                          f"use runtime=\"dna\" (the same parameters) for a callback after every step",
                          stacklevel=3)  # the caller of fit(...)


def say_resumed(trainer: Any, path: Path, batches: int, size: int) -> None:
    """Print (main process) and log (every process) where ``fit(checkpoint=...)`` resumed."""
    epoch, done = divmod(batches, size)
    text = (f"fit resumed from checkpoint {str(path)!r} at batch {batches}: epoch {epoch + 1}, {done} of its "
            f"{size} batches done")
    LOG.info(text)
    if trainer.is_main:
        print(text, file=sys.stderr, flush=True)


class Saves:
    """The checkpoints of one ``fit(..., checkpoint=root, every=..., keep=...)``: the arguments checked, the last
    complete checkpoint, and the failed saves in a row (warned about; :data:`FAILED_SAVES` of them stop the fit)."""

    def __init__(self, root: str | os.PathLike, every: int | None, keep: int, accumulate: int) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise PPLLError(f"every must be a positive whole number of batches between two checkpoints, got "
                            f"{every!r}; pass e.g. every=100, or leave it out to save at the end of every epoch")
        if every is not None and every % accumulate:
            raise PPLLError(f"every={every} is not a multiple of accumulate={accumulate}: a checkpoint inside an "
                            f"accumulation group would lose the gradients its stages hold; pass every="
                            f"{-(-every // accumulate) * accumulate} or another multiple of {accumulate}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise PPLLError(f"keep must be a whole number >= 1 (how many complete checkpoints stay in the "
                            f"directory), got {keep!r}; pass keep=1 to keep only the newest")
        self.root = root
        self.every = every
        self.keep = keep
        self.last: Path | None = None
        """The last complete checkpoint of this fit (loaded or saved)."""
        self.last_batches = 0
        """The batch count it was saved at."""
        self.failed = 0
        """Failed saves in a row."""

    def save(self, save: Callable[[str | os.PathLike, int], Path], batches: int) -> None:
        """``save(root, keep)`` at the data position ``batches``; an ``OSError`` or ``CheckpointError`` warns, the
        :data:`FAILED_SAVES`-th in a row raises :class:`PPLLError`."""
        try:
            self.last = save(self.root, self.keep)
        except (OSError, CheckpointError) as e:
            self.failed += 1
            cause = f"{type(e).__name__}: {e}"
            if self.failed >= FAILED_SAVES:
                raise PPLLError(f"fit stopped: the last {self.failed} checkpoint saves into {str(self.root)!r} "
                                f"failed, so training is no longer protected; {self._protected()}; the last save "
                                f"(at batch {batches}) failed with {cause}. Fix the cause (disk space, "
                                f"permissions, the directory), then run the same fit(..., checkpoint=...) again: "
                                f"it resumes from the last complete checkpoint") from e
            warnings.warn(f"checkpoint save into {str(self.root)!r} at batch {batches} failed ({cause}); training "
                          f"goes on, {self._protected()} ({self.failed} failed save(s) in a row; fit stops at "
                          f"{FAILED_SAVES})", stacklevel=7)  # the caller of fit(...)
        else:
            self.failed, self.last_batches = 0, batches

    def _protected(self) -> str:
        if self.last is None:
            return f"and there is no complete checkpoint in {str(self.root)!r} yet"
        return f"the last complete checkpoint is {str(self.last)!r} (batch {self.last_batches})"


def reseed(loader: Any, seed: int | None, epoch: int, shuffled: list[RandomSampler]) -> list[RandomSampler]:
    """Give the shuffling samplers of the DataLoader ``loader`` the order of ``epoch``: a ``RandomSampler``
    without a generator (or one in ``shuffled``: given one by an earlier epoch) a generator seeded with
    ``stream_seed(seed or 0, -1, epoch)``, a ``DistributedSampler`` ``set_epoch(epoch)``; the random samplers
    given a generator (to be given ``None`` back)."""
    out = list(shuffled)
    for s in _samplers(loader, (RandomSampler, DistributedSampler)):
        if isinstance(s, RandomSampler) and (s.generator is None or any(s is t for t in shuffled)):
            s.generator = torch.Generator().manual_seed(stream_seed(seed or 0, -1, epoch))
            out += [] if any(s is t for t in out) else [s]
        elif isinstance(s, DistributedSampler):
            s.set_epoch(epoch)
    return out


def _samplers(loader: Any, kinds: type | tuple[type, ...]) -> list[Any]:
    """The samplers of ``kinds`` that order the DataLoader ``loader`` (its ``sampler``, its ``batch_sampler``'s
    ``sampler``); none for any other loader."""
    if not isinstance(loader, DataLoader):
        return []
    found = {id(s): s for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
             if isinstance(s, kinds)}
    return list(found.values())


def _skipped(loader: Iterable[Any], count: int) -> Iterator[Any]:
    """An iterator over ``loader`` past its first ``count`` batches: for a plain ``DataLoader`` over a map-style
    dataset only the indices of those batches are drawn (its batch sampler's, so the order is the same) and the rest
    are loaded by a DataLoader with the same settings; from any other loader they are drawn and dropped."""
    if count and _plain_loader(loader):
        assert isinstance(loader, DataLoader)
        rest = itertools.islice(iter(loader.batch_sampler), count, None)
        same = {"in_order": loader.in_order} if hasattr(loader, "in_order") else {}  # torch >= 2.6
        return iter(DataLoader(loader.dataset, batch_sampler=rest, num_workers=loader.num_workers,
                               collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                               worker_init_fn=loader.worker_init_fn,
                               multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                               prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                               pin_memory_device=loader.pin_memory_device, **same))
    items = iter(loader)
    next(itertools.islice(items, count, count), None)
    return items


def _plain_loader(loader: Any) -> bool:
    """Whether ``loader`` is a ``torch.utils.data.DataLoader`` itself (not a subclass) that draws batches of indices
    from a batch sampler over a map-style dataset."""
    return type(loader) is DataLoader and loader.batch_sampler is not None \
        and not isinstance(loader.dataset, IterableDataset)


def _epoch(runtime: Runtime, parts: Iterable[Iterable[Message] | None], stages: int, bar: Any,
           after_part: Callable[[], None], log: Callable[[Losses, int], None]) -> dict[str, Any]:
    """One epoch of ``runtime`` over the messages of every part in turn (``None``: a process that reads no data),
    each ended as the data's end is and followed by ``after_part()`` (a save), shown on the tqdm ``bar`` (if any)
    as losses come and given to ``log(losses, size)``; its samples, seconds (saves included), throughput and every
    stage's mean loss."""
    sums, counts, seen = [0.0] * stages, [0] * stages, [0]
    start = time.perf_counter()

    def on_step(losses: Losses, size: int) -> None:
        for i, ls in enumerate(losses):
            sums[i] += sum(ls)
            counts[i] += len(ls)
        seen[0] += size
        log(losses, size)
        if bar is not None:
            rate = seen[0] / max(time.perf_counter() - start, 1e-9)
            shown = {f"s{i}": f"{sums[i] / counts[i]:.3f}" for i in range(stages) if counts[i]}
            bar.set_postfix(shown | {"samples/s": f"{rate:.0f}"}, refresh=False)
            bar.update(1 if size else 0)

    try:
        for messages in parts:
            runtime.epoch(messages, on_step)
            after_part()
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    return {"samples": seen[0], "seconds": seconds, "samples_per_s": seen[0] / seconds if seconds > 0 else math.nan,
            "loss": [sums[i] / counts[i] if counts[i] else None for i in range(stages)]}

"""Built-in loggers, each a :class:`~.callbacks.Callback` turned on in one line: :class:`CSVLogger` (a CSV file, a row
per step, epoch and evaluation) and :class:`TensorBoardLogger` (TensorBoard event files)."""

from __future__ import annotations

import csv
import math
import numbers
import os
from pathlib import Path
from typing import Any

from ..errors import PPLLError
from .callbacks import Callback, position


def flat(record: dict[str, Any]) -> dict[str, Any]:
    """The numbers and words of ``record``, one column each: a per-stage list ``loss`` becomes ``loss_s0``,
    ``loss_s1``, ...; ``None`` an empty cell; lists of lists (``losses``, ``sizes``) and dicts are left out."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, (list, tuple)):
            if not any(isinstance(v, (list, tuple, dict)) for v in value):
                out |= {f"{key}_s{i}": "" if v is None else v for i, v in enumerate(value)}
        elif not isinstance(value, dict):
            out[key] = "" if value is None else value
    return out


class CSVLogger(Callback):
    """Writes a CSV file with a header and one row per step (``kind`` ``step``), per epoch (``epoch``) and per
    evaluation (``evaluate``), readable by ``csv.DictReader``: ``fit(loader, epochs=3, callbacks=[CSVLogger(
    "log.csv")])``.

    The columns are the records' keys (see :class:`~.callbacks.Callback`), a per-stage list one column per stage
    (``loss_s0``, ``lr_s1``, ...); a cell a row has no value for is empty. A column that first appears in a later
    row (an evaluation's ``accuracy``) is added to the header, the rows before it rewritten with that cell empty.
    A new logger starts the file afresh; ``append=True`` goes on after the rows of an existing one (a resumed run).
    Only the main process writes (``trainer.is_main``); every row is flushed as it is written.
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise PPLLError(f"CSVLogger({str(path)!r}) is a directory; give the path of a file, e.g. "
                            f"CSVLogger({str(self.path / 'log.csv')!r})")
        self.fields: list[str] = []
        """The header so far."""
        self._append = append
        self._file: Any = None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._append and self.path.is_file() and self.path.stat().st_size:
            with self.path.open(newline="") as f:
                self.fields = list(csv.DictReader(f).fieldnames or [])
            self._file = self.path.open("a", newline="")
            return
        self._file = self.path.open("w", newline="")

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` (its columns as :func:`flat` makes them)."""
        cells = flat(row)
        if self._file is None:
            self._open()
        new = [k for k in cells if k not in self.fields]
        if new or not self.fields:
            self._file.close()
            rows = []
            if self.fields:
                with self.path.open(newline="") as f:
                    rows = list(csv.DictReader(f))
            self.fields += new
            self._file = self.path.open("w", newline="")
            writer = csv.DictWriter(self._file, self.fields, restval="")
            writer.writeheader()
            writer.writerows(rows)
        csv.DictWriter(self._file, self.fields, restval="").writerow(cells)
        self._file.flush()

    def close(self) -> None:
        """Close the file (a later row opens it again, appending)."""
        if self._file is not None:
            self._file.close()
            self._file, self._append = None, True

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        if trainer.is_main:
            self.write(record)

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        if trainer.is_main:
            self.write(record)

    def on_evaluate(self, trainer: Any, results: dict[str, Any]) -> None:
        if trainer.is_main:
            self.write(position(trainer, "evaluate") | {"epoch": trainer.epoch} | results)

    def on_fit_end(self, trainer: Any, history: list[dict[str, Any]]) -> None:
        self.close()


class TensorBoardLogger(Callback):
    """Writes TensorBoard event files into ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``; needs the
    ``tensorboard`` package): ``fit(loader, epochs=3, callbacks=[TensorBoardLogger("runs/exp1")])``, then
    ``tensorboard --logdir runs``.

    Scalars, each at the trainer's batch count (the records' ``batch``): per step ``train/loss/stage{i}``,
    ``train/lr/stage{i}`` and ``train/samples_per_s``; per epoch ``epoch/loss/stage{i}`` and
    ``epoch/samples_per_s``; per evaluation ``eval/{name}`` for every number of its results (``eval/loss``,
    ``eval/accuracy``, a metric of yours) and ``eval/stage_loss/stage{i}``, ``eval/stage_accuracy/stage{i}``. Only
    the main process writes (``trainer.is_main``); the events are flushed after every epoch and evaluation.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise PPLLError(f"TensorBoardLogger writes through torch.utils.tensorboard, which needs the tensorboard "
                            f"package ({e}); install it with pip install tensorboard (or pip install "
                            f"'ppll-compile[tensorboard]'), or log with CSVLogger('log.csv')") from None
        self.log_dir = Path(log_dir)
        self._make = SummaryWriter
        self.writer: Any = None
        """The ``SummaryWriter`` (made at the first write, on the main process)."""

    def _scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        if self.writer is None:
            self.writer = self._make(log_dir=str(self.log_dir))
        for name, value in values.items():
            if isinstance(value, (list, tuple)):
                self._scalars(f"{prefix}{name}/", {f"stage{i}": v for i, v in enumerate(value)}, step)
            elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(f"{prefix}{name}", float(value), step)

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        if trainer.is_main:
            self._scalars("train/", {k: record[k] for k in ("loss", "lr", "samples_per_s")}, record["batch"])

    def on_epoch_end(self, trainer: Any, record: dict[str, Any]) -> None:
        if trainer.is_main:
            self._scalars("epoch/", {k: record[k] for k in ("loss", "samples_per_s")}, record["batch"])
            self.writer.flush()

    def on_evaluate(self, trainer: Any, results: dict[str, Any]) -> None:
        if trainer.is_main:
            self._scalars("eval/", results, position(trainer, "evaluate")["batch"])
            self.writer.flush()

    def on_fit_end(self, trainer: Any, history: list[dict[str, Any]]) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a later write opens a new one)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

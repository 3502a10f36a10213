"""Runtimes that train a compiled pipeline by local learning: sequential, threads and distributed.

Takes: the lowered stages of :mod:`..lower` (:mod:`..lower.stages`), the plan and its schedule
(:mod:`..plans.schedule`), and the user's batches. Gives: the :class:`~.trainer.Trainer` over every runtime of
:mod:`.registry` (:mod:`.sequential`, :mod:`.threads`, :mod:`.distributed`, the DNA baselines of :mod:`.dna`), the
stages' runners (:mod:`.runners`, :mod:`.ppll`, :mod:`.pipebd` on :mod:`.runner` and :mod:`.updates`), losses, timelines, moved cuts (:mod:`.rebalance`)
and checkpoints (:mod:`.checkpoint`); the loops' callbacks (:mod:`.callbacks`) and loggers (:mod:`.loggers`).
"""

from ..errors import CheckpointError, StageError
from .callbacks import Callback, EarlyStopping
from .loggers import CSVLogger, TensorBoardLogger
from .registry import QUEUES, RUNTIMES
from .trainer import Trainer

__all__ = ["Trainer", "Callback", "CSVLogger", "TensorBoardLogger", "EarlyStopping", "StageError", "CheckpointError",
           "RUNTIMES", "QUEUES"]

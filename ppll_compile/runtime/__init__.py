"""Runtimes that train a compiled pipeline by local learning: sequential, threads and distributed."""

from ..errors import CheckpointError, StageError
from .trainer import QUEUES, RUNTIMES, Trainer

__all__ = ["Trainer", "StageError", "CheckpointError", "RUNTIMES", "QUEUES"]

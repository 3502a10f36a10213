"""Runtimes that train a compiled pipeline by local learning: sequential, threads and distributed."""

from ..errors import CheckpointError, StageError
from .registry import QUEUES, RUNTIMES
from .trainer import Trainer

__all__ = ["Trainer", "StageError", "CheckpointError", "RUNTIMES", "QUEUES"]

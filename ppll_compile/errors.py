"""Every exception ppll-compile raises; each message says what was found, what was expected and the way out.

:class:`PPLLError`, :class:`PartitionError` and :class:`InfeasibleMemoryError` are defined in the torch-free
:mod:`partitioners.errors` (the solvers raise them and must not import torch, which importing this package does)
and re-exported here as members of the one family; the others are defined here.
"""

from ppll_compile.partitioners.errors import InfeasibleMemoryError, PartitionError, PPLLError

__all__ = ["PPLLError", "TraceError", "CutError", "PolicyError", "PlanError", "PartitionError",
           "InfeasibleMemoryError", "StageError", "CheckpointError", "ModelFileError"]


class TraceError(PPLLError):
    """The model could not be traced with torch.fx."""


class CutError(PPLLError, ValueError):
    """A requested cut or stage count does not fit the model's legal cut points."""


class PolicyError(PPLLError, ValueError):
    """An auxiliary-head policy is malformed or cannot serve a boundary tensor."""


class PlanError(PPLLError, ValueError):
    """A plan is inconsistent or does not fit the model it is applied to."""


class StageError(PPLLError, RuntimeError):
    """A stage raised (or produced a non-finite loss) while the pipeline ran; it names the stage and batch."""

    def __init__(self, stage: int, batch: int | None, message: str, traceback: str = "") -> None:
        at = f" at batch {batch}" if batch is not None else ""
        text = f"stage {stage} failed{at}: {message}"
        if traceback:
            text += f"\n--- traceback of stage {stage} ---\n{traceback.rstrip()}"
        super().__init__(text)
        self.stage = stage
        self.batch = batch
        self.traceback = traceback


class CheckpointError(PPLLError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or was saved for another model, plan or trainer."""


class ModelFileError(PPLLError):
    """A MODEL.py that is missing, cannot be imported, raises, or does not define what a plan needs."""

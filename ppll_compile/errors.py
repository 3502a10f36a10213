"""The exceptions ppll-compile raises; each message says what was found, what was expected and the way out."""

__all__ = ["PPLLError", "TraceError", "CutError", "PolicyError", "PlanError", "PartitionError", "StageError",
           "CheckpointError"]


class PPLLError(Exception):
    """Base class of every error ppll-compile raises on bad input."""


class TraceError(PPLLError):
    """The model could not be traced with torch.fx."""


class CutError(PPLLError, ValueError):
    """A requested cut or stage count does not fit the model's legal cut points."""


class PolicyError(PPLLError, ValueError):
    """An auxiliary-head policy is malformed or cannot serve a boundary tensor."""


class PlanError(PPLLError, ValueError):
    """A plan is inconsistent or does not fit the model it is applied to."""


class PartitionError(PPLLError, ValueError):
    """The partitioner cannot satisfy the request (unknown solver, infeasible memory cap, ...)."""


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

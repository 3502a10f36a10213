"""ppll-compile: compile an unmodified nn.Module into a pipeline plan for local learning."""

from .api import PlanOptions, compile, plan
from .errors import CutError, PartitionError, PlanError, PolicyError, PPLLError, TraceError
from .lower import CompiledPipeline, Stage
from .plan import HeadSpec, Plan, StagePlan, TensorSpec
from .runtime import CheckpointError, StageError, Trainer

__all__ = [
    "compile",
    "plan",
    "PlanOptions",
    "Plan",
    "StagePlan",
    "HeadSpec",
    "TensorSpec",
    "CompiledPipeline",
    "Stage",
    "Trainer",
    "StageError",
    "CheckpointError",
    "PPLLError",
    "TraceError",
    "CutError",
    "PolicyError",
    "PlanError",
    "PartitionError",
]
__version__ = "0.1.0"

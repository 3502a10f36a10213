"""ppll-compile: compile an unmodified nn.Module into a pipeline for local learning or blockwise distillation."""

from .api import compile, plan
from .calibration import calibrate
from .errors import (CheckpointError, CutError, InfeasibleMemoryError, PartitionError, PlanError, PolicyError, PPLLError,
                     StageError, TraceError)
from .lowered import Stage
from .options import PlanOptions
from .pipeline import CompiledPipeline, DistillPipeline
from .plan import BlockPlan, Plan, StagePlan, TensorSpec
from .plan_specs import HeadSpec
from .runtime import Trainer
from .simulate import Simulation, StageSimulation, simulate
from .timeline import Event, Timeline

__all__ = [
    "compile",
    "plan",
    "calibrate",
    "PlanOptions",
    "Plan",
    "StagePlan",
    "BlockPlan",
    "HeadSpec",
    "TensorSpec",
    "CompiledPipeline",
    "DistillPipeline",
    "Stage",
    "Trainer",
    "simulate",
    "Simulation",
    "StageSimulation",
    "Timeline",
    "Event",
    "StageError",
    "CheckpointError",
    "PPLLError",
    "TraceError",
    "CutError",
    "PolicyError",
    "PlanError",
    "PartitionError",
    "InfeasibleMemoryError",
]
__version__ = "0.1.0"

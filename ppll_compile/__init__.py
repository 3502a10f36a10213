"""ppll-compile: compile an unmodified nn.Module into a pipeline for local learning or blockwise distillation."""

from .api import compile, plan
from .cost.calibration import calibrate
from .errors import (
                     CheckpointError,
                     CutError,
                     InfeasibleMemoryError,
                     PartitionError,
                     PlanError,
                     PolicyError,
                     PPLLError,
                     StageError,
                     TraceError,
)
from .lower.stages import Stage
from .options import PlanOptions
from .pipeline import CompiledPipeline, DistillPipeline
from .plans.plan import BlockPlan, Plan, StagePlan, TensorSpec
from .plans.specs import HeadSpec
from .plans.timeline import Event, Timeline
from .runtime import Callback, CSVLogger, EarlyStopping, TensorBoardLogger, Trainer
from .simulation.simulate import Simulation, StageSimulation, simulate

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
    "Callback",
    "CSVLogger",
    "TensorBoardLogger",
    "EarlyStopping",
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

"""Pipe-BD: blockwise distillation of a student from a frozen teacher, planned as a pipeline of aligned blocks."""

from .align import Blocks, align
from .build import PipeBD, compile_pipebd, plan_pipebd
from .policy import LOSSES, DistillPolicy, distill_loss, load_distill_policy


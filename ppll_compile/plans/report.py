"""What a plan says a cluster will see: each stage's memory by part, its head's share of the step, and the model
FLOPs utilisation (MFU) of a step time.

Every figure is read off the plan's own fields, so it holds for plan files made before it was reported:

- *Memory by part* (:func:`memory_split`): a stage's ``memory_bytes`` is its backbone's weights, gradients, optimizer
  state and saved activations plus its head's memory (less the head's input where the stage saves it already);
  the rest after the backbone's four parts is the ``head`` (``ppll``: the auxiliary head with its scores;
  ``pipebd``: the frozen teacher blocks and the distillation losses) or, on a ``ppll`` plan's last stage, the
  ``logits``: the model's output, the log-probabilities its loss saves and their gradient.
- *Head share* (:func:`head_share`): the stage's ``head_cost`` over its ``cost`` (0 where the plan did not record it).
- *MFU* (:func:`mfu`): the model's own FLOPs per step (every stage's backbone forward and backward, heads and the loss
  excluded) over ``step time x devices x peak``, the peak being a device's dense matrix-product peak in the plan's
  precision (:func:`peak_flops`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .specs import StagePlan


class Plan(Protocol):
    """The fields of :class:`ppll_compile.plans.plan.Plan` the figures are read from (the plan prints them, so this
    module sits below it)."""

    stages: Sequence[StagePlan]
    world_size: int
    precision: str
    hardware: str | None
    profile: str
    calibration: Mapping[str, Any]
    flops_per_second: float

LARGE_HEAD = 0.10
"""Share of a device's memory above which a plan notes a stage's head (or its last stage's logits)."""
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True, kw_only=True)
class MemorySplit:
    """The bytes one device of a stage holds, by part; they sum to the stage's ``memory_bytes``."""

    weights: int = 0
    """The backbone's parameters."""
    gradients: int = 0
    """The gradients of its trained parameters."""
    optimizer: int = 0
    """Their optimizer state."""
    activations: int = 0
    """What the backbone saves for backward."""
    head: int = 0
    """The auxiliary head: its parameters, gradients, optimizer state, saved activations and scores with their
    gradient (less its input where the backbone saves it already); ``pipebd``: the teacher blocks and losses."""
    logits: int = 0
    """The last stage's loss on the model's output: the output, what the loss saves and the output's gradient."""

    @property
    def total(self) -> int:
        """Every part: the stage's ``memory_bytes``."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.head + self.logits


def memory_split(stage: StagePlan) -> MemorySplit:
    """The memory of one device of ``stage``  by part (module docstring)."""
    backbone = stage.param_bytes + stage.grad_bytes + stage.optim_bytes + stage.activation_bytes
    rest = stage.memory_bytes - backbone
    last = stage.head.kind == "model"
    return MemorySplit(weights=stage.param_bytes, gradients=stage.grad_bytes, optimizer=stage.optim_bytes,
                       activations=stage.activation_bytes, head=0 if last else rest, logits=rest if last else 0)


def head_share(stage: StagePlan) -> float:
    """The share of ``stage``'s step its head (the last stage: its loss) takes: ``head_cost / cost`` (0 when the
    cost is 0)."""
    return stage.head_cost / stage.cost if stage.cost > 0 else 0.0


def model_flops(plan: Plan) -> int:
    """FLOPs of the model's own layers per step: every stage's backbone forward and backward, heads excluded."""
    return sum(s.flops_fwd + s.flops_bwd for s in plan.stages)


def peak_flops(plan: Plan) -> tuple[float, str] | None:
    """FLOP/s of one device at its peak in the plan's precision, and where that figure comes from: a hardware
    preset's dense matrix-product peak (its datasheet's, before the achievable fraction the costs assume);
    else the fastest compute-family rate the plan's calibration measured (matrix products, attention,
    convolutions); else ``flops_per_second`` (profile ``flops``). ``None`` when the plan has none of these."""
    # upward (plans -> cost): a preset's peak is read off the hardware presets
    from ..cost.hardware import COMPUTE_FRACTION, PRESETS
    precision = plan.precision
    dtype = _DTYPES.get(precision, precision)
    if plan.hardware in PRESETS:
        figures = PRESETS[plan.hardware].figures
        return figures.rate("matmul", dtype) / COMPUTE_FRACTION["matmul"], f"{plan.hardware} {dtype} dense peak"
    rates = plan.calibration.get("rates") if plan.profile == "roofline" else None
    if rates:
        # upward (plans -> cost): the compute operator families a calibration measured
        from ..cost.oplog import COMPUTE
        measured = {f: rates.get(f"{f}:{dtype}") or rates.get(f"{f}:float32") for f in COMPUTE}
        family = max((f for f in measured if measured[f]), key=lambda f: measured[f], default=None)
        if family is not None:
            return float(measured[family]), f"the fastest compute rate measured: {family}"
    if plan.profile == "flops" and plan.flops_per_second > 0:
        return float(plan.flops_per_second), "flops_per_second"
    return None


def mfu(plan: Plan, step_time: float) -> float | None:
    """The model FLOPs utilisation of ``plan`` at ``step_time`` seconds per batch: :func:`model_flops` over
    ``step_time x plan.world_size x`` :func:`peak_flops` (``None`` without a peak or a positive step time)."""
    peak = peak_flops(plan)
    if peak is None or not step_time > 0:
        return None
    return model_flops(plan) / (step_time * plan.world_size * peak[0])


def large_head_notes(stages: Sequence[StagePlan], device_memory: int | None) -> list[str]:
    """The plan's notes on heads (and the last stage's logits) that take more than :data:`LARGE_HEAD` of a
    device's ``device_memory`` bytes (none without it): the stage, the bytes and share, the scores' part, and a
    cheaper head."""
    if not device_memory:
        return []
    notes = []
    for s in stages:
        split = memory_split(s)
        part, what = (split.logits, "its loss on the model's output") if split.logits else (split.head, "its head")
        if part <= LARGE_HEAD * device_memory:
            continue
        scores = s.head.scores_bytes
        of = f", of which {_bytes(scores)} is one copy of its scores" if scores else ""
        notes.append(f"stage {s.index}: {what} takes {_bytes(part)}, {100 * part / device_memory:.0f}% of a "
                     f"device's {_bytes(device_memory)}{of}; {_cheaper(s)}")
    return notes


def _cheaper(stage: StagePlan) -> str:
    """The way out for a large head: a cheaper head of the policies, or a smaller batch."""
    config = stage.head.config
    kind = config.get("type")
    smaller = "a smaller batch_size or sequence shrinks the scores"
    if kind == "model":
        return f"{smaller} (every copy is batch x tokens x classes)"
    if kind == "lm_output" or (kind == "lm" and config.get("rank", 64) in (0, None)) \
            or (kind == "lm" and config.get("rank", 64) > 64):
        return (f"a cheaper head: per_token: {{type: lm, rank: 64}} (policy lm) trains a rank-64 read-out; "
                f"{smaller}")
    if kind == "lm":
        return f"it is the cheapest per-token head of the policies; {smaller}"
    return "a cheaper head: a smaller one of the policies (docs/policies.md), or a smaller batch_size"


def _bytes(n: float) -> str:
    from .units import format_bytes
    return format_bytes(n)

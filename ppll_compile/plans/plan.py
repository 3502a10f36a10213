"""The frozen, printable, serialisable pipeline plan that every later step consumes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ppll_compile.partitioners.objective import Links, allreduce_seconds

from ..errors import PlanError
from .file import PLAN_VERSION, PlanFile, unrunnable_stage
from .precision import FUSIONS, PRECISIONS
from .specs import BlockPlan, FrozenDict, StagePlan, TensorSpec
from .table import PlanTable
from .units import format_bytes

MODES = ("ppll", "pipebd")
"""Plan kinds: local learning with aux heads, and blockwise distillation from a teacher."""
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""The kinds of device a stage may run on."""
TRACERS_USED = ("fx", "export")
"""The front ends that capture a model: torch.fx symbolic tracing, or ``torch.export``."""


def device_problem(device: Any) -> str | None:
    """What is wrong with ``device`` as a stage's device, or ``None`` when ``torch.device`` takes it and its type
    is one of :data:`DEVICE_TYPES`."""
    try:
        kind = torch.device(device).type if not isinstance(device, bool) else None
    except (RuntimeError, TypeError, ValueError):
        kind = None
    if kind in DEVICE_TYPES:
        return None
    what = f"a {kind} device" if kind else "not a device"
    return (f"{device!r} is {what}; a stage runs on {', '.join(DEVICE_TYPES)}, with an index where there are "
            f"several (e.g. 'cuda:1')")


@dataclass(frozen=True, kw_only=True)
class Plan(PlanTable, PlanFile):
    """A complete pipeline plan: stages, their costs, and how they were chosen."""

    version: int = PLAN_VERSION
    """Plan format version."""
    mode: str = "ppll"
    """Plan kind: ``ppll`` (local learning with aux heads) or ``pipebd`` (blockwise distillation)."""
    model: str
    """Class name of the planned model (the student under ``pipebd``)."""
    teacher: str = ""
    """``pipebd``: class name of the frozen teacher."""
    blocks: tuple[BlockPlan, ...] = ()
    """``pipebd``: the aligned teacher/student blocks; stages train contiguous runs of them."""
    inputs: tuple[TensorSpec, ...]
    """The model's inputs at the planned batch size, in call order."""
    batch_size: int
    """Batch size the costs are measured at."""
    num_classes: int
    """Number of classes the auxiliary heads predict."""
    policy: str
    """Auxiliary-head policy (name, file path or callable name)."""
    partitioner: str
    """Partitioner that chose the cuts (``manual`` for user-given cuts)."""
    profile: str
    """Cost profile: ``roofline`` (counted FLOPs and bytes over the device's calibrated figures), ``flops``
    (counted FLOPs over :attr:`flops_per_second`) or ``time`` (measured on the device)."""
    optimizer: str
    """Optimizer whose state the memory model counts: ``sgd``, ``momentum`` or ``adam``."""
    precision: str = "fp32"
    """The precision the costs are priced in and the stages train in (:mod:`~ppll_compile.plans.precision`); a plan file
    from before precisions existed is ``fp32``."""
    fusion: str = "eager"
    """How element-wise chains were priced: ``eager`` (one operator at a time) or ``fused`` (one kernel per
    chain)."""
    flops_per_second: float
    """Device throughput used to turn FLOPs into seconds (profile ``flops``)."""
    link_bandwidth: float
    """Bytes per second between neighbouring stages."""
    gpus_per_node: int | None = None
    """Devices per node (stage replicas take consecutive devices, device ``d`` on node ``d // gpus_per_node``), or
    ``None``: one node."""
    intra_node_bandwidth: float | None = None
    """Bytes per second of a link inside a node (``None``: :attr:`link_bandwidth`)."""
    inter_node_bandwidth: float | None = None
    """Bytes per second of a link across nodes (``None``: :attr:`link_bandwidth`)."""
    device_speeds: tuple[float, ...]
    """Relative speed of each stage's device (1.0 = nominal)."""
    memory_limit: int | None
    """Per-device memory cap in bytes the partitioner honoured, if any."""
    legal_cuts: tuple[str, ...]
    """Every legal cut of the traced model, in graph order."""
    multi_tensor_cuts: tuple[str, ...] = ()
    """Legal cuts whose boundary is several values (e.g. activations plus an attention mask)."""
    stages: tuple[StagePlan, ...]
    """The stages, in pipeline order."""
    sequential_cost: float
    """Predicted step time of all stages run one after the other on one nominal device, in seconds."""
    calibration: Mapping[str, Any] = field(default_factory=dict)
    """``roofline``: the device figures the costs were computed with (device name, torch version, peak FLOP/s,
    memory bandwidth, per-kernel overhead); empty for the other profiles."""
    hardware: str | None = None
    """The hardware preset or figures file the plan was made for (``hardware=``); ``None``: this machine's."""
    tracer: str = "fx"
    """The front end that captured the model (the student under ``pipebd``): ``fx`` or ``export``."""
    untied: tuple[str, ...] = ()
    """Parameters the stages train their own copies of (``tied='untie'``, or ``tied='auto'`` where no plan kept them in
    one stage): per tensor, its names joined by `` = ``."""
    frozen: tuple[str, ...] = ()
    """Parameters (names, or modules holding them) accepted as never trained (``frozen=``): no loss of their stage
    reaches them; re-applying the plan (``plan=``) accepts them again. A plan file without the field accepts none."""
    checkpoint_activations: bool = False
    """Whether every stage recomputes its activations in backward instead of keeping them from its forward
    (``checkpoint_activations=True``), segment by segment between the legal cuts inside it
    (:attr:`StagePlan.checkpoints`); its memory and time count it (:attr:`StagePlan.kept_bytes`,
    :attr:`StagePlan.recompute_cost`). ``ppll`` plans only; a plan file without the field does not."""
    notes: tuple[str, ...] = field(default=())
    """Human-readable remarks gathered while planning (e.g. CPU fallback, multi-tensor boundaries)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "calibration", FrozenDict(self.calibration))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> tuple[str, ...]:
        """The device of every stage (its first replica's)."""
        return tuple(s.device for s in self.stages)

    @property
    def world_size(self) -> int:
        """Processes the distributed runtime needs: one per replica of every stage."""
        return sum(s.replicas for s in self.stages)

    @property
    def cuts(self) -> tuple[str, ...]:
        """The chosen cuts: the last node of every stage but the last."""
        return tuple(s.last_node for s in self.stages[:-1])

    @property
    def bottleneck_cost(self) -> float:
        return max(s.cost for s in self.stages)

    @property
    def ideal_cost(self) -> float:
        return sum(s.cost for s in self.stages) / len(self.stages)

    @property
    def imbalance(self) -> float:
        ideal = self.ideal_cost
        return self.bottleneck_cost / ideal if ideal > 0 else 1.0

    @property
    def predicted_speedup(self) -> float:
        b = self.bottleneck_cost
        return self.sequential_cost / b if b > 0 else 1.0

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda i: self.stages[i].cost)

    def links(self) -> Links:
        """The devices per node and the bandwidths of the links inside and across nodes the plan was costed with."""
        return Links(gpus_per_node=self.gpus_per_node,
                     intra=float(self.intra_node_bandwidth or self.link_bandwidth),
                     inter=float(self.inter_node_bandwidth or self.link_bandwidth))

    def first_device(self, stage: StagePlan) -> int:
        """The index of ``stage``'s first device among all the stages' replicas (they take consecutive devices)."""
        return sum(s.replicas for s in self.stages[:stage.index])

    def send_bandwidth(self, stage: StagePlan) -> float:
        """Bytes per second of the link ``stage`` sends its boundary over: across nodes or inside one."""
        links = self.links()
        return links.inter if stage.crosses_nodes else links.intra

    def allreduce_cost(self, stage: StagePlan, link_bandwidth: float | None = None) -> float:
        """Seconds per batch of ``stage``'s ring all-reduce over its replicas (0 for one), ``2 (r-1)/r`` times its
        gradient bytes (backbone, plus a ``ppll`` stage's aux head) over ``link_bandwidth`` (default: the links its
        replicas span, the inter-node one when they sit on several nodes); part of the stage's ``compute_cost``."""
        r = stage.replicas
        head = stage.head.param_count * 4 if self.mode == "ppll" and not stage.is_last else 0  # float32 heads
        bandwidth = link_bandwidth or self.links().allreduce_bandwidth(self.first_device(stage), r)
        return allreduce_seconds(stage.grad_bytes + head, r, bandwidth)

    def totals(self) -> dict[str, float]:
        return {
            "bottleneck_cost": self.bottleneck_cost,
            "ideal_cost": self.ideal_cost,
            "imbalance": self.imbalance,
            "predicted_speedup": self.predicted_speedup,
            "sequential_cost": self.sequential_cost,
        }

    def validate(self) -> None:
        """Check internal consistency; raise :class:`PlanError` naming the first problem."""
        if not self.stages:
            raise PlanError("plan has no stages")
        if self.mode not in MODES:
            raise PlanError(f"plan mode {self.mode!r} is not known; modes: {', '.join(MODES)}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"plan precision {self.precision!r} is not known; precisions: {', '.join(PRECISIONS)}")
        if self.fusion not in FUSIONS:
            raise PlanError(f"plan fusion {self.fusion!r} is not known; fusions: {', '.join(FUSIONS)}")
        if self.tracer not in TRACERS_USED:
            raise PlanError(f"plan tracer {self.tracer!r} is not known; tracers: {', '.join(TRACERS_USED)}")
        if not all(isinstance(n, str) and n for n in self.frozen):
            raise PlanError(f"frozen must list parameter or module names, got {list(self.frozen)!r}")
        if not isinstance(self.checkpoint_activations, bool):
            raise PlanError(f"checkpoint_activations must be true or false, got {self.checkpoint_activations!r}")
        distill = self.mode == "pipebd"
        if distill != bool(self.blocks):
            raise PlanError("a pipebd plan lists its distillation blocks; a ppll plan has none")
        covered = [b for s in self.stages for b in s.blocks]
        if covered != list(range(len(self.blocks))):
            raise PlanError(f"the stages train blocks {covered}; every block 0..{len(self.blocks) - 1} must be "
                            "trained by exactly one stage, in order")
        for i, s in enumerate(self.stages):
            if not (isinstance(s.replicas, int) and s.replicas >= 1):
                raise PlanError(f"stage {i}: replicas must be a positive integer, got {s.replicas!r}")
            if isinstance(self.batch_size, int) and self.batch_size >= 1 and \
                    (why := unrunnable_stage(i, s.replicas, self.batch_size)) is not None:
                raise PlanError(why)
            if s.index != i:
                raise PlanError(f"stage {i} has index {s.index}; stages must be numbered 0..{len(self.stages) - 1}")
            if (problem := device_problem(s.device)) is not None:
                raise PlanError(f"stage {i}: device {problem}")
            if not s.nodes or s.nodes[0] != s.first_node or s.nodes[-1] != s.last_node:
                raise PlanError(f"stage {i}: first_node/last_node must be the first/last of its nodes")
            if (i == len(self.stages) - 1) != (not s.boundary):
                raise PlanError(f"stage {i}: every stage but the last sends a boundary; the last sends none")
            if distill and s.head.kind != "distill":
                raise PlanError(f"stage {i}: a pipebd stage trains on distillation losses (head kind 'distill')")
            if not distill and (s.head.kind == "model") != (i == len(self.stages) - 1):
                raise PlanError(f"stage {i}: only the last stage uses the model's own head")
            for name in ("flops_fwd", "flops_bwd", "aux_flops", "param_count", "param_bytes", "grad_bytes",
                         "optim_bytes", "activation_bytes", "memory_bytes"):
                if getattr(s, name) < 0:
                    raise PlanError(f"stage {i}: {name} is negative")
            if not (math.isfinite(s.cost) and s.cost >= 0):
                raise PlanError(f"stage {i}: cost must be a finite non-negative number, got {s.cost}")
            self._validate_checkpoints(s)
        seen: set[str] = set()
        for s in self.stages:
            dup = seen.intersection(s.nodes)
            if dup:
                raise PlanError(f"node(s) {sorted(dup)} appear in more than one stage")
            seen.update(s.nodes)
        if self.gpus_per_node is not None and not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise PlanError(f"gpus_per_node must be a positive integer or None, got {self.gpus_per_node!r}")
        links = self.links()
        for s in self.stages:
            crosses = not s.is_last and bool(links.crosses(self.first_device(s), s.replicas))
            if s.crosses_nodes != crosses:
                raise PlanError(f"stage {s.index}: crosses_nodes is {s.crosses_nodes} but its last device and the "
                                f"next stage's first sit on {'two nodes' if crosses else 'one node'} (gpus_per_node="
                                f"{self.gpus_per_node}); set crosses_nodes: {str(crosses).lower()}")
        if len(self.device_speeds) != len(self.stages):
            raise PlanError(f"device_speeds has {len(self.device_speeds)} entries for {len(self.stages)} stages")
        unknown_cuts = [c for c in self.cuts if c not in self.legal_cuts]
        if unknown_cuts:
            raise PlanError(f"cut(s) {unknown_cuts} are not among the plan's legal cuts")
        if self.memory_limit is not None:
            over = [s.index for s in self.stages if s.memory_bytes > self.memory_limit]
            if over:
                raise PlanError(f"stage(s) {over} exceed the memory limit of {format_bytes(self.memory_limit)}")

    def _validate_checkpoints(self, s: StagePlan) -> None:
        """A stage's checkpointing fields: only under :attr:`checkpoint_activations` (``ppll``), its segments ending
        at legal cuts inside the stage, in graph order."""
        if not self.checkpoint_activations:
            if s.checkpoints or s.kept_bytes or s.recompute_cost:
                raise PlanError(f"stage {s.index}: checkpoints, kept_bytes and recompute_cost describe activation "
                                f"checkpointing, which the plan does not use (checkpoint_activations: false); set "
                                f"checkpoint_activations: true, or delete them")
            return
        if self.mode != "ppll":
            raise PlanError(f"checkpoint_activations applies to ppll plans (a stage module recomputing its forward); "
                            f"this plan's mode is {self.mode!r}: set checkpoint_activations: false")
        if not (isinstance(s.kept_bytes, int) and s.kept_bytes >= 0):
            raise PlanError(f"stage {s.index}: kept_bytes must be a non-negative integer, got {s.kept_bytes!r}")
        if not (isinstance(s.recompute_cost, (int, float)) and math.isfinite(s.recompute_cost)
                and s.recompute_cost >= 0):
            raise PlanError(f"stage {s.index}: recompute_cost must be a finite non-negative number of seconds, got "
                            f"{s.recompute_cost!r}")
        legal = set(self.legal_cuts)
        inside = [n for n in s.nodes[:-1] if n in legal]
        wrong = [c for c in s.checkpoints if c not in inside]
        if wrong:
            raise PlanError(f"stage {s.index}: checkpoints {wrong} are not legal cuts inside the stage; its segments "
                            f"may end at {inside or 'none (the whole block is one segment: checkpoints: [])'}")
        if list(s.checkpoints) != [c for c in inside if c in s.checkpoints]:
            raise PlanError(f"stage {s.index}: checkpoints {list(s.checkpoints)} are not in graph order (or repeat "
                            f"one); list them as the stage's nodes order them")


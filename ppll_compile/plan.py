"""The frozen, printable, serialisable pipeline plan that every later step consumes."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from partitioners.replicas import allreduce_seconds

from .errors import PlanError

__all__ = [
    "PLAN_VERSION",
    "FrozenDict",
    "TensorSpec",
    "HeadSpec",
    "StagePlan",
    "BlockPlan",
    "Plan",
    "MODES",
    "DEVICE_TYPES",
    "device_problem",
    "read_plan_text",
    "format_bytes",
    "format_flops",
]

PLAN_VERSION = 1
MODES = ("ppll", "pipebd")
"""Plan kinds: local learning with aux heads, and blockwise distillation from a teacher."""
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""The kinds of device a stage may run on."""


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


class FrozenDict(Mapping[str, Any]):
    """A read-only, hashable mapping: a head or loss config inside a frozen plan (nested mappings frozen too)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), /) -> None:
        self._data = {k: _frozen(v) for k, v in dict(data).items()}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return FrozenDict, (self.to_dict(),)

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenDict:
        return self

    def to_dict(self) -> dict[str, Any]:
        """A plain, mutable copy (nested values too), e.g. for JSON or YAML."""
        return {k: _thawed(v) for k, v in self._data.items()}


def _frozen(v: Any) -> Any:
    if isinstance(v, Mapping):
        return FrozenDict(v)
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


def _thawed(v: Any) -> Any:
    if isinstance(v, FrozenDict):
        return v.to_dict()
    if isinstance(v, tuple):
        return [_thawed(x) for x in v]
    return v


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Shape, dtype and size of one value that crosses a stage boundary."""

    name: str
    """Name of the traced graph node that produces the value."""
    shape: tuple[int, ...]
    """Tensor shape at the planned batch size (empty for a Python scalar)."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``float32``; ``int`` for a Python scalar."""
    bytes: int
    """Size in bytes (0 for a Python scalar)."""
    layout: str = ""
    """How the dimensions are laid out where the rank does not say it: ``channels_last`` for an
    ``N x H x W x C`` map (found from the graph); ``""`` for the rank's usual meaning."""

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes}
        return {**d, "layout": self.layout} if self.layout else d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(name=str(d["name"]), shape=tuple(int(s) for s in d["shape"]),
                   dtype=str(d["dtype"]), bytes=int(d["bytes"]), layout=str(d.get("layout", "")))


@dataclass(frozen=True, kw_only=True)
class HeadSpec:
    """The auxiliary head a stage trains on, as chosen by a policy (or edited by hand)."""

    policy: str
    """Name of the policy the head came from (``model`` for the model's own head)."""
    kind: str
    """Boundary tensor kind: ``feature_map``, ``sequence``, ``vector`` or ``model``."""
    config: Mapping[str, Any]
    """Head architecture and loss: ``type`` plus its options, exactly as the policy file spells them (read-only)."""
    param_count: int = 0
    """Number of parameters of the synthesised head."""
    flops_fwd: int = 0
    """Measured forward FLOPs of the head at the planned batch size."""
    flops_bwd: int = 0
    """Measured backward FLOPs of the head."""
    memory_bytes: int = 0
    """Parameters + gradients + optimizer state + saved activations of the head, in bytes."""
    input_saved_bytes: int = 0
    """Of its saved activations, the bytes of its input (the stage's output, which the stage may save already)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", FrozenDict(self.config))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "config": self.config.to_dict()}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadSpec:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: a contiguous run of graph nodes on one device, with its head and boundary."""

    index: int
    """Position of the stage in the pipeline, from 0."""
    device: str
    """Device the stage runs on, e.g. ``cuda:1`` or ``cpu``."""
    first_node: str
    """Name of the first traced node of the stage."""
    last_node: str
    """Name of the last traced node of the stage: the cut (for every stage but the last)."""
    first_module: str
    """Module path of the first node (``""`` for a function call at the top level)."""
    last_module: str
    """Module path of the last node."""
    nodes: tuple[str, ...]
    """Names of all traced nodes of the stage, in graph order."""
    flops_fwd: int
    """Measured forward FLOPs of the stage's backbone at the planned batch size."""
    flops_bwd: int
    """Measured backward FLOPs of the stage's backbone."""
    aux_flops: int
    """Forward + backward FLOPs of the stage's auxiliary head (0 for the last stage)."""
    param_count: int
    """Number of backbone parameters of the stage."""
    param_bytes: int
    """Bytes of backbone parameters."""
    grad_bytes: int
    """Bytes of backbone gradients."""
    optim_bytes: int
    """Bytes of optimizer state for the backbone parameters."""
    activation_bytes: int
    """Bytes the backbone saves for backward (measured with saved-tensor hooks)."""
    memory_bytes: int
    """Predicted peak memory: backbone + head parameters, gradients, optimizer state and activations."""
    boundary: tuple[TensorSpec, ...]
    """Values sent to the next stage, the main tensor (read by the aux head) first; empty for the last stage."""
    head: HeadSpec
    """The stage's auxiliary head; for the last stage the model's own head (``kind == "model"``)."""
    compute_cost: float
    """Backbone + head compute time in seconds on this stage's device."""
    comm_cost: float
    """Time in seconds to send the boundary to the next stage."""
    cost: float
    """Predicted step time of the stage in seconds: ``compute_cost + comm_cost`` (over its replicas)."""
    step_cost: float = 0.0
    """Seconds of the stage's optimizer step (backbone and head), part of :attr:`compute_cost`."""
    replicas: int = 1
    """Devices that run the stage data-parallel, each on a slice of the batch (gradients all-reduced)."""
    blocks: tuple[int, ...] = ()
    """``pipebd``: the distillation blocks the stage trains (indices into :attr:`Plan.blocks`)."""

    @property
    def is_last(self) -> bool:
        return not self.boundary

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["nodes"] = list(self.nodes)
        d["blocks"] = list(self.blocks)
        d["boundary"] = [t.to_dict() for t in self.boundary]
        d["head"] = self.head.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StagePlan:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or _required(f)}
        kw["nodes"] = tuple(d["nodes"])
        kw["blocks"] = tuple(int(b) for b in d.get("blocks", ()))
        kw["boundary"] = tuple(TensorSpec.from_dict(t) for t in d["boundary"])
        kw["head"] = HeadSpec.from_dict(d["head"])
        return cls(**kw)


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """``pipebd``: one aligned pair of teacher and student blocks; the student block learns the teacher block."""

    index: int
    """Position of the block, from 0."""
    teacher_nodes: tuple[str, ...]
    """Traced nodes of the teacher block, in graph order."""
    student_nodes: tuple[str, ...]
    """Traced nodes of the student block, in graph order."""
    teacher_module: str
    """Module path of the teacher block's last node (``""`` for a top-level function call)."""
    student_module: str
    """Module path of the student block's last node."""
    output: TensorSpec
    """The teacher's output of the block: the student block's target and the next block's input."""
    teacher_flops: int
    """Forward FLOPs of the teacher block."""
    flops_fwd: int
    """Forward FLOPs of the student block."""
    flops_bwd: int
    """Backward FLOPs of the student block."""
    param_count: int
    """Parameters of the student block."""
    teacher_param_count: int
    """Parameters of the teacher block (frozen)."""
    memory_bytes: int
    """Teacher parameters + student parameters, gradients, optimizer state and saved activations, in bytes."""
    grad_bytes: int
    """Bytes of the student block's gradients (what a replicated stage all-reduces)."""
    loss: Mapping[str, Any]
    """The block's distillation loss, e.g. ``{"type": "mse"}`` or ``{"type": "kl", "temperature": 4.0}`` (read-only)."""
    cost: float
    """Teacher forward + student forward, backward and step time of the block in seconds, at the full batch."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", FrozenDict(self.loss))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["teacher_nodes"], d["student_nodes"] = list(self.teacher_nodes), list(self.student_nodes)
        d["output"] = self.output.to_dict()
        d["loss"] = self.loss.to_dict()  # type: ignore[attr-defined]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockPlan:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls)}
        kw["teacher_nodes"], kw["student_nodes"] = tuple(d["teacher_nodes"]), tuple(d["student_nodes"])
        kw["output"] = TensorSpec.from_dict(d["output"])
        return cls(**kw)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@dataclass(frozen=True, kw_only=True)
class Plan:
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
    flops_per_second: float
    """Device throughput used to turn FLOPs into seconds (profile ``flops``)."""
    link_bandwidth: float
    """Bytes per second between neighbouring stages."""
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

    def allreduce_cost(self, stage: StagePlan, link_bandwidth: float | None = None) -> float:
        """Seconds per batch of ``stage``'s ring all-reduce over its replicas (0 for one), ``2 (r-1)/r`` times its
        gradient bytes (backbone, plus a ``ppll`` stage's aux head) over ``link_bandwidth`` (default: the plan's);
        part of the stage's ``compute_cost``."""
        r = stage.replicas
        head = stage.head.param_count * 4 if self.mode == "ppll" and not stage.is_last else 0  # float32 heads
        return allreduce_seconds(stage.grad_bytes + head, r, link_bandwidth or self.link_bandwidth)

    def totals(self) -> dict[str, float]:
        return {
            "bottleneck_cost": self.bottleneck_cost,
            "ideal_cost": self.ideal_cost,
            "imbalance": self.imbalance,
            "predicted_speedup": self.predicted_speedup,
            "sequential_cost": self.sequential_cost,
        }

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("inputs", "stages", "blocks"):
                v = [t.to_dict() for t in v]
            elif isinstance(v, FrozenDict):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            d[f.name] = v
        d["totals"] = self.totals()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a mapping, got {type(d).__name__}")
        version = d.get("version")
        if version != PLAN_VERSION:
            raise PlanError(f"plan version {version!r} is not supported; this ppll-compile reads version "
                            f"{PLAN_VERSION} (re-create the plan with `ppll-plan MODEL.py --yaml plan.yaml`)")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"totals"})
        if unknown:
            raise PlanError(f"unknown plan field(s) {unknown}; known fields: {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in d and _required(f))
        if missing:
            raise PlanError(f"plan is missing field(s) {missing}")
        kw: dict[str, Any] = {}
        for k in names & set(d):
            v = d[k]
            if k in ("inputs", "stages", "blocks"):
                item = {"inputs": TensorSpec, "stages": StagePlan, "blocks": BlockPlan}[k]
                try:
                    v = tuple(item.from_dict(s) for s in v)
                except KeyError as e:
                    raise PlanError(f"an entry of the plan's {k} is missing field {e.args[0]!r}") from None
            elif isinstance(v, list):
                v = tuple(v)
            kw[k] = v
        plan = cls(**kw)
        plan.validate()
        return plan

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        return cls.from_dict(yaml.safe_load(text))

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON or YAML, chosen by the file suffix."""
        path = Path(path)
        text = self.to_json() if path.suffix == ".json" else self.to_yaml()
        path.write_text(text)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save` (JSON or YAML)."""
        path = Path(path)
        text = read_plan_text(path)
        try:
            return cls.from_json(text) if path.suffix == ".json" else cls.from_yaml(text)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None
        except (ValueError, TypeError, OverflowError, yaml.YAMLError) as e:
            raise PlanError(f"{path}: not a readable plan ({e})") from None

    def validate(self) -> None:
        """Check internal consistency; raise :class:`PlanError` naming the first problem."""
        if not self.stages:
            raise PlanError("plan has no stages")
        if self.mode not in MODES:
            raise PlanError(f"plan mode {self.mode!r} is not known; modes: {', '.join(MODES)}")
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
        seen: set[str] = set()
        for s in self.stages:
            dup = seen.intersection(s.nodes)
            if dup:
                raise PlanError(f"node(s) {sorted(dup)} appear in more than one stage")
            seen.update(s.nodes)
        if len(self.device_speeds) != len(self.stages):
            raise PlanError(f"device_speeds has {len(self.device_speeds)} entries for {len(self.stages)} stages")
        unknown_cuts = [c for c in self.cuts if c not in self.legal_cuts]
        if unknown_cuts:
            raise PlanError(f"cut(s) {unknown_cuts} are not among the plan's legal cuts")
        if self.memory_limit is not None:
            over = [s.index for s in self.stages if s.memory_bytes > self.memory_limit]
            if over:
                raise PlanError(f"stage(s) {over} exceed the memory limit of {format_bytes(self.memory_limit)}")

    def table(self) -> str:
        """The stage table and totals as plain aligned text."""
        header = ["stage", "device", "first", "last", "nodes", "params", "fwd", "bwd",
                  "teacher" if self.blocks else "aux",
                  "memory", "boundary", "head", "cost ms"]
        rows = []
        b = self.bottleneck_stage
        for s in self.stages:
            bnd = " + ".join("x".join(map(str, t.shape)) or "int" for t in s.boundary) or "-"
            head = s.head.config.get("type", "?") if s.head.kind != "model" else "model"
            rows.append([
                f"{s.index}{'*' if s.index == b else ''}",
                s.device + (f" x{s.replicas}" if s.replicas > 1 else ""), s.first_module or s.first_node,
                s.last_module or s.last_node, str(len(s.nodes)), f"{s.param_count / 1e6:.2f}M",
                format_flops(s.flops_fwd), format_flops(s.flops_bwd), format_flops(s.aux_flops),
                format_bytes(s.memory_bytes), bnd, head, f"{s.cost * 1e3:.3f}",
            ])
        teacher = f" from teacher {self.teacher} ({len(self.blocks)} blocks)" if self.blocks else ""
        lines = [
            f"{self.mode.upper()} plan for {self.model}{teacher}: {len(self.stages)} stages on "
            f"{self.world_size} devices, batch {self.batch_size}, policy {self.policy}, partitioner "
            f"{self.partitioner}, profile {self.profile}",
            _aligned(header, rows, right={4, 5, 6, 7, 8, 9, 12}),
            f"bottleneck {self.bottleneck_cost * 1e3:.3f} ms (stage {b}, marked *)  "
            f"ideal {self.ideal_cost * 1e3:.3f} ms  imbalance {self.imbalance:.3f}  "
            f"predicted speedup {self.predicted_speedup:.2f}x over sequential "
            f"({self.sequential_cost * 1e3:.3f} ms)",
            f"{len(self.legal_cuts)} legal cuts; costs {self._cost_basis()}, "
            f"{format_bytes(self.link_bandwidth)}/s links, optimizer {self.optimizer}"
            + (f", memory limit {format_bytes(self.memory_limit)}" if self.memory_limit else ""),
        ]
        if self.blocks:
            lines += ["", self.block_table()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _cost_basis(self) -> str:
        if self.profile == "roofline":
            return f"in seconds of {self.calibration.get('device', 'the device')} (roofline, step included)"
        if self.profile == "time":
            return "measured on the device"
        return f"assume {format_flops(self.flops_per_second)}/s per device"

    def block_table(self) -> str:
        """``pipebd``: each block's teacher and student ends, the teacher output it learns, and its loss."""
        stage_of = {b: s.index for s in self.stages for b in s.blocks}
        header = ["block", "stage", "teacher ends at", "student ends at", "output", "teacher fwd", "student fwd",
                  "params", "loss", "cost ms"]
        rows = [[str(k.index), str(stage_of[k.index]), k.teacher_module or k.teacher_nodes[-1],
                 k.student_module or k.student_nodes[-1], "x".join(map(str, k.output.shape)),
                 format_flops(k.teacher_flops), format_flops(k.flops_fwd), f"{k.param_count / 1e6:.2f}M",
                 " ".join(f"{key}={v}" if key != "type" else str(v) for key, v in k.loss.items()),
                 f"{k.cost * 1e3:.3f}"] for k in self.blocks]
        return _aligned(header, rows, right={5, 6, 7, 9})

    def __str__(self) -> str:
        return self.table()


def read_plan_text(path: Path) -> str:
    """The text of the plan file ``path``; a :class:`PlanError` says why it cannot be read."""
    if path.is_dir():
        raise PlanError(f"plan file {str(path)!r} is a directory; pass the path of a plan file written by "
                        f"`ppll-plan MODEL.py --yaml plan.yaml` (or --json)")
    if not path.is_file():
        raise PlanError(f"plan file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{path}: not a plan file (byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8 "
                        f"text); pass a plan written by `ppll-plan MODEL.py --yaml plan.yaml` (or --json)") from None
    except OSError as e:
        raise PlanError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None


def _aligned(header: list[str], rows: list[list[str]], *, right: set[int]) -> str:
    """A text table: the header, a rule, the rows; columns in ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [header, ["-" * w for w in widths], *rows])


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """Human-readable FLOP count, e.g. ``2.3G``."""
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.0f}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")

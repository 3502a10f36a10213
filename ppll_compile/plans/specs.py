"""The frozen parts of a plan: the values crossing a boundary, heads, stages and distillation blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

PYTHON_SCALARS = ("int", "float", "bool")
"""The ``TensorSpec.dtype`` names of Python numbers that cross a cut beside the tensors."""


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
    scalar: bool | None = None
    """Whether the value is a Python number (``dtype`` ``int``, ``float`` or ``bool``) rather than a tensor, as the
    captured graph produced it (so a ``bool`` tensor, a mask, is never taken for a Python ``bool``). ``None`` (a spec
    written by hand, or a plan file without the field): a Python number exactly when it has no shape and 0 bytes,
    since a tensor has at least one element's bytes."""

    def __post_init__(self) -> None:
        if self.scalar is None:
            object.__setattr__(self, "scalar", self.dtype in PYTHON_SCALARS and not self.shape and not self.bytes)
        if self.scalar and (self.dtype not in PYTHON_SCALARS or self.shape or self.bytes):
            raise ValueError(f"boundary value {self.name!r} is marked a Python scalar but has dtype {self.dtype!r}, "
                             f"shape {list(self.shape)} and {self.bytes} bytes; a Python scalar has a dtype of "
                             f"{', '.join(PYTHON_SCALARS)}, no shape and 0 bytes")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes}
        if self.layout:
            d["layout"] = self.layout
        return {**d, "scalar": True} if self.scalar else d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(name=str(d["name"]), shape=tuple(int(s) for s in d["shape"]), dtype=str(d["dtype"]),
                   bytes=int(d["bytes"]), layout=str(d.get("layout", "")),
                   scalar=bool(d["scalar"]) if "scalar" in d else None)


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
    scores_bytes: int = 0
    """Bytes of one copy of the scores its loss reads (N x C, or N x L x C per token) at the planned batch; its
    :attr:`memory_bytes` counts their gradient beside what its loss saves (the last stage's: the output too). 0 for
    a head whose type computes its own loss, and in plans made before it was counted."""

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
    """Predicted peak memory: backbone + head parameters, gradients, optimizer state and activations (the last
    stage's head: its loss on the model's output; by part: :func:`~ppll_compile.plans.report.memory_split`)."""
    boundary: tuple[TensorSpec, ...]
    """Values sent to the next stage, the main tensor (read by the aux head) first; empty for the last stage."""
    head: HeadSpec
    """The stage's auxiliary head; for the last stage the model's own head (``kind == "model"``), costed as its
    default loss on the model's output."""
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
    crosses_nodes: bool = False
    """Whether its boundary goes to another node (its last device and the next stage's first sit on two nodes)."""
    head_cost: float = 0.0
    """Seconds per batch of its head (``ppll``: the auxiliary head, or the last stage's loss on the model's output)
    forward, backward and optimizer step, part of :attr:`compute_cost` (over its replicas); 0 for ``pipebd`` and
    in plans made before it was recorded."""
    checkpoints: tuple[str, ...] = ()
    """Under :attr:`Plan.checkpoint_activations`: the legal cuts inside the stage, in graph order, where its block is
    split into the segments that backward recomputes one by one (empty: the whole block is one segment)."""
    kept_bytes: int = 0
    """Under :attr:`Plan.checkpoint_activations`: the bytes the stage keeps from its forward to its backward, the
    inputs of its checkpointed segments (each value once); :attr:`activation_bytes` adds its largest segment's
    activations, held while backward recomputes it. 0 without checkpointing."""
    recompute_cost: float = 0.0
    """Under :attr:`Plan.checkpoint_activations`: seconds per batch of the forward that backward runs again, part of
    :attr:`compute_cost` (over its replicas); 0 without checkpointing."""

    @property
    def is_last(self) -> bool:
        return not self.boundary

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["nodes"] = list(self.nodes)
        d["blocks"] = list(self.blocks)
        d["boundary"] = [t.to_dict() for t in self.boundary]
        d["head"] = self.head.to_dict()
        if not (self.checkpoints or self.kept_bytes or self.recompute_cost):  # no checkpointing: as before it existed
            for name in ("checkpoints", "kept_bytes", "recompute_cost"):
                d.pop(name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StagePlan:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or required(f)}
        kw["nodes"] = tuple(d["nodes"])
        kw["blocks"] = tuple(int(b) for b in d.get("blocks", ()))
        kw["checkpoints"] = tuple(str(c) for c in d.get("checkpoints", ()))
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


def required(f: dataclasses.Field) -> bool:
    """Whether a dataclass field has no default (a plan file must give it)."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """Robust wall time of one candidate stage's training step, as :func:`time_stages` measures it."""

    seconds: float
    """Forward, local loss, backward and optimizer step (with ``zero_grad``): the least of the rounds' medians."""
    step_seconds: float
    """Of those, the optimizer step and ``zero_grad`` alone (the same statistic over their own samples)."""
    spread: float
    """How far the rounds' medians of :attr:`seconds` lie apart: ``max / min - 1`` (0 for one round)."""

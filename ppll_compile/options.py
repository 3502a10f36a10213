"""Every choice that shapes a plan, checked: ``PlanOptions``, and a saved plan's settings re-applied as defaults."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ppll_compile import partitioners
from ppll_compile.partitioners.objective import Links

from .cost.hardware import hardware_defaults, load_hardware
from .cost.optimizers import OPTIMIZER_STATES
from .errors import PartitionError, PlanError
from .heads.policy import check_plan_heads
from .plans.file import read_plan_document
from .plans.plan import MODES, PLAN_VERSION, Plan, TensorSpec, device_problem
from .plans.precision import FUSIONS, default_fusion, precision_spec

DEFAULT_FLOPS_PER_SECOND = 1e13
"""Sustained training throughput assumed per device when costs are counted in FLOPs (10 TFLOP/s)."""
DEFAULT_LINK_BANDWIDTH = 25e9
"""Bytes per second assumed between neighbouring stages (about PCIe 4.0 x16)."""
PROFILES = ("roofline", "flops", "time")
TIED = ("auto", "error", "untie")
"""What to do with a parameter that stages on both sides of a cut use (see :attr:`PlanOptions.tied`)."""
TRACERS = ("auto", "fx", "export")
"""``fx``: symbolic tracing; ``export``: ``torch.export``; ``auto``: symbolic tracing, else ``torch.export``."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Every choice that shapes a plan; ``ppll-plan`` flags map onto these one to one."""

    gpus: int | None = None
    """Number of devices (= stages); defaults to ``len(devices)`` or the number of ``split_points`` + 1."""
    devices: tuple[str, ...] | None = None
    """Explicit device per stage, e.g. ``("cuda:0", "cuda:1")``; overrides the ``cuda:i`` default."""
    batch_size: int | None = None
    """Batch size the costs are measured at; defaults to the example inputs' batch dimension."""
    policy: Any = "auto"
    """Aux-head policy: a shipped name, a YAML path, or a callable ``fn(spec, num_classes) -> nn.Module``."""
    partitioner: str = "exact"
    """Partitioner name: ``exact`` or a baseline (``uniform``, ``greedy``, ``params``)."""
    profile: str = "roofline"
    """``roofline`` (every operator's FLOPs and bytes, counted on fake tensors, over the first device's calibrated
    figures, plus the optimizer step: seconds of that device), ``flops`` (counted FLOPs over ``flops_per_second``)
    or ``time`` (measured on the first stage's device)."""
    optimizer: str = "sgd"
    """Optimizer whose state the memory model counts: ``sgd``, ``momentum`` or ``adam``."""
    memory_limit: int | None = None
    """Per-device memory cap in bytes."""
    device_speeds: tuple[float, ...] | None = None
    """Relative speed per device (heterogeneous devices); 1.0 each by default."""
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH
    """Bytes per second between neighbouring stages."""
    gpus_per_node: int | None = None
    """Devices per node: stage replicas take consecutive devices, device ``d`` on node ``d // gpus_per_node``;
    ``None``: one node."""
    intra_node_bandwidth: float | None = None
    """Bytes per second of a link inside a node (``None``: ``link_bandwidth``)."""
    inter_node_bandwidth: float | None = None
    """Bytes per second of a link across nodes (``None``: ``link_bandwidth``); needs ``gpus_per_node``."""
    flops_per_second: float = DEFAULT_FLOPS_PER_SECOND
    """Device throughput that turns FLOPs into seconds (profile ``flops``)."""
    leaf_modules: tuple[Any, ...] = ()
    """Extra module names or types to keep opaque while tracing (``tracer='fx'``)."""
    tracer: str = "auto"
    """How the model is captured: ``fx`` (symbolic tracing), ``export`` (``torch.export``) or ``auto``
    (symbolic tracing, else ``torch.export``)."""
    tied: str = "auto"
    """A parameter that stages on both sides of a cut would use (tied input and output embeddings, a module called
    at two depths): ``error`` drops such cuts and refuses a plan that then lacks cuts, naming the parameter and the
    ways out; ``untie`` may cut there, and each later stage that uses the parameter trains its own copy (the model
    keeps the first stage's); ``auto`` (default) drops such cuts when enough others are left, else unties, with a
    note and a warning naming the parameters."""
    bake_train_mode: bool = False
    """Accept a model whose own ``forward`` branches on ``self.training``: the train branch is kept in eval too."""
    split_points: tuple[str, ...] | None = None
    """Cut by hand after these modules (or nodes), instead of running the partitioner."""
    num_classes: int | None = None
    """Classes the aux heads predict; inferred from a 2-D model output when omitted."""
    replicas: bool | int | tuple[int, ...] | None = None
    """Data-parallel replicas per stage: ``True`` lets the exact partitioner choose stages and replicas for
    ``gpus`` devices, an int also caps the replicas of a stage, a tuple fixes them per stage (the cuts come
    from ``split_points`` or the partitioner); ``False`` (``None``: the PPLL default) means one device per
    stage. ``pipebd`` plans default to ``True``."""
    hardware: str | None = None
    """The devices the plan is made for (:mod:`~ppll_compile.cost.hardware`): a preset (``h100``, ``h200``,
    ``a100-80gb``, ``a100-40gb``, ``l40s``, ``mi300x``: priced from the vendor's figures, nothing timed here;
    ``cpu``: this machine, calibrated) or a JSON figures file; its memory per device is the default
    ``memory_limit`` and its intra-node link the default ``link_bandwidth``. ``None``: this machine's figures
    (the first device's, calibrated), no default cap."""
    precision: str = "fp32"
    """The precision the model trains in (:mod:`~ppll_compile.plans.precision`): ``fp32`` (default), ``bf16`` or ``fp16``
    (mixed precision as ``torch.autocast`` runs it: low-precision compute and activations, float32 weights, gradients
    and optimizer state), or ``bf16-pure`` (everything bfloat16); the costs, the memory, the boundaries and the
    trainer's autocast follow it."""
    fusion: str | None = None
    """How element-wise chains are priced: ``eager`` (one operator at a time, as PyTorch runs a model that is not
    compiled) or ``fused`` (one kernel per chain, as ``torch.compile`` runs it; see :mod:`~ppll_compile.cost.reprice`);
    ``None``: ``fused`` for a low precision, ``eager`` for ``fp32``."""
    frozen: tuple[str, ...] = ()
    """Parameters (names as ``model.named_parameters()`` gives them, or a module's name for every parameter under it)
    accepted as never trained: a plan refuses a stage holding a trainable parameter that no loss of that stage reaches
    (its value crosses the cut beside the tensor the head reads) unless it is named here; the plan's notes list the
    ones it accepts (see :mod:`~ppll_compile.analysis.reach`)."""
    checkpoint_activations: bool = False
    """Recompute every stage's activations in its backward instead of keeping them from its forward (activation
    checkpointing between the legal cuts inside a stage): less activation memory, one more forward per step; the
    plan's memory and time count it."""

    def __post_init__(self) -> None:
        for name in ("gpus", "batch_size", "memory_limit", "num_classes", "gpus_per_node"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.tracer not in TRACERS:
            raise ValueError(f"tracer must be one of {', '.join(TRACERS)}, got {self.tracer!r}")
        if self.tied not in TIED:
            raise ValueError(f"tied must be one of {', '.join(map(repr, TIED))}, got {self.tied!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.partitioner not in partitioners.SOLVERS:
            raise PartitionError(f"unknown partitioner {self.partitioner!r}; known partitioners: "
                                 f"{', '.join(sorted(partitioners.SOLVERS))}")
        for name in ("link_bandwidth", "flops_per_second"):
            if not _positive_number(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(self, name) is not None and not _positive_number(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number of bytes per second or None, got "
                                 f"{getattr(self, name)!r}")
        if self.inter_node_bandwidth is not None and self.gpus_per_node is None:
            raise ValueError(f"inter_node_bandwidth={self.inter_node_bandwidth!r} prices links across nodes, but "
                             "gpus_per_node is not given (one node); set gpus_per_node=N or drop "
                             "inter_node_bandwidth")
        if self.gpus is not None:
            self.check_nodes(self.gpus)
        if self.device_speeds is not None and not all(_positive_number(s) for s in self.device_speeds):
            raise ValueError(f"device_speeds must all be positive numbers, got {list(self.device_speeds)}")
        for i, device in enumerate(self.devices or ()):
            problem = device_problem(device)
            if problem is not None:
                raise ValueError(f"devices[{i}]: {problem}")
        r = self.replicas
        if not (r is None or isinstance(r, bool) or (isinstance(r, int) and r >= 1) or (
                isinstance(r, tuple) and r and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                   for v in r))):
            raise ValueError(f"replicas must be True, False, a positive cap per stage, or one positive count per "
                             f"stage; got {r!r}")
        if self.replicated and self.device_speeds is not None:
            raise ValueError("replicated stages split the batch evenly over identical devices; drop device_speeds "
                             "or replicas")
        if self.hardware is not None:
            if not isinstance(self.hardware, str) or not self.hardware:
                raise ValueError(f"hardware must be a preset name or a figures file's path, got {self.hardware!r}")
            if not load_hardware(self.hardware).local and self.profile == "time":
                raise ValueError(f"profile='time' times the stages on this machine, but hardware={self.hardware!r} "
                                 f"plans for other devices; use profile='roofline' (the default) to price them "
                                 f"with its figures, or drop hardware= to time them here")
        precision_spec(self.precision)
        if self.fusion is not None and self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)} or None (fused for a low precision, eager "
                             f"for fp32), got {self.fusion!r}")
        if self.precision != "fp32" and self.profile == "time":
            raise ValueError(f"profile='time' times the stages on this machine in float32, but "
                             f"precision={self.precision!r} plans for another precision; use profile='roofline' (the "
                             f"default) to price them in it, or drop precision=")
        if not all(isinstance(n, str) and n for n in self.frozen):
            raise ValueError(f"frozen must list parameter or module names (strings), got {list(self.frozen)!r}; e.g. "
                             f"frozen=['encoder.pos_embed']")
        if not isinstance(self.checkpoint_activations, bool):
            raise ValueError(f"checkpoint_activations must be True or False, got {self.checkpoint_activations!r}")
        if self.replicas_chosen and self.partitioner != "exact":
            raise ValueError(f"replicas={r!r} lets the exact partitioner place replicas; drop "
                             f"partitioner={self.partitioner!r}")

    def links(self) -> Links:
        """The devices per node and the bandwidths of the links inside and across nodes that the partitioner, the
        plan and the simulator price sends and all-reduces with: the ones given, else ``link_bandwidth`` (the one
        place that resolves them)."""
        return Links(gpus_per_node=self.gpus_per_node,
                     intra=float(self.intra_node_bandwidth or self.link_bandwidth),
                     inter=float(self.inter_node_bandwidth or self.link_bandwidth))

    @property
    def topology(self) -> dict[str, Any]:
        """What a plan records of the nodes: ``gpus_per_node`` and the resolved bandwidths (all ``None`` when no
        topology is given)."""
        if self.gpus_per_node is None and self.intra_node_bandwidth is None:
            return {"gpus_per_node": None, "intra_node_bandwidth": None, "inter_node_bandwidth": None}
        links = self.links()
        return {"gpus_per_node": links.gpus_per_node, "intra_node_bandwidth": links.intra,
                "inter_node_bandwidth": links.inter if links.gpus_per_node else None}

    def check_nodes(self, devices: int) -> None:
        """Raise unless ``devices`` (every stage's replicas together) fill whole nodes of ``gpus_per_node``."""
        g = self.gpus_per_node
        if g is None or devices % g == 0:
            return
        lower, upper = devices // g * g, (devices // g + 1) * g
        choices = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(f"gpus={devices} is not a multiple of gpus_per_node={g}: the devices must fill whole nodes; "
                         f"plan for {choices} devices, or set gpus_per_node to the devices each node gives the "
                         f"pipeline")

    @property
    def fused(self) -> str:
        """How element-wise chains are priced: :attr:`fusion`, else the precision's default."""
        return self.fusion or default_fusion(self.precision)

    @property
    def replicas_chosen(self) -> bool:
        """Whether the partitioner chooses the stages and their replicas (``replicas`` is True or a cap)."""
        return isinstance(self.replicas, int) and (self.replicas is True or not isinstance(self.replicas, bool))

    @property
    def replicated(self) -> bool:
        """Whether a stage may run on more than one device."""
        r = self.replicas
        if isinstance(r, tuple):
            return any(v > 1 for v in r)
        return r is True or (self.replicas_chosen and r > 1)

    @classmethod
    def make(cls, **kwargs: Any) -> PlanOptions:
        """Build options from keyword arguments, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; known options: {sorted(known)}")
        if isinstance(kwargs.get("hardware"), Path):
            kwargs["hardware"] = str(kwargs["hardware"])
        if isinstance(kwargs.get("replicas"), list):
            kwargs["replicas"] = tuple(kwargs["replicas"])
        for name in ("devices", "device_speeds", "leaf_modules", "split_points", "frozen"):
            v = kwargs.get(name)
            if v is None:
                continue
            if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
                raise TypeError(f"{name} must be a list with one entry per item, got {v!r}; e.g. {name}=[{v!r}]")
            kwargs[name] = tuple(v)
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class SavedPlan:
    """What a saved (possibly hand-edited) plan fixes: its cuts and heads, the inputs and settings it was made for."""

    source: str
    """Where the plan came from, for error messages."""
    inputs: tuple[TensorSpec, ...]
    """The model inputs the plan was made for."""
    cuts: tuple[str, ...]
    """``last_node`` of every stage but the last: the only field to edit to move a cut."""
    heads: tuple[dict[str, Any], ...]
    """Head config of every stage but the last."""
    settings: dict[str, Any]
    """The plan's :class:`PlanOptions` values (devices, policy, optimizer, ...), the defaults for re-planning."""
    mode: str = "ppll"
    """The plan's kind."""
    blocks: tuple[tuple[str, str], ...] | None = None
    """``pipebd``: the (teacher, student) node where every block but the last ends."""


_CARRIED = ("batch_size", "num_classes", "policy", "profile", "optimizer", "memory_limit", "device_speeds",
            "link_bandwidth", "flops_per_second", "hardware", "gpus_per_node", "intra_node_bandwidth",
            "inter_node_bandwidth", "precision", "fusion", "frozen", "checkpoint_activations")


def read_saved_plan(plan: Plan | str | Path | None) -> SavedPlan | None:
    """Read the parts of a plan that a user may edit by hand; derived fields (nodes, costs) are ignored."""
    if plan is None:
        return None
    if isinstance(plan, Plan):
        d, source = plan.to_dict(), "plan"
    else:
        source = str(plan)
        d = read_plan_document(plan)  # its sizes checked, bounded and not nested too deep
        check_plan_heads(d, source)
    if not isinstance(d, dict) or d.get("version") != PLAN_VERSION:
        raise PlanError(f"{source}: not a version-{PLAN_VERSION} plan (re-create it with `ppll-plan MODEL.py "
                        "--yaml plan.yaml`)")

    def get(obj: dict[str, Any], key: str, where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise PlanError(f"{source}: {where} has no {key!r}")
        return obj[key]

    stages = get(d, "stages", "the plan")
    if not isinstance(stages, list) or not stages:
        raise PlanError(f"{source}: 'stages' must be a non-empty list")
    try:
        settings = {k: d[k] for k in _CARRIED if d.get(k) is not None}
        replicas = tuple(int(s.get("replicas", 1)) if isinstance(s, dict) else 1 for s in stages)
        distill = d.get("mode") == "pipebd"
        if distill or any(r > 1 for r in replicas):  # the devices of other replicas are not listed: default ones
            settings["replicas"] = replicas
            settings.pop("device_speeds", None)
        else:
            settings["devices"] = [str(get(s, "device", f"stages[{i}]")) for i, s in enumerate(stages)]
        blocks = None
        if distill:
            settings["split_points"] = [str(get(s, "last_node", f"stages[{i}]")) for i, s in enumerate(stages[:-1])]
            blocks = tuple((str(get(b, "teacher_nodes", f"blocks[{i}]")[-1]),
                            str(get(b, "student_nodes", f"blocks[{i}]")[-1]))
                           for i, b in enumerate(get(d, "blocks", "the plan")[:-1]))
        saved = SavedPlan(
            mode=str(d.get("mode", "ppll")), blocks=blocks,
            source=source,
            inputs=tuple(TensorSpec.from_dict(t) for t in get(d, "inputs", "the plan")),
            cuts=tuple(str(get(s, "last_node", f"stages[{i}]")) for i, s in enumerate(stages[:-1])),
            heads=tuple(dict(get(get(s, "head", f"stages[{i}]"), "config", f"stages[{i}].head"))
                        for i, s in enumerate(stages[:-1])),
            settings=settings)
        ends = [str(get(s, "last_node", f"stages[{i}]")) for i, s in enumerate(stages)]
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise PlanError(f"{source}: malformed plan field ({e})") from None
    _check_saved(saved, ends)
    return saved


def _check_saved(saved: SavedPlan, ends: list[str]) -> None:
    """A saved plan's settings, devices and stage ends (``last_node`` of every stage) checked before any planning,
    naming the file and the field."""
    source = saved.source
    for i, device in enumerate(saved.settings.get("devices", ())):
        problem = device_problem(device)
        if problem is not None:
            raise PlanError(f"{source}: stages[{i}].device: {problem}")
    try:
        PlanOptions.make(**saved.settings)
    except (ValueError, TypeError) as e:
        raise PlanError(f"{source}: {e}; fix the plan file, or re-create it with `ppll-plan MODEL.py --yaml "
                        f"plan.yaml`") from None
    first: dict[str, int] = {}
    for i, end in enumerate(ends):
        if end in first:
            raise PlanError(f"{source}: stages[{first[end]}] and stages[{i}] both end at {end!r}; every stage must "
                            f"end after the one before it: delete the duplicated stage (with its device_speeds "
                            f"entry), or move its last_node")
        first[end] = i
    speeds = saved.settings.get("device_speeds")
    if speeds is not None and len(speeds) != len(ends):
        raise PlanError(f"{source}: device_speeds lists {len(speeds)} speed(s) for {len(ends)} stages; give one "
                        f"per stage")


def resolve_options(gpus: int | None, base: SavedPlan | None, options: dict[str, Any]) -> PlanOptions:
    """Options from the call, falling back to a re-applied plan's own settings, then to the defaults of the
    hardware they name (its memory per device as ``memory_limit``, its intra-node link as ``link_bandwidth``, and
    for more devices than one of its nodes holds, its nodes and their links: see
    :func:`~ppll_compile.cost.hardware.hardware_defaults`)."""
    given = {**(base.settings if base is not None else {}), **options}
    hardware = given.get("hardware")
    devices = gpus if gpus is not None else len(given.get("devices") or ()) or None
    defaults = hardware_defaults(str(hardware) if hardware is not None else None, devices,
                                 given.get("gpus_per_node") is not None)
    return PlanOptions.make(gpus=gpus, **{**defaults, **given})


def resolve_mode(mode: str | None, teacher: nn.Module | None, base: SavedPlan | None) -> str:
    """The plan kind: asked for, the saved plan's, else ``pipebd`` with a teacher and ``ppll`` without."""
    mode = mode or (base.mode if base is not None else "pipebd" if teacher is not None else "ppll")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not known; choose one of {', '.join(MODES)}")
    if mode == "pipebd" and not isinstance(teacher, nn.Module):
        raise TypeError("mode='pipebd' distils the model from a teacher: pass teacher=<the frozen nn.Module>")
    if mode == "ppll" and teacher is not None:
        raise ValueError("a teacher is only used by mode='pipebd' (blockwise distillation); drop teacher= or "
                         "pass mode='pipebd'")
    return mode


def check_no_blocks(blocks: Any) -> None:
    """``blocks=`` belongs to ``pipebd`` plans only."""
    if blocks is not None:
        raise ValueError("blocks= aligns a teacher with a student; it needs mode='pipebd' and teacher=")

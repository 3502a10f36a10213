"""The public entry points: ``plan`` (model -> Plan) and ``compile`` (model -> CompiledPipeline)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import yaml
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import partitioners
from partitioners.replicas import ReplicaProblem, solve_fixed_replicas, solve_replicated

from . import heads as _heads
from .cost import META_KEY, OPTIMIZER_STATES, ModuleCost, measure_graph, measure_module, time_callable
from .cuts import Cut, legal_cuts
from .errors import CutError, PartitionError, PlanError, PolicyError
from .lower import split_stages
from .lowered import Inputs, Lowered
from .pipeline import CompiledPipeline
from .plan import MODES, PLAN_VERSION, HeadSpec, Plan, StagePlan, TensorSpec
from .trace import module_path, trace, train_mode

__all__ = ["PlanOptions", "plan", "compile", "DEFAULT_FLOPS_PER_SECOND", "DEFAULT_LINK_BANDWIDTH"]

DEFAULT_FLOPS_PER_SECOND = 1e13
"""Sustained training throughput assumed per device when costs are counted in FLOPs (10 TFLOP/s)."""
DEFAULT_LINK_BANDWIDTH = 25e9
"""Bytes per second assumed between neighbouring stages (about PCIe 4.0 x16)."""
PROFILES = ("flops", "time")


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
    profile: str = "flops"
    """``flops`` (counted on fake tensors, no compute) or ``time`` (measured on the first stage's device)."""
    optimizer: str = "sgd"
    """Optimizer whose state the memory model counts: ``sgd``, ``momentum`` or ``adam``."""
    memory_limit: int | None = None
    """Per-device memory cap in bytes."""
    device_speeds: tuple[float, ...] | None = None
    """Relative speed per device (heterogeneous devices); 1.0 each by default."""
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH
    """Bytes per second between neighbouring stages."""
    flops_per_second: float = DEFAULT_FLOPS_PER_SECOND
    """Device throughput that turns FLOPs into seconds (profile ``flops``)."""
    leaf_modules: tuple[Any, ...] = ()
    """Extra module names or types to keep opaque while tracing."""
    split_points: tuple[str, ...] | None = None
    """Cut by hand after these modules (or nodes), instead of running the partitioner."""
    num_classes: int | None = None
    """Classes the aux heads predict; inferred from a 2-D model output when omitted."""
    replicas: bool | int | tuple[int, ...] | None = None
    """Data-parallel replicas per stage: ``True`` lets the exact partitioner choose stages and replicas for
    ``gpus`` devices, an int also caps the replicas of a stage, a tuple fixes them per stage (the cuts come
    from ``split_points`` or the partitioner); ``False`` (``None``: the PPLL default) means one device per
    stage. ``pipebd`` plans default to ``True``."""

    def __post_init__(self) -> None:
        if self.gpus is not None and (not isinstance(self.gpus, int) or self.gpus < 1):
            raise ValueError(f"gpus must be a positive integer, got {self.gpus!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.partitioner not in partitioners.SOLVERS:
            raise PartitionError(f"unknown partitioner {self.partitioner!r}; known partitioners: "
                                 f"{', '.join(sorted(partitioners.SOLVERS))}")
        for name in ("batch_size", "memory_limit", "num_classes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("link_bandwidth", "flops_per_second"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.device_speeds is not None and not all(s > 0 for s in self.device_speeds):
            raise ValueError(f"device_speeds must all be positive, got {list(self.device_speeds)}")
        r = self.replicas
        if not (r is None or isinstance(r, bool) or (isinstance(r, int) and r >= 1) or (
                isinstance(r, tuple) and r and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                   for v in r))):
            raise ValueError(f"replicas must be True, False, a positive cap per stage, or one positive count per "
                             f"stage; got {r!r}")
        if self.replicated and self.device_speeds is not None:
            raise ValueError("replicated stages split the batch evenly over identical devices; drop device_speeds "
                             "or replicas")
        if self.replicas_chosen and self.partitioner != "exact":
            raise ValueError(f"replicas={r!r} lets the exact partitioner place replicas; drop "
                             f"partitioner={self.partitioner!r}")

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
        if isinstance(kwargs.get("replicas"), list):
            kwargs["replicas"] = tuple(kwargs["replicas"])
        for name in ("devices", "device_speeds", "leaf_modules", "split_points"):
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)


# ---- inputs ------------------------------------------------------------------------------

INFERRED_BATCH = 32
"""Batch size of an inferred example input (override with ``batch_size=``)."""


def _infer_inputs(model: nn.Module) -> tuple[Tensor, ...]:
    """An example input for models whose first layer tells the input shape (e.g. torchvision classifiers)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            return (torch.randn(INFERRED_BATCH, m.in_channels, 224, 224),)
        if isinstance(m, nn.Linear):
            return (torch.randn(INFERRED_BATCH, m.in_features),)
        if isinstance(m, (nn.Conv1d, nn.Conv3d, nn.Embedding, nn.RNNBase, nn.MultiheadAttention)):
            break
    raise ValueError(f"cannot infer an input shape for {type(model).__name__}; pass example_inputs=(x,) "
                     "with a batch of real inputs (only their shapes and dtypes are used for planning)")


def _at_batch(x: Any, batch: int) -> Any:
    """Repeat (or trim) a tensor's first dimension to ``batch`` rows; other values pass through."""
    if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] == batch:
        return x
    return x[torch.arange(batch) % x.shape[0]]


def _inputs_from_specs(specs: Sequence[TensorSpec]) -> tuple[Tensor, ...]:
    out = []
    for s in specs:
        dtype = getattr(torch, s.dtype)
        out.append(torch.randn(s.shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(s.shape, dtype=dtype))
    return tuple(out)


# ---- devices -----------------------------------------------------------------------------

def first_device(requested: Sequence[str] | None) -> torch.device:
    """The device a time profile runs on: the first requested one, else the first GPU, else the CPU."""
    if requested:
        return torch.device(requested[0])
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _devices(n: int, requested: tuple[str, ...] | None, notes: list[str]) -> tuple[str, ...]:
    """One device per stage: ``requested`` or ``cuda:0..n-1``, falling back to the CPU (with one warning)."""
    if requested is not None and len(requested) != n:
        raise ValueError(f"devices lists {len(requested)} device(s) for {n} stages; give one per stage")
    wanted = [torch.device(d) for d in requested] if requested is not None else \
        [torch.device("cuda", i) for i in range(n)]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [str(d) for d in wanted if d.type == "cuda" and (d.index or 0) >= have]
    if not missing:
        return tuple(str(d) for d in wanted)
    msg = (f"this machine has {have} CUDA device(s), so {', '.join(missing)} cannot be used; all {n} stages "
           "run on the CPU (pass devices=[...] to choose)")
    warnings.warn(msg, stacklevel=4)
    notes.append(msg)
    return ("cpu",) * n


# ---- analysis ----------------------------------------------------------------------------

@dataclass
class _Analysis:
    """The traced, measured model with its legal cuts and per-segment sums."""

    gm: fx.GraphModule
    nodes: list[fx.Node]
    cuts: list[Cut]
    inputs: tuple[TensorSpec, ...]
    real_inputs: tuple[Any, ...]
    fixed_args: dict[str, Any]
    num_classes: int
    param_bytes: dict[str, int] = field(default_factory=dict)
    trainable: set[str] = field(default_factory=set)

    def segment_nodes(self, first: int, last: int) -> list[fx.Node]:
        """Nodes of atomic segments ``first..last`` (inclusive), excluding the output node."""
        lo = self.cuts[first - 1].position + 1 if first > 0 else 0
        hi = self.cuts[last].position + 1 if last < len(self.cuts) else len(self.nodes) - 1
        return self.nodes[lo:hi]

    def summary(self, nodes: Sequence[fx.Node], optimizer: str) -> dict[str, int]:
        """FLOPs and memory of a run of nodes, counting shared parameters and saved storages once."""
        params: dict[str, int] = {}
        saved: dict[str, int] = {}
        fwd = bwd = 0
        for n in nodes:
            c = n.meta[META_KEY]
            fwd += c.flops_fwd
            bwd += c.flops_bwd
            params.update(c.params)
            for k, b in c.saved.items():
                saved[k] = max(saved.get(k, 0), b)
        pbytes = sum(self.param_bytes[p] for p in params)
        gbytes = sum(self.param_bytes[p] for p in params if p in self.trainable)
        return {"flops_fwd": fwd, "flops_bwd": bwd, "param_count": sum(params.values()), "param_bytes": pbytes,
                "grad_bytes": gbytes, "optim_bytes": gbytes * OPTIMIZER_STATES[optimizer],
                "activation_bytes": sum(saved.values())}

    @functools.cached_property
    def by_name(self) -> dict[str, fx.Node]:
        """Every node by its name."""
        return {n.name: n for n in self.nodes}

    def boundary(self, cut: Cut) -> tuple[TensorSpec, ...]:
        return tuple(dataclasses.replace(self.by_name[name].meta[META_KEY].value, name=name) for name in cut.boundary)


def _analyse(model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: dict[str, Any] | None,
             opts: PlanOptions, planned_inputs: Sequence[TensorSpec] | None, *,
             need_classes: bool = True) -> _Analysis:
    if example_inputs is None and not example_kwargs:
        example_inputs = _inputs_from_specs(planned_inputs) if planned_inputs else _infer_inputs(model)
    example_inputs = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    first = next((x for x in (*example_inputs, *kwargs.values()) if isinstance(x, Tensor) and x.dim() > 0), None)
    if first is None:
        raise ValueError("example_inputs must contain at least one tensor with a batch dimension")
    batch = opts.batch_size or first.shape[0]
    example_inputs = tuple(_at_batch(x, batch) for x in example_inputs)
    kwargs = {k: _at_batch(v, batch) for k, v in kwargs.items()}

    gm = trace(model, example_inputs=example_inputs, example_kwargs=kwargs,
               leaf_modules=opts.leaf_modules, split_points=opts.split_points)
    params = inspect.signature(model.forward).parameters
    by_name = dict(zip(params, example_inputs)) | kwargs
    real_inputs = tuple(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder")
    fixed = {p.name: p.default for p in params.values() if p.name not in by_name}
    measure_graph(gm, real_inputs)
    nodes = list(gm.graph.nodes)
    out_value = _model_output_spec(nodes[-1])
    num_classes = opts.num_classes
    if num_classes is None:
        if not need_classes:
            num_classes = out_value.shape[1] if out_value is not None and len(out_value.shape) == 2 else 0
        elif out_value is None or len(out_value.shape) != 2:
            raise ValueError(f"cannot infer the number of classes: {type(model).__name__} returns "
                             f"{'shape ' + str(list(out_value.shape)) if out_value else 'a structured output'}, "
                             "not N x classes logits; pass num_classes=...")
        else:
            num_classes = out_value.shape[1]
    analysis = _Analysis(
        gm=gm, nodes=nodes, cuts=legal_cuts(gm),
        inputs=tuple(dataclasses.replace(n.meta[META_KEY].value, name=n.name) for n in nodes
                     if n.op == "placeholder"),
        real_inputs=real_inputs, fixed_args=fixed, num_classes=num_classes,
        param_bytes={k: p.numel() * p.element_size() for k, p in gm.named_parameters(remove_duplicate=False)},
        trainable={k for k, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad},
    )
    return analysis


def model_inputs(model: nn.Module, gm: fx.GraphModule, fixed: dict[str, Any]) -> Inputs:
    return Inputs(model=type(model).__name__, signature=inspect.signature(model.forward), fixed=fixed,
                  names=tuple(n.target for n in gm.graph.nodes if n.op == "placeholder"))


def compiled_devices(plan: Plan) -> tuple[torch.device, ...]:
    return tuple(torch.device(d) for d in plan.devices)


def _model_output_spec(output: fx.Node) -> TensorSpec | None:
    arg = output.args[0]
    if isinstance(arg, fx.Node):
        value = arg.meta[META_KEY].value
        return value if isinstance(value, TensorSpec) else None
    return None


# ---- heads -------------------------------------------------------------------------------

def _make_head(policy: _heads.Policy, config: dict[str, Any] | None, spec: TensorSpec,
               a: _Analysis) -> tuple[nn.Module, dict[str, Any]]:
    """The head for a boundary: the policy's choice (``config`` None), a callable policy's, or a given config."""
    input_shape = a.inputs[0].shape if a.inputs else None
    if config is None or config.get("type") == "callable":
        return _heads.make_head(policy, spec, a.num_classes, input_shape)
    return _heads.build_head(config, spec, a.num_classes, input_shape), config


def _head_cost(config: dict[str, Any] | None, policy: _heads.Policy, spec: TensorSpec, a: _Analysis,
               optimizer: str) -> HeadSpec:
    """Build the head for a boundary on the meta device and measure it like the backbone."""
    input_shape = a.inputs[0].shape if a.inputs else None
    with torch.device("meta"):
        head, config = _make_head(policy, config, spec, a)
        head = head.to("meta")
        h = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
        y = torch.zeros(spec.shape[0], dtype=torch.long)
        x = torch.empty(input_shape) if input_shape is not None else None
    cost: ModuleCost = measure_module(head, lambda: _heads.head_loss(head, h, y, x))
    pbytes = sum(p.numel() * p.element_size() for p in head.parameters())
    memory = pbytes * (2 + OPTIMIZER_STATES[optimizer]) + cost.activation_bytes
    return HeadSpec(policy=policy.name, kind=_heads.tensor_kind(spec.shape), config=dict(config),
                    param_count=cost.param_count, flops_fwd=cost.flops_fwd, flops_bwd=cost.flops_bwd,
                    memory_bytes=memory)


def _model_head() -> HeadSpec:
    return HeadSpec(policy="model", kind="model", config={"type": "model", "loss": "cross_entropy"})


# ---- measured time -----------------------------------------------------------------------

def _time_profile(a: _Analysis, heads: dict[int, HeadSpec], policy: _heads.Policy,
                  device: torch.device) -> tuple[list[float], dict[int, float]]:
    """Median forward+backward seconds of every atomic segment and of the head at every cut, on ``device``.

    The model's buffers, gradients and train/eval modes are restored afterwards.
    """
    gm = a.gm
    if any(p.device != device for p in gm.parameters()):
        gm = copy.deepcopy(gm).to(device)
    buffers = {k: b.clone() for k, b in gm.named_buffers()}
    grads = {p: p.grad for p in gm.parameters()}
    seg_times: list[float] = []
    head_times: dict[int, float] = {}
    values: Any = tuple(x.to(device) if isinstance(x, Tensor) else x for x in a.real_inputs)
    first_input = values[0]
    try:
        with train_mode(gm):
            for i, seg in enumerate(split_stages(gm, a.cuts)):
                xs = tuple(v.detach() if isinstance(v, Tensor) else v for v in values)  # as a stage receives them
                if i == 0:
                    seg_times.append(time_callable(lambda: _backward_sum(seg(*xs)), device=device))
                else:
                    # inside a stage a segment also computes its input's gradient (so a stage's first segment is
                    # charged one input gradient too many); copies of grad-requiring leaves let in-place ops at
                    # its start run, and the copying time is taken off again
                    leaves = tuple(v.requires_grad_(v.is_floating_point()) if isinstance(v, Tensor) else v
                                   for v in xs)
                    clones = lambda: tuple(v.clone() if isinstance(v, Tensor) else v for v in leaves)  # noqa: E731
                    full = time_callable(lambda: _backward_sum(seg(*clones())), device=device)
                    seg_times.append(max(0.0, full - time_callable(clones, device=device)))
                with torch.no_grad():
                    values = seg(*xs)
                if i in heads:
                    head = _make_head(policy, heads[i].config, a.boundary(a.cuts[i])[0], a)[0].to(device)
                    h = values[0].detach()
                    y = torch.randint(0, a.num_classes, (h.shape[0],), device=device)
                    head_times[i] = time_callable(lambda: _heads.head_loss(head, h, y, first_input).backward(),
                                                  device=device)
    finally:
        with torch.no_grad():
            for k, b in gm.named_buffers():
                b.copy_(buffers[k])
        for p, g in grads.items():
            p.grad = g
    return seg_times, head_times


def _backward_sum(out: Any) -> None:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


# ---- cuts by hand ------------------------------------------------------------------------

def _nearest_cuts(a: _Analysis, name: str) -> str:
    pos = next((i for i, n in enumerate(a.nodes) if n.name == name), None)
    if pos is None:
        return ", ".join(repr(c.node) for c in a.cuts[:6]) + (" ..." if len(a.cuts) > 6 else "")
    before = [c.node for c in a.cuts if c.position < pos][-1:]
    after = [c.node for c in a.cuts if c.position > pos][:1]
    return " or ".join(repr(c) for c in before + after) or "none"


def _resolve_cut(a: _Analysis, name: str) -> int:
    """Index into ``a.cuts`` of a cut given as a node name or a module name."""
    legal = {c.node: i for i, c in enumerate(a.cuts)}
    if name in legal:
        return legal[name]
    node = next((n for n in a.nodes if n.op == "call_module" and n.target == name), None)
    if node is None:
        inside = [n for n in a.nodes if module_path(n) == name or module_path(n).startswith(name + ".")]
        node = inside[-1] if inside else None
    if node is not None and node.name in legal:
        return legal[node.name]
    if node is None and name not in {n.name for n in a.nodes}:
        close = difflib.get_close_matches(name, [n.name for n in a.nodes] + [c.node for c in a.cuts], n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise CutError(f"{name!r} is neither a node nor a module of the traced model{hint}; "
                       f"legal cuts include {_nearest_cuts(a, name)}")
    target = node.name if node is not None else name
    raise CutError(f"cannot cut after {name!r}: its output does not carry everything later layers need "
                   f"(a skip connection or other value crosses it); nearest legal cuts: {_nearest_cuts(a, target)}")


# ---- the plan ----------------------------------------------------------------------------

def _stage_request(a: _Analysis, opts: PlanOptions, base: _Override | None) -> tuple[list[int] | None, int]:
    """Cuts given by hand (indices into ``a.cuts``; None: the partitioner chooses) and the number of stages."""
    manual: list[int] | None = None
    if base is not None:
        try:
            manual = [_resolve_cut(a, c) for c in base.cuts]
        except CutError as e:
            raise CutError(f"{base.source}: {e}") from None
    elif opts.split_points is not None:
        manual = sorted({_resolve_cut(a, c) for c in opts.split_points})
        if len(manual) != len(opts.split_points):
            raise CutError(f"split_points {list(opts.split_points)} name the same cut more than once")
    fixed = opts.replicas if isinstance(opts.replicas, tuple) else None
    if opts.replicas_chosen and manual is not None:
        raise ValueError("with split_points the stages are fixed: give their replicas as a tuple, e.g. "
                         "replicas=(1, 2), or drop split_points to let the partitioner choose both")
    if manual is not None:
        n_stages = len(manual) + 1
        if fixed is not None and len(fixed) != n_stages:
            raise ValueError(f"replicas lists {len(fixed)} count(s) for {n_stages} stages; give one per stage")
        world = sum(fixed) if fixed is not None else n_stages
        if opts.gpus is not None and opts.gpus != world:
            raise CutError(f"{len(manual)} cut(s) make {n_stages} stages" + (f" on {world} devices" if fixed else "")
                           + f", but gpus={opts.gpus}; drop gpus= or give gpus - 1 cuts")
    elif fixed is not None:
        n_stages = len(fixed)
        if opts.gpus is not None and opts.gpus != sum(fixed):
            raise ValueError(f"replicas {list(fixed)} use {sum(fixed)} devices, but gpus={opts.gpus}; drop gpus=")
    elif opts.gpus is not None or opts.devices is not None:
        n_stages = opts.gpus or len(opts.devices or ())
    else:
        raise ValueError("say how many devices to plan for: gpus=N (or devices=[...], split_points=[...])")
    if opts.replicas_chosen:
        n_stages = min(n_stages, len(a.cuts) + 1)  # the partitioner chooses how many stages, at most one per device
    if n_stages - 1 > len(a.cuts):
        raise CutError(f"model has {len(a.cuts)} legal cut points, so at most {len(a.cuts) + 1} stages; "
                       f"got gpus={n_stages} (pass split_points=... or fewer gpus)")
    if opts.gpus is not None and opts.devices is not None and len(opts.devices) != opts.gpus and fixed is None:
        raise ValueError(f"devices lists {len(opts.devices)} device(s) but gpus={opts.gpus}")
    return manual, n_stages


def _memory(s: dict[str, int]) -> int:
    """Bytes of a summary's parameters, gradients, optimizer state and saved activations."""
    return s["param_bytes"] + s["grad_bytes"] + s["optim_bytes"] + s["activation_bytes"]


def _build(model: nn.Module, example_inputs: Sequence[Any] | None, example_kwargs: dict[str, Any] | None,
           opts: PlanOptions, base: _Override | None) -> tuple[Plan, _Analysis, _heads.Policy]:
    notes: list[str] = []
    a = _analyse(model, example_inputs, example_kwargs, opts, base.inputs if base is not None else None)
    policy = _heads.load_policy(opts.policy)

    manual, n_stages = _stage_request(a, opts, base)
    if not opts.replicas_chosen:
        speeds = opts.device_speeds or (1.0,) * n_stages
        if len(speeds) != n_stages:
            raise ValueError(f"device_speeds has {len(speeds)} entries for {n_stages} stages; give one per device")

    # heads: policy's choice at every candidate cut, or the plan's (possibly edited) head at its cuts
    head_cfg: dict[int, dict[str, Any]] = dict(zip(manual, base.heads)) if base is not None and manual else {}
    candidates = manual if manual is not None else range(len(a.cuts))
    cache: dict[Any, HeadSpec] = {}
    heads: dict[int, HeadSpec] = {}
    for i in candidates:
        spec = a.boundary(a.cuts[i])[0]
        cfg = head_cfg.get(i)
        key = (spec.shape, spec.dtype, repr(cfg))
        if key not in cache:
            try:
                cache[key] = _head_cost(cfg, policy, spec, a, opts.optimizer)
            except PolicyError as e:
                raise PolicyError(f"cut after {a.cuts[i].node!r}: {e}") from None
        heads[i] = cache[key]

    n_seg = len(a.cuts) + 1
    seg = [a.summary(a.segment_nodes(i, i), opts.optimizer) for i in range(n_seg)]
    if opts.profile == "time":
        device = first_device(opts.devices)
        seg_time, head_time = _time_profile(a, heads, policy, device)
        notes.append(f"costs measured as median forward+backward time on {device}")
    else:
        seg_time = [(s["flops_fwd"] + s["flops_bwd"]) / opts.flops_per_second for s in seg]
        head_time = {i: (h.flops_fwd + h.flops_bwd) / opts.flops_per_second for i, h in heads.items()}
    comm = [sum(t.bytes for t in a.boundary(c)) / opts.link_bandwidth for c in a.cuts] + [0.0]

    head_grad = [heads[i].param_count * 4 if i in heads else 0 for i in range(n_seg)]  # float32 heads
    replicas = opts.replicas if isinstance(opts.replicas, tuple) else None
    if manual is not None:
        ends = tuple(c + 1 for c in manual) + (n_seg,)
        partitioner = "manual"
    elif opts.replicas_chosen or replicas is not None:
        problem = ReplicaProblem(
            compute=seg_time, head=[head_time.get(i, 0.0) for i in range(n_seg)], comm=comm,
            grad_bytes=[s["grad_bytes"] for s in seg], head_grad_bytes=head_grad,
            allreduce_bandwidth=opts.link_bandwidth, memory=[_memory(s) for s in seg],
            head_memory=[heads[i].memory_bytes if i in heads else 0 for i in range(n_seg)],
            memory_limit=opts.memory_limit, devices=sum(replicas or ()) or opts.gpus or len(opts.devices or ()),
            max_replicas=opts.replicas if opts.replicas_chosen and opts.replicas is not True else None)
        try:
            layout = solve_fixed_replicas(problem, replicas) if replicas else solve_replicated(problem)
        except partitioners.PartitionError as e:
            raise PartitionError(str(e)) from None
        ends, replicas, partitioner = layout.ends, layout.replicas, "exact-replicas"
        speeds = (1.0,) * len(ends)
    else:
        problem = partitioners.Problem(
            compute=seg_time, head=[head_time.get(i, 0.0) for i in range(n_seg)], comm=comm,
            memory=[_memory(s) for s in seg],
            head_memory=[heads[i].memory_bytes if i in heads else 0 for i in range(n_seg)],
            params=[s["param_count"] for s in seg], speeds=speeds, memory_limit=opts.memory_limit)
        try:
            ends = partitioners.solve(problem, n_stages, opts.partitioner)
        except partitioners.PartitionError as e:
            raise PartitionError(str(e)) from None
        partitioner = opts.partitioner

    replicas = replicas or (1,) * len(ends)
    devices = _devices(sum(replicas), opts.devices, notes)
    stages = []
    start = 0
    multi = tuple(c.node for c in a.cuts if len(c.boundary) > 1)
    for j, end in enumerate(ends):
        r = replicas[j]
        nodes = [n for n in a.segment_nodes(start, end - 1) if n.op not in ("placeholder", "get_attr")] \
            or a.segment_nodes(start, end - 1)
        s = a.summary(nodes, opts.optimizer)
        last = j == len(ends) - 1
        cut = None if last else a.cuts[end - 1]
        head = _model_head() if last else heads[end - 1]
        sync = 2 * (r - 1) / r * (s["grad_bytes"] + (0 if last else head_grad[end - 1])) / opts.link_bandwidth
        compute = (sum(seg_time[start:end]) + (0.0 if last else head_time[end - 1])) / speeds[j] / r + sync
        send = 0.0 if last else comm[end - 1] / r
        stages.append(StagePlan(
            index=j, device=devices[sum(replicas[:j])], replicas=r, first_node=nodes[0].name, last_node=nodes[-1].name,
            first_module=module_path(nodes[0]), last_module=module_path(nodes[-1]),
            nodes=tuple(n.name for n in nodes), aux_flops=head.flops_fwd + head.flops_bwd,
            memory_bytes=_memory(s) + head.memory_bytes,
            boundary=() if cut is None else a.boundary(cut), head=head,
            compute_cost=compute, comm_cost=send, cost=compute + send, **s))
        if cut is not None and cut.node in multi:
            notes.append(f"stage {j} sends {len(cut.boundary)} values ({', '.join(cut.boundary)}); its aux head "
                         f"reads the first")
        start = end
    sequential = sum(seg_time) + sum(head_time[e - 1] for e in ends[:-1])
    result = Plan(
        model=type(model).__name__, inputs=a.inputs, batch_size=a.inputs[0].shape[0] if a.inputs else 0,
        num_classes=a.num_classes, policy=policy.name, partitioner=partitioner, profile=opts.profile,
        optimizer=opts.optimizer, flops_per_second=opts.flops_per_second, link_bandwidth=opts.link_bandwidth,
        device_speeds=speeds, memory_limit=opts.memory_limit, legal_cuts=tuple(c.node for c in a.cuts),
        multi_tensor_cuts=multi, stages=tuple(stages), sequential_cost=sequential, notes=tuple(notes))
    result.validate()
    return result, a, policy


@dataclass(frozen=True, kw_only=True)
class _Override:
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
            "link_bandwidth", "flops_per_second")


def _override(plan: Plan | str | Path | None) -> _Override | None:
    """Read the parts of a plan that a user may edit by hand; derived fields (nodes, costs) are ignored."""
    if plan is None:
        return None
    if isinstance(plan, Plan):
        d, source = plan.to_dict(), "plan"
    else:
        path = Path(plan)
        if not path.is_file():
            raise PlanError(f"plan file {str(path)!r} does not exist")
        source = str(path)
        try:
            d = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
        except yaml.YAMLError as e:
            raise PlanError(f"{source}: not a readable plan ({e})") from None
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
        return _Override(
            mode=str(d.get("mode", "ppll")), blocks=blocks,
            source=source,
            inputs=tuple(TensorSpec.from_dict(t) for t in get(d, "inputs", "the plan")),
            cuts=tuple(str(get(s, "last_node", f"stages[{i}]")) for i, s in enumerate(stages[:-1])),
            heads=tuple(dict(get(get(s, "head", f"stages[{i}]"), "config", f"stages[{i}].head"))
                        for i, s in enumerate(stages[:-1])),
            settings=settings)
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{source}: malformed plan field ({e})") from None


def _options(gpus: int | None, base: _Override | None, options: dict[str, Any]) -> PlanOptions:
    """Options from the call, falling back to a re-applied plan's own settings."""
    return PlanOptions.make(gpus=gpus, **{**(base.settings if base is not None else {}), **options})


def _mode(mode: str | None, teacher: nn.Module | None, base: _Override | None) -> str:
    mode = mode or (base.mode if base is not None else "pipebd" if teacher is not None else "ppll")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not known; choose one of {', '.join(MODES)}")
    if mode == "pipebd" and not isinstance(teacher, nn.Module):
        raise TypeError("mode='pipebd' distils the model from a teacher: pass teacher=<the frozen nn.Module>")
    if mode == "ppll" and teacher is not None:
        raise ValueError("a teacher is only used by mode='pipebd' (blockwise distillation); drop teacher= or "
                         "pass mode='pipebd'")
    return mode


def plan(model: nn.Module, gpus: int | None = None, *, teacher: nn.Module | None = None, mode: str | None = None,
         blocks: Sequence[Sequence[str]] | None = None, example_inputs: Sequence[Any] | None = None,
         example_kwargs: dict[str, Any] | None = None, plan: Plan | str | Path | None = None,
         **options: Any) -> Plan:
    """Trace, measure and partition ``model`` into a :class:`Plan` for ``gpus`` devices.

    ``options`` are the fields of :class:`PlanOptions` (policy, partitioner, profile, optimizer,
    memory_limit, device_speeds, devices, batch_size, leaf_modules, split_points, num_classes, replicas).
    ``plan`` re-applies a saved (possibly hand-edited) plan: its cuts, devices and heads are validated
    against the model and its costs measured afresh.

    With ``teacher=`` (``mode="pipebd"``) the plan is for blockwise distillation of ``model`` from the
    frozen teacher: see :func:`ppll_compile.distill.build` (``blocks`` names aligned block ends by hand).
    """
    base = _override(plan)
    opts = _options(gpus, base, options)
    if _mode(mode, teacher, base) == "pipebd":
        from .distill import build
        return build(model, teacher, example_inputs, example_kwargs, opts, blocks or (base and base.blocks))[0]
    _no_blocks(blocks)
    return _build(model, example_inputs, example_kwargs, opts, base)[0]


def _no_blocks(blocks: Any) -> None:
    if blocks is not None:
        raise ValueError("blocks= aligns a teacher with a student; it needs mode='pipebd' and teacher=")


def compile(model: nn.Module, gpus: int | None = None, *, teacher: nn.Module | None = None,
            mode: str | None = None, blocks: Sequence[Sequence[str]] | None = None,
            example_inputs: Sequence[Any] | None = None, example_kwargs: dict[str, Any] | None = None,
            plan: Plan | str | Path | None = None, **options: Any) -> CompiledPipeline:
    """Plan ``model`` (see :func:`plan`) and lower it to stage modules and auxiliary heads on their devices.

    The stages share the model's parameter objects (each stage is moved to its device, and the model's
    parameters with it); calling the result runs the stages in order and, in eval mode, gives the model's
    own output. With ``teacher=`` the result is a :class:`~ppll_compile.distill.DistillPipeline`.
    """
    base = _override(plan)
    opts = _options(gpus, base, options)
    if _mode(mode, teacher, base) == "pipebd":
        from .distill import compile_pipebd
        return compile_pipebd(model, teacher, example_inputs, example_kwargs, opts, blocks or (base and base.blocks))
    _no_blocks(blocks)
    result, a, policy = _build(model, example_inputs, example_kwargs, opts, base)
    by_name = {c.node: c for c in a.cuts}
    stages = split_stages(a.gm, [by_name[c] for c in result.cuts])
    heads: list[nn.Module | None] = []
    for st, sp in zip(stages, result.stages):
        st.to(sp.device)
        heads.append(None if sp.is_last else _make_head(policy, sp.head.config, sp.boundary[0], a)[0].to(sp.device))
    lowered = Lowered(modules=tuple(stages), heads=tuple(heads), devices=compiled_devices(result),
                      inputs=model_inputs(model, a.gm, a.fixed_args))
    return CompiledPipeline(model=model, graph_module=a.gm, plan=result, lowered=lowered)

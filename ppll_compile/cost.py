"""Measure every traced node's FLOPs, parameters and saved activations on fake tensors, and time segments."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from .plan import TensorSpec
from .trace import train_mode

__all__ = [
    "META_KEY",
    "OPTIMIZER_STATES",
    "NodeCost",
    "ModuleCost",
    "measure_graph",
    "measure_module",
    "tensor_spec",
    "time_callable",
]

META_KEY = "ppll_cost"
"""The ``node.meta`` key under which :func:`measure_graph` stores each node's :class:`NodeCost`."""

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}
"""Optimizer state tensors kept per parameter tensor (sgd: none, momentum: one buffer, adam: two moments)."""


@dataclass(frozen=True, kw_only=True)
class NodeCost:
    """What one traced node costs, measured at the planned batch size."""

    flops_fwd: int
    """Forward FLOPs counted by FlopCounterMode (plus formulas for attention kernels it does not count)."""
    flops_bwd: int
    """Backward FLOPs of the node's own backward pass."""
    params: dict[str, int] = field(default_factory=dict)
    """Qualified name -> element count of every parameter the node uses."""
    saved: dict[str, int] = field(default_factory=dict)
    """Activation bytes saved for backward, keyed by the storage they belong to (shared keys are the same
    memory: a node output saved by several consumers counts once)."""
    value: Any = None
    """TensorSpec of the node's output; a tuple/list/dict of them for structured outputs; an int for a
    Python scalar; None for anything else."""
    storage: Any = None
    """Storage key of the node's output, with the same structure as ``value`` (views share their base's key)."""


@dataclass(frozen=True, kw_only=True)
class ModuleCost:
    """Measured cost of a whole module (an auxiliary head) at one input shape."""

    flops_fwd: int
    """Forward FLOPs."""
    flops_bwd: int
    """Backward FLOPs."""
    param_count: int
    """Number of parameters."""
    activation_bytes: int
    """Bytes saved for backward."""


# ---- FLOP formulas torch's counter lacks -----------------------------------------------------

# torch wraps custom formulas so that they receive tensor shapes (torch.Size) instead of tensors

def _sdpa_cpu(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def _native_mha(query: Any, key: Any, value: Any, embed_dim: int, num_heads: int, *args: Any,
                **kwargs: Any) -> int:
    # in-projection of q, k, v, attention (QK^T and AV), out-projection; batch-first (B, L, E) inputs
    b, lq, e = query
    lk = key[1]
    head_dim = e // num_heads
    proj = 2 * b * e * e * (lq + 2 * lk) + 2 * b * lq * e * e
    heads = (b, num_heads, lq, head_dim), (b, num_heads, lk, head_dim), (b, num_heads, lk, head_dim)
    return proj + flop_counter.sdpa_flop_count(*heads)


def _conv_backward(grad_out: Any, x: Any, w: Any, _bias: Any, _stride: Any, _padding: Any, _dilation: Any,
                   transposed: bool, _output_padding: Any, _groups: Any, output_mask: Sequence[bool],
                   *args: Any, **kwargs: Any) -> int:
    # the input gradient and the weight gradient each take as many multiply-adds as the forward convolution;
    # torch's own formula counts a grouped (e.g. depthwise) weight gradient as if the conv were dense
    forward = flop_counter.conv_flop_count(x, w, grad_out, transposed=transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    aten = torch.ops.aten
    table = {
        "convolution_backward": _conv_backward,
        "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
        "_native_multi_head_attention": _native_mha,
    }
    return {getattr(aten, name): fn for name, fn in table.items() if hasattr(aten, name)}


_EXTRA = _extra_formulas()


def _flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=_EXTRA)


# ---- helpers -------------------------------------------------------------------------------

def _sid(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def tensor_spec(name: str, value: Any) -> TensorSpec | None:
    """TensorSpec of a tensor or Python int value (None for anything else)."""
    if isinstance(value, Tensor):
        return TensorSpec(name=name, shape=tuple(int(s) for s in value.shape),
                          dtype=str(value.dtype).removeprefix("torch."),
                          bytes=value.numel() * value.element_size())
    if isinstance(value, (int, float, bool)):
        return TensorSpec(name=name, shape=(), dtype=type(value).__name__, bytes=0)
    return None


def _structured(name: str, value: Any, leaf: Callable[[str, Any], Any]) -> Any:
    """Apply ``leaf`` to every element of a (possibly nested) output, naming elements ``name.i``."""
    if isinstance(value, (tuple, list)):
        items = [_structured(f"{name}.{i}", v, leaf) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _structured(f"{name}.{k}", v, leaf) for k, v in value.items()}
    return leaf(name, value)


# ---- per-node measurement ------------------------------------------------------------------

class _Measure(fx.Interpreter):
    """Runs a GraphModule on fake tensors, measuring each node in isolation (forward and backward)."""

    def __init__(self, gm: fx.GraphModule, param_storages: dict[int, str]):
        super().__init__(gm, garbage_collect_values=True)
        self.param_storages = param_storages  # storage id -> parameter/buffer name
        self.keys: dict[int, str] = {}  # storage id of live fake values -> storage key
        self.grad: dict[str, bool] = {}  # node name -> whether its output requires grad in training

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("output",):
            return super().run_node(n)
        if n.op in ("placeholder", "get_attr"):
            out = super().run_node(n)
            if n.op == "placeholder":
                self._register_output(n, out, {})
                self.grad[n.name] = False
            n.meta[META_KEY] = NodeCost(flops_fwd=0, flops_bwd=0, params=self._attr_params(n),
                                        value=_structured(n.name, out, tensor_spec),
                                        storage=self._storage_keys(n, out, {}))
            return out
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        needs_grad = any(self.grad.get(a.name, False) for a in n.all_input_nodes)
        fresh: dict[int, Tensor] = {}
        inputs_keys: dict[int, str] = {}

        def prepare(x: Any) -> Any:
            if not isinstance(x, Tensor) or _sid(x) in self.param_storages:
                return x
            if id(x) not in fresh:
                leaf = x.detach().requires_grad_(needs_grad and x.is_floating_point())
                clone = leaf.clone()
                fresh[id(x)] = clone
                inputs_keys[_sid(clone)] = self.keys.get(_sid(x), f"{n.name}:in{len(fresh)}")
            return fresh[id(x)]

        args, kwargs = pytree.tree_map(prepare, (args, kwargs))
        params = self._call_params(n)
        saved: dict[str, int] = {}
        saved_tensors: list[Tensor] = []

        def pack(t: Tensor) -> Tensor:
            saved_tensors.append(t)
            return t

        with _flop_counter() as fwd_counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = getattr(self, n.op)(n.target, args, kwargs)
        out_keys = self._register_output(n, out, inputs_keys)
        known = {**inputs_keys, **out_keys}
        for i, t in enumerate(saved_tensors):
            s = _sid(t)
            if s in self.param_storages:
                continue
            key = known.get(s, f"{n.name}:saved{i}")
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())

        grads = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        self.grad[n.name] = bool(grads)
        bwd = 0
        if grads:
            with _flop_counter() as bwd_counter:
                torch.autograd.backward(grads, [torch.ones_like(g) for g in grads])
            bwd = bwd_counter.get_total_flops()
        n.meta[META_KEY] = NodeCost(flops_fwd=fwd_counter.get_total_flops(), flops_bwd=bwd, params=params,
                                    saved=saved, value=_structured(n.name, out, tensor_spec),
                                    storage=self._storage_keys(n, out, inputs_keys))
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)

    def _register_output(self, n: fx.Node, out: Any, inputs_keys: dict[int, str]) -> dict[int, str]:
        """Give every output tensor a storage key: its input's key when it is a view/in-place result."""
        new: dict[int, str] = {}

        def leaf(name: str, v: Any) -> None:
            if isinstance(v, Tensor):
                s = _sid(v)
                new[s] = inputs_keys.get(s, name)
        _structured(n.name, out, leaf)
        self.keys.update(new)
        return new

    def _storage_keys(self, n: fx.Node, out: Any, inputs_keys: dict[int, str]) -> Any:
        return _structured(n.name, out,
                           lambda name, v: self.keys.get(_sid(v), name) if isinstance(v, Tensor) else None)

    def _attr_params(self, n: fx.Node) -> dict[str, int]:
        if n.op != "get_attr":
            return {}
        t = self.fetch_attr(n.target)
        return {str(n.target): t.numel()} if isinstance(t, nn.Parameter) else {}

    def _call_params(self, n: fx.Node) -> dict[str, int]:
        if n.op == "call_module":
            mod = self.module.get_submodule(n.target)
            return {f"{n.target}.{k}": p.numel() for k, p in mod.named_parameters()}
        return {}


def measure_graph(gm: fx.GraphModule, inputs: Sequence[Any], kwargs: dict[str, Any] | None = None) -> None:
    """Measure every node of ``gm`` on fake tensors and store a :class:`NodeCost` in ``node.meta[META_KEY]``.

    ``inputs`` may be real or fake tensors (only shapes and dtypes matter); no real compute runs, nothing
    on the model changes (buffers such as BatchNorm statistics are updated on fake copies only).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}
    with mode:
        fake_state = {k: mode.from_tensor(v) for k, v in state.items()}
    storages = {_sid(v): k for k, v in fake_state.items()}
    placeholder_names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    args = dict(zip(placeholder_names, inputs))
    args.update(kwargs or {})
    with train_mode(gm), mode, torch.nn.utils.stateless._reparametrize_module(gm, fake_state):
        fake_args = [mode.from_tensor(a) if isinstance(a, Tensor) else a
                     for a in (args[name] for name in placeholder_names)]
        _Measure(gm, storages).run(*fake_args)


def measure_module(module: nn.Module, run: Callable[[], Any]) -> ModuleCost:
    """Forward and backward FLOPs and saved bytes of ``run()``, a forward pass (or loss) of ``module``.

    Build the module under ``torch.device("meta")`` and feed it meta tensors to measure without allocating.
    """
    params = list(module.parameters())
    param_storages = {_sid(p) for p in params}
    buffer_storages = {_sid(b) for b in module.buffers()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = _sid(t)
        if s not in param_storages and s not in buffer_storages:
            saved[s] = max(saved.get(s, 0), t.untyped_storage().nbytes())
        return t

    with _flop_counter() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    grads = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    bwd = 0
    if grads:
        with _flop_counter() as bwd_counter:
            torch.autograd.backward(grads, [torch.ones_like(g) for g in grads])
        bwd = bwd_counter.get_total_flops()
    return ModuleCost(flops_fwd=fwd.get_total_flops(), flops_bwd=bwd,
                      param_count=sum(p.numel() for p in params), activation_bytes=sum(saved.values()))


def time_callable(fn: Callable[[], Any], *, device: torch.device, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

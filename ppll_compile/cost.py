"""Measure every traced node's FLOPs, parameters and saved activations on fake tensors, without running them."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils._mode_utils import no_dispatch
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

_PLAIN = (int, float, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.memory_format,
          torch.layout)
_PURE_MODULES = ("torch", "_operator", "operator", "builtins", "math")
"""Modules whose functions compute their result from their arguments alone (no hidden state)."""
_HOOK_FREE = ("_parameters", "_buffers", "_modules")


class _Uncacheable(Exception):
    """A value that a node's signature cannot stand for exactly."""


def _plain(v: Any) -> Any:
    """A hashable stand-in for a constant that tells apart values of different types (``1``, ``1.0``, ``True``)."""
    if type(v) in _PLAIN:
        return type(v), v
    if isinstance(v, slice):
        return slice, _plain(v.start), _plain(v.stop), _plain(v.step)
    if type(v) in (tuple, list, frozenset, set):
        items = (_plain(x) for x in v)
        return type(v), (frozenset(items) if isinstance(v, (set, frozenset)) else tuple(items))
    if _pure_function(v):
        return "fn", v
    raise _Uncacheable


def _pure_function(f: Any) -> bool:
    """A plain function of torch, ``operator``, ``math`` or the builtins (not a method bound to some object)."""
    if isinstance(f, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if isinstance(f, types.BuiltinFunctionType):
        owner = getattr(f, "__self__", None)
        if not (owner is None or isinstance(owner, (types.ModuleType, type))):
            return False
    elif not isinstance(f, types.FunctionType):
        return False
    return (getattr(f, "__module__", None) or "").split(".")[0] in _PURE_MODULES


def _module_signature(module: nn.Module) -> Any:
    """What determines a ``torch.nn`` module's computation: classes, attributes and parameter/buffer layouts.

    Raises :class:`_Uncacheable` for a module (or submodule) defined outside ``torch.nn``, or one with hooks.
    """
    parts = []
    for name, m in module.named_modules(remove_duplicate=False):
        if not type(m).__module__.startswith("torch.nn.") or isinstance(m, nn.modules.lazy.LazyModuleMixin):
            raise _Uncacheable
        attrs = []
        for k, v in vars(m).items():
            if k in _HOOK_FREE:
                continue
            if isinstance(v, dict):
                if v:
                    raise _Uncacheable  # a hook, or state the forward may read
                continue
            attrs.append((k, _plain(v)))
        tensors = tuple((k, None) if t is None else (k, tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
                        for k, t in (*m._parameters.items(), *m._buffers.items()))
        parts.append((name, type(m), tuple(attrs), tensors))
    return tuple(parts)


@dataclass(frozen=True)
class _Out:
    """An output tensor of a memoised node: its layout and where its storage key comes from."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ref: tuple[str, Any]


@dataclass(frozen=True)
class _Outcome:
    """A measured node, relative to its inputs, to replay on any node with the same signature."""

    flops_fwd: int
    flops_bwd: int
    grad: bool
    saved: tuple[tuple[tuple[str, Any], int], ...]
    """(storage reference, bytes) of every saved activation, in the order they were saved."""
    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]
    """The output's leaves: :class:`_Out` for tensors, the value itself for constants."""


_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


class _FakeState:
    """The model's parameters and buffers, swapped for fake tensors as the nodes being run come to need them.

    A ``torch.nn`` leaf module reads only its own parameters and buffers, so only those are swapped before it
    runs; a get_attr node reads one. Anything that could read further (another module, a function from
    outside torch, a constant tensor) first swaps in all of them, as if swapped at the start.
    """

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, stack: contextlib.ExitStack):
        self.gm = gm
        self.mode = mode
        self.stack = stack
        self.state = {id(t): t for _, t in (*gm.named_parameters(remove_duplicate=False),
                                            *gm.named_buffers(remove_duplicate=False))}
        self.keys: dict[int, str] = {}  # storage id of live fake values -> storage key
        self.fakes: dict[int, Tensor] = {}  # id of a real parameter or buffer -> its fake
        self.fake_ids: set[int] = set()
        self.storages: set[int] = set()  # storage ids of the fakes
        self.swapped: set[str] = set()  # module paths whose tensors are swapped
        self.all = False

    def fake(self, t: Tensor) -> Tensor:
        """The fake tensor standing for parameter or buffer ``t`` (one per tensor object)."""
        f = self.fakes.get(id(t))
        if f is None:
            f = self.fakes[id(t)] = self.mode.from_tensor(t)
            self.fake_ids.add(id(f))
            self.storages.add(_sid(f))
            self.keys.pop(_sid(f), None)  # left by a value freed before this storage took its place
        return f

    def known(self, obj: Any) -> bool:
        """Whether ``obj`` is a parameter or buffer of the model, or the fake standing for one."""
        return id(obj) in self.state or id(obj) in self.fake_ids

    def swap_module(self, path: str) -> None:
        """Swap in the fakes of one module's parameters and buffers (its whole subtree)."""
        if self.all or path in self.swapped:
            return
        m = self.gm.get_submodule(path)
        tensors = {k: self.fake(t) for k, t in (*m.named_parameters(remove_duplicate=False),
                                                  *m.named_buffers(remove_duplicate=False))}
        self.stack.enter_context(torch.nn.utils.stateless._reparametrize_module(m, tensors))
        self.swapped.add(path)

    def swap_all(self) -> None:
        """Swap in the fakes of every parameter and buffer not swapped yet."""
        if self.all:
            return
        done = tuple(p + "." for p in self.swapped)
        tensors = {k: self.fake(t) for k, t in (*self.gm.named_parameters(remove_duplicate=False),
                                                  *self.gm.named_buffers(remove_duplicate=False))
                   if not k.startswith(done)}
        self.stack.enter_context(torch.nn.utils.stateless._reparametrize_module(self.gm, tensors))
        self.all = True

    def needs_all(self, values: Sequence[Any]) -> bool:
        """Whether a global module hook may run, or an input shares storage with a parameter or buffer."""
        if any(getattr(nn.modules.module, h, None) for h in _GLOBAL_HOOKS):
            return True
        real = {_sid(t) for t in self.state.values()}
        return any(isinstance(v, Tensor) and _sid(v) in real for v in pytree.tree_leaves(list(values)))


class _Measure(fx.Interpreter):
    """Runs a GraphModule on fake tensors, measuring each node in isolation (forward and backward).

    A node whose target, arguments' layouts and constants equal an earlier node's is not run again: its
    measurement (FLOPs, saved bytes, output layout, which storages alias its inputs) is replayed.
    """

    def __init__(self, gm: fx.GraphModule, state: _FakeState):
        super().__init__(gm, garbage_collect_values=True)
        self.state = state
        self.mode = state.mode
        self.param_storages = state.storages  # storage ids of the fake parameters and buffers
        self.keys = state.keys
        self.grad: dict[str, bool] = {}  # node name -> whether its output requires grad in training
        self.memo: dict[Any, _Outcome] = {}
        self.module_signatures: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("output",):
            return super().run_node(n)
        if n.op in ("placeholder", "get_attr"):
            if n.op == "get_attr" and not self.state.known(super().fetch_attr(n.target)):
                self.state.swap_all()  # a constant, or a tensor a module put in place of its own
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
        signature = self._signature(n, args, kwargs, needs_grad)
        if signature is not None and signature in self.memo:
            return self._replay(n, args, kwargs, self.memo[signature])
        self._swap_state(n, args)
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
        if signature is not None:
            outcome = self._outcome(n, fresh, out, out_keys, saved_tensors, n.meta[META_KEY])
            if outcome is not None:
                self.memo[signature] = outcome
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)

    def fetch_attr(self, target: str) -> Any:
        obj = super().fetch_attr(target)
        return self.state.fake(obj) if isinstance(obj, Tensor) and id(obj) in self.state.state else obj

    def _swap_state(self, n: fx.Node, args: Any) -> None:
        """Swap in the fake parameters and buffers ``n`` may read: its module's own, or all of them."""
        if n.op == "call_module" and self.module_signatures.get(n.target) is not None:
            self.state.swap_module(n.target)
        elif not (n.op == "call_function" and _pure_function(n.target)
                  or n.op == "call_method" and args and isinstance(args[0], Tensor)):
            self.state.swap_all()

    # ---- memoisation ----

    def _signature(self, n: fx.Node, args: Any, kwargs: Any, needs_grad: bool) -> Any:
        """Everything a node's measurement depends on, or None when that cannot be told exactly."""
        try:
            if n.op == "call_module":
                if n.target not in self.module_signatures:
                    try:
                        self.module_signatures[n.target] = _module_signature(self.module.get_submodule(n.target))
                    except _Uncacheable:
                        self.module_signatures[n.target] = None
                target = self.module_signatures[n.target]
                if target is None:
                    return None
            elif n.op == "call_function":
                target = _plain(n.target)
            else:
                target = n.target
            leaves, spec = pytree.tree_flatten((args, kwargs))
            first: dict[int, int] = {}
            sig = []
            for x in leaves:
                if not isinstance(x, Tensor):
                    sig.append(_plain(x))
                    continue
                if not isinstance(x, FakeTensor) or x.layout != torch.strided:
                    return None
                param = _sid(x) in self.param_storages
                sig.append((first.setdefault(id(x), len(first)), param, tuple(x.shape), x.stride(), x.dtype,
                            x.device, x.storage_offset() if param else 0, x.requires_grad if param else None))
            return n.op, target, needs_grad, spec, tuple(sig)
        except _Uncacheable:
            return None

    def _fresh_keys(self, n: fx.Node, args: Any, kwargs: Any) -> list[str]:
        """The storage key of every distinct non-parameter input tensor, in the order they are cloned."""
        seen: set[int] = set()
        keys = []
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, Tensor) and _sid(x) not in self.param_storages and id(x) not in seen:
                seen.add(id(x))
                keys.append(self.keys.get(_sid(x), f"{n.name}:in{len(seen)}"))
        return keys

    def _outcome(self, n: fx.Node, fresh: dict[int, Tensor], out: Any, out_keys: dict[int, str],
                 saved_tensors: list[Tensor], cost: NodeCost) -> _Outcome | None:
        """The measurement of ``n`` with storage keys expressed relative to its inputs and its name."""
        clones = {_sid(c): ("in", k) for k, c in enumerate(fresh.values(), start=1)}

        def ref(s: int) -> tuple[str, Any] | None:
            if s in clones:
                return clones[s]
            if s in out_keys and out_keys[s].startswith(n.name):  # the name of one of its outputs
                return "name", out_keys[s][len(n.name):]
            return None

        saved = []
        for i, t in enumerate(saved_tensors):
            s = _sid(t)
            if s not in self.param_storages:
                saved.append((ref(s) or ("saved", i), t.untyped_storage().nbytes()))
        leaves, spec = pytree.tree_flatten(out)
        kept: list[Any] = []
        for v in leaves:
            if isinstance(v, Tensor):
                r = ref(_sid(v))
                if r is None or v.layout != torch.strided or _sid(v) in self.param_storages:
                    return None
                kept.append(_Out(tuple(v.shape), v.stride(), v.dtype, v.device, r))
            elif type(v) in _PLAIN:
                kept.append(v)
            else:
                return None
        return _Outcome(cost.flops_fwd, cost.flops_bwd, self.grad[n.name], tuple(saved), spec, tuple(kept))

    def _replay(self, n: fx.Node, args: Any, kwargs: Any, o: _Outcome) -> Any:
        """Record a memoised measurement on ``n`` and return fresh tensors laid out as its output."""
        fresh = self._fresh_keys(n, args, kwargs)

        def key(r: tuple[str, Any]) -> str:
            kind, v = r
            return fresh[v - 1] if kind == "in" else n.name + v if kind == "name" else f"{n.name}:saved{v}"

        saved: dict[str, int] = {}
        for r, nbytes in o.saved:
            k = key(r)
            saved[k] = max(saved.get(k, 0), nbytes)
        leaves = []
        for v in o.leaves:
            if isinstance(v, _Out):
                with no_dispatch():
                    meta = torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device="meta")
                t = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, v.device)
                self.keys[_sid(t)] = key(v.ref)
                v = t
            leaves.append(v)
        out = pytree.tree_unflatten(leaves, o.spec)
        self.grad[n.name] = o.grad
        n.meta[META_KEY] = NodeCost(flops_fwd=o.flops_fwd, flops_bwd=o.flops_bwd, params=self._call_params(n),
                                    saved=saved, value=_structured(n.name, out, tensor_spec),
                                    storage=self._storage_keys(n, out, {}))
        return out

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
    on the model changes (buffers such as BatchNorm statistics are updated on fake copies only). A node that
    repeats an earlier one (the same torch function or ``torch.nn`` module configuration on arguments of the
    same layouts) gets that node's measurement without running again.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    placeholder_names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    args = dict(zip(placeholder_names, inputs))
    args.update(kwargs or {})
    values = [args[name] for name in placeholder_names]
    with train_mode(gm), mode, contextlib.ExitStack() as stack:
        state = _FakeState(gm, mode, stack)
        if state.needs_all(values):
            state.swap_all()
        fake_args = [mode.from_tensor(a) if isinstance(a, Tensor) else a for a in values]
        _Measure(gm, state).run(*fake_args)


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

"""Measure every traced node's FLOPs, parameters and saved activations on fake tensors, without running them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree
from torch.utils._mode_utils import no_dispatch

from ..capture.fake_state import FakeState, on_device, storage_id
from ..capture.memo import PLAIN, Out, Outcome, Uncacheable, module_signature, plain, pure_function
from ..capture.meta import input_device
from ..capture.trace import misfit_message, module_path, train_mode
from ..errors import PlanError, PPLLError
from ..plans.plan import TensorSpec
from .flops import flop_counter
from .oplog import Op, OpLog

_VALUE_DEPENDENT = (DataDependentOutputException, GuardOnDataDependentSymNode)

META_KEY = "ppll_cost"
"""The ``node.meta`` key under which :func:`measure_graph` stores each node's :class:`NodeCost`."""

@dataclass(frozen=True, kw_only=True)
class NodeCost:
    """What one traced node costs, measured at the planned batch size."""

    flops_fwd: int
    """Forward FLOPs counted by FlopCounterMode (plus formulas for attention kernels it does not count)."""
    flops_bwd: int
    """Backward FLOPs of the node's own backward pass."""
    flops_bwd_params: int = 0
    """Backward FLOPs when its inputs need no gradient (only its parameters': a stage's first layers, whose input
    arrives detached); 0 for a node without trainable parameters."""
    ops_fwd: tuple[Op, ...] = ()
    """Every operator of the forward, with its FLOPs and bytes (for the roofline)."""
    ops_bwd: tuple[Op, ...] = ()
    """Every operator of the backward."""
    ops_bwd_params: tuple[Op, ...] = ()
    """Every operator of the backward when its inputs need no gradient."""
    grad: bool = False
    """Whether its output needs a gradient in training (with the model's input as the only input)."""
    params: dict[str, int] = field(default_factory=dict)
    """Qualified name -> element count of every parameter the node uses."""
    saved: dict[str, int] = field(default_factory=dict)
    """Activation bytes saved for backward, keyed by the storage they belong to (shared keys are the same
    memory: a node output saved by several consumers counts once)."""
    saved_float32: frozenset[str] = frozenset()
    """The keys of :attr:`saved` whose storage holds float32 values (what a lower precision halves)."""
    value: Any = None
    """TensorSpec of the node's output; a tuple/list/dict of them for structured outputs; an int for a
    Python scalar; None for anything else."""
    storage: Any = None
    """Storage key of the node's output, with the same structure as ``value`` (views share their base's key)."""


def tensor_spec(name: str, value: Any) -> TensorSpec | None:
    """TensorSpec of a tensor or Python int value (None for anything else)."""
    if isinstance(value, Tensor):
        return TensorSpec(name=name, shape=tuple(int(s) for s in value.shape),
                          dtype=str(value.dtype).removeprefix("torch."),
                          bytes=value.numel() * value.element_size())
    if isinstance(value, (int, float, bool)):
        return TensorSpec(name=name, shape=(), dtype=type(value).__name__, bytes=0, scalar=True)
    return None


def _structured(name: str, value: Any, leaf: Callable[[str, Any], Any]) -> Any:
    """Apply ``leaf`` to every element of a (possibly nested) output, naming elements ``name.i``."""
    if isinstance(value, (tuple, list)):
        items = [_structured(f"{name}.{i}", v, leaf) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _structured(f"{name}.{k}", v, leaf) for k, v in value.items()}
    return leaf(name, value)


def _first_saves(saved_tensors: Sequence[Tensor]) -> dict[int, int]:
    """Storage id -> index of the first saved tensor of that storage: views of one storage (a packed QKV
    projection's q, k and v) are one saved activation."""
    first: dict[int, int] = {}
    for i, t in enumerate(saved_tensors):
        first.setdefault(storage_id(t), i)
    return first


class _Measure(fx.Interpreter):
    """Runs a GraphModule on fake tensors, measuring each node in isolation (forward and backward).

    A node whose target, arguments' layouts and constants equal an earlier node's is not run again: its
    measurement (FLOPs, saved bytes, output layout, which storages alias its inputs) is replayed.
    """

    def __init__(self, gm: fx.GraphModule, state: FakeState, reuse: bool):
        super().__init__(gm, garbage_collect_values=True)
        self.reuse = reuse
        self.state = state
        self.mode = state.mode
        self.param_storages = state.storages  # storage ids of the fake parameters and buffers
        self.keys = state.keys
        self.grad: dict[str, bool] = {}  # node name -> whether its output requires grad in training
        self.memo: dict[Any, Outcome] = {}
        self.module_signatures: dict[str, Any] = {}
        self.current: fx.Node | None = None  # the node being measured, for an error that names it

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        if n.op == "output":
            return super().run_node(n)
        if n.op in ("placeholder", "get_attr"):
            return self._run_input(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        needs_grad = any(self.grad.get(a.name, False) for a in n.all_input_nodes)
        signature = self._signature(n, args, kwargs, needs_grad) if self.reuse else None
        if signature is not None and signature in self.memo:
            return self._replay(n, args, kwargs, self.memo[signature])
        self._swap_state(n, args)
        fresh: dict[int, Tensor] = {}
        inputs_keys: dict[int, str] = {}

        def prepare(x: Any) -> Any:
            if not isinstance(x, Tensor) or storage_id(x) in self.param_storages:
                return x
            if id(x) not in fresh:
                leaf = x.detach().requires_grad_(needs_grad and x.is_floating_point())
                clone = leaf.clone()
                fresh[id(x)] = clone
                inputs_keys[storage_id(clone)] = self.keys.get(storage_id(x), f"{n.name}:in{len(fresh)}")
            return fresh[id(x)]

        args, kwargs = pytree.tree_map(prepare, (args, kwargs))
        saved_tensors: list[Tensor] = []
        try:
            with flop_counter() as fwd_counter, OpLog() as log, torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved_tensors.append(t) or t, lambda t: t):
                out = getattr(self, n.op)(n.target, args, kwargs)
            fwd, backward = fwd_counter.get_total_flops(), self._backward(n, out, args, kwargs)
        except _VALUE_DEPENDENT:  # Python that reads tensor values (a leaf module's data-dependent branch)
            out, fwd, ops = _run_real(self, n, args, kwargs, needs_grad)
            log = OpLog()
            log.ops = ops
            backward = (2 * fwd, 2 * fwd, ops + ops, ops + ops)
            self.grad[n.name] = needs_grad
            saved_tensors, signature = [], None
        out_keys = self._register_output(n, out, inputs_keys)
        saved, floats = self._saved(n, saved_tensors, {**inputs_keys, **out_keys})
        bwd, bwd_params, ops_bwd, ops_bwd_params = backward
        n.meta[META_KEY] = NodeCost(flops_fwd=fwd, flops_bwd=bwd, flops_bwd_params=bwd_params,
                                    ops_fwd=tuple(log.ops), ops_bwd=tuple(ops_bwd),
                                    ops_bwd_params=tuple(ops_bwd_params),
                                    grad=self.grad[n.name], params=self._call_params(n),
                                    saved=saved, saved_float32=floats,
                                    value=_structured(n.name, out, tensor_spec),
                                    storage=self._storage_keys(n, out, inputs_keys))
        if signature is not None:
            outcome = self._outcome(n, fresh, out, out_keys, saved_tensors, n.meta[META_KEY])
            if outcome is not None:
                self.memo[signature] = outcome
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)

    def _run_input(self, n: fx.Node) -> Any:
        """A placeholder or get_attr node: its value, and a cost of nothing but the parameter it reads."""
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

    def _saved(self, n: fx.Node, saved_tensors: list[Tensor], known: dict[int, str]
               ) -> tuple[dict[str, int], frozenset[str]]:
        """Bytes saved for backward by storage key (parameters excepted; each storage once, at its largest), and the
        keys of those that hold float32 values."""
        saved: dict[str, int] = {}
        floats: set[str] = set()
        first = _first_saves(saved_tensors)
        for t in saved_tensors:
            s = storage_id(t)
            if s in self.param_storages:
                continue
            key = known.get(s, f"{n.name}:saved{first[s]}")
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
            if t.dtype == torch.float32:
                floats.add(key)
        return saved, frozenset(floats)

    def _backward(self, n: fx.Node, out: Any, args: Any, kwargs: Any) -> tuple[int, int, list[Op], list[Op]]:
        """FLOPs and operators of the node's own backward, in full and with only its parameters' gradients (as
        when its input arrives detached); records whether its output needs a gradient in training."""
        grads = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        self.grad[n.name] = bool(grads)
        if not grads:
            return 0, 0, [], []
        ones = [torch.ones_like(g) for g in grads]
        params = self._fake_params(n, args, kwargs)
        bwd_params, ops_params = 0, []
        inputs_need_grad = any(isinstance(x, Tensor) and x.requires_grad and storage_id(x) not in self.param_storages
                               for x in pytree.tree_leaves((args, kwargs)))
        if params and inputs_need_grad:
            with flop_counter() as counter, OpLog() as log:
                torch.autograd.grad(grads, params, ones, retain_graph=True, allow_unused=True)
            bwd_params, ops_params = counter.get_total_flops(), log.ops
        with flop_counter() as bwd_counter, OpLog() as log:
            torch.autograd.backward(grads, ones)
        bwd = bwd_counter.get_total_flops()
        if params and not inputs_need_grad:  # the full backward is the parameters' alone
            bwd_params, ops_params = bwd, log.ops
        return bwd, bwd_params, log.ops, ops_params

    def _fake_params(self, n: fx.Node, args: Any, kwargs: Any) -> list[Tensor]:
        """The fakes of the trainable parameters ``n`` uses (its module's, or passed in as arguments)."""
        found = {id(x): x for x in pytree.tree_leaves((args, kwargs))
                 if isinstance(x, Tensor) and x.requires_grad and storage_id(x) in self.param_storages}
        if n.op == "call_module":
            for p in self.module.get_submodule(n.target).parameters():
                f = self.state.fakes.get(id(p), p)
                if f.requires_grad:
                    found.setdefault(id(f), f)
        return list(found.values())

    def fetch_attr(self, target: str) -> Any:
        obj = super().fetch_attr(target)
        return self.state.fake(obj) if isinstance(obj, Tensor) and id(obj) in self.state.state else obj

    def _swap_state(self, n: fx.Node, args: Any) -> None:
        """Swap in the fake parameters and buffers ``n`` may read: its module's own, or all of them."""
        if n.op == "call_module" and self.module_signatures.get(n.target) is not None:
            self.state.swap_module(n.target)
        elif not (n.op == "call_function" and pure_function(n.target)
                  or n.op == "call_method" and args and isinstance(args[0], Tensor)):
            self.state.swap_all()

    def _signature(self, n: fx.Node, args: Any, kwargs: Any, needs_grad: bool) -> Any:
        """Everything a node's measurement depends on, or None when that cannot be told exactly."""
        try:
            if n.op == "call_module":
                if n.target not in self.module_signatures:
                    try:
                        self.module_signatures[n.target] = module_signature(self.module.get_submodule(n.target))
                    except Uncacheable:
                        self.module_signatures[n.target] = None
                target = self.module_signatures[n.target]
                if target is None:
                    return None
            elif n.op == "call_function":
                target = plain(n.target)
            else:
                target = n.target
            leaves, spec = pytree.tree_flatten((args, kwargs))
            first: dict[int, int] = {}
            sig = []
            for x in leaves:
                if not isinstance(x, Tensor):
                    sig.append(plain(x))
                    continue
                if not isinstance(x, FakeTensor) or x.layout != torch.strided:
                    return None
                param = storage_id(x) in self.param_storages
                sig.append((first.setdefault(id(x), len(first)), param, tuple(x.shape), x.stride(), x.dtype,
                            x.device, x.storage_offset() if param else 0, x.requires_grad if param else None))
            return n.op, target, needs_grad, spec, tuple(sig)
        except Uncacheable:
            return None

    def _fresh_keys(self, n: fx.Node, args: Any, kwargs: Any) -> list[str]:
        """The storage key of every distinct non-parameter input tensor, in the order they are cloned."""
        seen: set[int] = set()
        keys = []
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, Tensor) and storage_id(x) not in self.param_storages and id(x) not in seen:
                seen.add(id(x))
                keys.append(self.keys.get(storage_id(x), f"{n.name}:in{len(seen)}"))
        return keys

    def _outcome(self, n: fx.Node, fresh: dict[int, Tensor], out: Any, out_keys: dict[int, str],
                 saved_tensors: list[Tensor], cost: NodeCost) -> Outcome | None:
        """The measurement of ``n`` with storage keys expressed relative to its inputs and its name."""
        clones = {storage_id(c): ("in", k) for k, c in enumerate(fresh.values(), start=1)}

        def ref(s: int) -> tuple[str, Any] | None:
            if s in clones:
                return clones[s]
            if s in out_keys and out_keys[s].startswith(n.name):  # the name of one of its outputs
                return "name", out_keys[s][len(n.name):]
            return None

        saved = []
        first = _first_saves(saved_tensors)
        for t in saved_tensors:
            s = storage_id(t)
            if s not in self.param_storages:
                saved.append((ref(s) or ("saved", first[s]), t.untyped_storage().nbytes(), t.dtype == torch.float32))
        leaves, spec = pytree.tree_flatten(out)
        kept: list[Any] = []
        for v in leaves:
            if isinstance(v, Tensor):
                r = ref(storage_id(v))
                if r is None or v.layout != torch.strided or storage_id(v) in self.param_storages:
                    return None
                kept.append(Out(tuple(v.shape), v.stride(), v.dtype, v.device, r))
            elif type(v) in PLAIN:
                kept.append(v)
            else:
                return None
        return Outcome(cost.flops_fwd, cost.flops_bwd, self.grad[n.name], tuple(saved), spec, tuple(kept),
                       (cost.flops_bwd_params, cost.ops_fwd, cost.ops_bwd, cost.ops_bwd_params))

    def _replay(self, n: fx.Node, args: Any, kwargs: Any, o: Outcome) -> Any:
        """Record a memoised measurement on ``n`` and return fresh tensors laid out as its output."""
        fresh = self._fresh_keys(n, args, kwargs)

        def key(r: tuple[str, Any]) -> str:
            kind, v = r
            return fresh[v - 1] if kind == "in" else n.name + v if kind == "name" else f"{n.name}:saved{v}"

        saved: dict[str, int] = {}
        floats: set[str] = set()
        for r, nbytes, float32 in o.saved:
            k = key(r)
            saved[k] = max(saved.get(k, 0), nbytes)
            if float32:
                floats.add(k)
        leaves = []
        for v in o.leaves:
            if isinstance(v, Out):
                with no_dispatch():
                    meta = torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device="meta")
                t = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, v.device)
                self.keys[storage_id(t)] = key(v.ref)
                v = t
            leaves.append(v)
        out = pytree.tree_unflatten(leaves, o.spec)
        self.grad[n.name] = o.grad
        bwd_params, ops_fwd, ops_bwd, ops_bwd_params = o.work
        n.meta[META_KEY] = NodeCost(flops_fwd=o.flops_fwd, flops_bwd=o.flops_bwd, flops_bwd_params=bwd_params,
                                    ops_fwd=ops_fwd, ops_bwd=ops_bwd, ops_bwd_params=ops_bwd_params,
                                    grad=o.grad, params=self._call_params(n),
                                    saved=saved, saved_float32=frozenset(floats),
                                    value=_structured(n.name, out, tensor_spec),
                                    storage=self._storage_keys(n, out, {}))
        return out

    def _register_output(self, n: fx.Node, out: Any, inputs_keys: dict[int, str]) -> dict[int, str]:
        """Give every output tensor a storage key: its input's key when it is a view/in-place result."""
        new: dict[int, str] = {}

        def leaf(name: str, v: Any) -> None:
            if isinstance(v, Tensor):
                s = storage_id(v)
                new[s] = inputs_keys.get(s, name)
        _structured(n.name, out, leaf)
        self.keys.update(new)
        return new

    def _storage_keys(self, n: fx.Node, out: Any, inputs_keys: dict[int, str]) -> Any:
        return _structured(n.name, out,
                           lambda name, v: self.keys.get(storage_id(v), name) if isinstance(v, Tensor) else None)

    def _attr_params(self, n: fx.Node) -> dict[str, int]:
        if n.op != "get_attr":
            return {}
        t = super().fetch_attr(n.target)  # the real attribute: its fake is no Parameter
        return {str(n.target): t.numel()} if isinstance(t, nn.Parameter) else {}

    def _call_params(self, n: fx.Node) -> dict[str, int]:
        if n.op == "call_module":
            mod = self.module.get_submodule(n.target)
            return {f"{n.target}.{k}": p.numel() for k, p in mod.named_parameters()}
        return {}


def _run_real(measure: _Measure, n: fx.Node, args: Any, kwargs: Any, needs_grad: bool) -> tuple[Any, int, list[Op]]:
    """Run a node of ``measure`` whose output depends on tensor values, which fake tensors lack, once on real tensors
    of the fakes' shapes (random values; the module's own parameters, its buffers copied): its output as fakes,
    its forward FLOPs and operators. Its backward is taken as twice those; its saved activations are not
    counted."""
    real_of = {id(f): measure.state.state[key] for key, f in measure.state.fakes.items()}

    def real(x: Any) -> Any:
        if not isinstance(x, FakeTensor):
            return x
        if id(x) in real_of and not real_of[id(x)].is_meta:  # a meta model's parameter: random values
            return real_of[id(x)].detach()
        if x.is_floating_point():
            return torch.randn(x.shape, dtype=x.dtype, device=x.device)
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)

    with unset_fake_temporarily(), torch.no_grad():
        args, kwargs = pytree.tree_map(real, (args, kwargs))
        with flop_counter() as counter, OpLog() as log:
            if n.op == "call_module":
                m = measure.module.get_submodule(n.target)
                tensors = {k: real(v).clone() for k, v in (*m.named_parameters(), *m.named_buffers())}
                out = torch.func.functional_call(m, tensors, args, kwargs)
            else:
                out = getattr(measure, n.op)(n.target, args, kwargs)

    def fake(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        f = measure.mode.from_tensor(t)
        return f.requires_grad_() if needs_grad and f.is_floating_point() else f
    return pytree.tree_map(fake, out), counter.get_total_flops(), log.ops


def measure_graph(gm: fx.GraphModule, inputs: Sequence[Any], kwargs: dict[str, Any] | None = None, *,
                  reuse: bool = True) -> None:
    """Measure every node of ``gm`` on fake tensors and store a :class:`NodeCost` in ``node.meta[META_KEY]``.

    ``inputs`` may be real or fake tensors (only shapes and dtypes matter); no real compute runs, nothing
    on the model changes (buffers such as BatchNorm statistics are updated on fake copies only). A node that
    repeats an earlier one (the same torch function or ``torch.nn`` module configuration on arguments of the
    same layouts) gets that node's measurement without running again, and a parameter is made fake only when
    a node reads it; ``reuse=False`` runs every node and makes every parameter fake up front (the reference
    the shortcuts must equal).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    placeholder_names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    args = dict(zip(placeholder_names, inputs))
    args.update(kwargs or {})
    values = [args[name] for name in placeholder_names]
    with train_mode(gm), mode, contextlib.ExitStack() as stack:
        device = input_device(values)
        state = FakeState(gm, mode, stack, device)
        if not reuse or state.needs_all(values):
            state.swap_all()
        fake_args = [on_device(mode.from_tensor(a), device) if isinstance(a, Tensor) else a for a in values]
        measure = _Measure(gm, state, reuse)
        disabled = logging.root.manager.disable  # torch logs a failing fake kernel's traceback; the error says it
        logging.disable(max(disabled, logging.ERROR))
        try:
            measure.run(*fake_args)
        except PPLLError:
            raise
        except Exception as e:
            node, where = measure.current, "a node"
            if node is not None:
                where = f"node {node.name!r}" + (f" (module {module_path(node)!r})" if module_path(node) else "")
            raise PlanError(misfit_message(where, e, dict(zip(placeholder_names, values)))) from e
        finally:
            logging.disable(disabled)

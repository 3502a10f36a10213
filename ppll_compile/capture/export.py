"""The second front end: capture a model with ``torch.export`` where symbolic tracing cannot (Hugging Face models,
``**kwargs`` forwards, Python that reads shapes), as an fx graph over the model's own parameters."""

from __future__ import annotations

import contextlib
import inspect
import io
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import PlanError, TraceError
from .modes import merge_modes
from .trace import attribute, in_mode, misfit_message, module_path, quiet, rejecting_module, warned

OUTPUT_SPEC = "ppll_output_spec"
"""``GraphModule.meta`` key of the pytree spec that rebuilds the model's output (a ``ModelOutput``, a tuple, a
dict) from the exported graph's flat outputs."""


def _export_once(model: nn.Module, kwargs: dict[str, Any], dynamic: Any,
                 training: bool) -> torch.export.ExportedProgram:
    # torch.export prints the partial graph of a failed capture to stderr; the error says what matters
    with in_mode(model, training), quiet() as caught, contextlib.redirect_stderr(io.StringIO()):
        try:
            return torch.export.export(model, (), kwargs, dynamic_shapes=dynamic, strict=False)
        except Exception as e:
            e.add_note(warned(caught))
            raise


ONCE_NOTE = ("train and eval mode run the same operators on the same values, so torch.export captured the model "
             "once (in train mode)")
"""The note of an export that captured one mode only (see :func:`mode_matters`)."""


class _OpLog(TorchDispatchMode):
    """Records every operator call below autograd but metadata queries: the operator, the grad mode, and its
    arguments with each tensor replaced by where it comes from (a parameter or buffer by name, an input by name, an earlier call's output)."""

    def __init__(self, labels: dict[int, Any]) -> None:
        super().__init__()
        self.labels = labels  # id of a live tensor -> its origin
        self.alive: list[torch.Tensor] = []  # keeps every labelled tensor alive, so that no id is reused
        self.calls: list[Any] = []

    def label(self, v: Any) -> Any:
        return self.labels.get(id(v), ("unknown", tuple(v.shape), v.dtype)) if isinstance(v, torch.Tensor) else v

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim" or func.__name__.startswith("sym_"):
            return out  # a query of metadata (a tensor's device, size): no value computed
        self.calls.append((str(func), torch.is_grad_enabled(), pytree.tree_map(self.label, (args, kwargs))))
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor) and id(t) not in self.labels:
                self.alive.append(t)
                self.labels[id(t)] = ("call", len(self.calls) - 1, j, tuple(t.shape), t.dtype, t.stride())
        return out


def _operator_log(model: nn.Module, kwargs: dict[str, Any], training: bool) -> list[Any]:
    """Every operator ``model`` runs on fake copies of its state and of ``kwargs`` in one mode, and its output."""
    mode = FakeTensorMode()
    state = {k: mode.from_tensor(t) for k, t in (*model.named_parameters(remove_duplicate=False),
                                                  *model.named_buffers(remove_duplicate=False))}
    meta = any(t.is_meta for t in state.values())  # a model built on the meta device: its inputs go there too
    given = {k: mode.from_tensor(v.to("meta") if meta else v) if isinstance(v, torch.Tensor) else v
             for k, v in kwargs.items()}
    log = _OpLog({**{id(t): ("state", k) for k, t in state.items()},
                  **{id(v): ("input", k) for k, v in given.items() if isinstance(v, torch.Tensor)}})
    with in_mode(model, training), quiet(), contextlib.redirect_stderr(io.StringIO()), mode, log:
        out = torch.func.functional_call(model, state, (), given, strict=False)
    leaves, spec = pytree.tree_flatten(out)
    return [*log.calls, ("output", spec, [log.label(v) for v in leaves])]


def mode_matters(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether ``model`` called with ``kwargs`` may compute differently in train and in eval mode.

    Both modes are run eagerly on fake tensors (shapes only, no real compute) and every operator call below
    autograd is logged with the grad mode and its arguments, each tensor named by where it comes from; equal
    logs and outputs mean the same computation on the same values, whatever Python read ``self.training`` on
    the way (a dropout of probability 0 in train mode, ``p=0.0 if not self.training else self.p`` with ``p``
    0). A run that fails on fake tensors counts as a difference (both modes are then captured).
    """
    try:
        return _operator_log(model, kwargs, True) != _operator_log(model, kwargs, False)
    except Exception:  # noqa: BLE001 - Python that reads values, a kernel without a fake: capture both modes
        return True


def _attr(model: nn.Module, unlifted: nn.Module, target: str) -> Any:
    """An attribute the exported graph reads: the model's own object (a parameter, a buffer), else the export's
    (a lifted constant)."""
    try:
        return attribute(target, model, unlifted)
    except AttributeError:
        raise TraceError(f"the exported graph reads {target!r}, which neither the model nor the export holds") from None


def _graph_module(model: nn.Module, ep: torch.export.ExportedProgram, names: Sequence[str]) -> fx.GraphModule:
    """The exported program as a plain GraphModule over the model's own parameters and buffers: flat inputs
    named like ``forward``'s arguments, flat outputs, no input guards (batches of other sizes are welcome)."""
    unlifted = ep.module()
    graph = unlifted.graph
    for n in [n for n in graph.nodes if n.op == "call_module" and not n.users]:
        graph.erase_node(n)  # the shape guards torch.export adds on the inputs
    for n in [n for n in graph.nodes if n.op == "placeholder" and n.target not in names and not n.users]:
        graph.erase_node(n)  # a Python value passed as an argument: a constant of the graph
    graph._codegen = fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if [n.target for n in placeholders] != list(names):
        raise TraceError(f"torch.export took inputs {[n.target for n in placeholders]}, expected {list(names)}: "
                         "pass the model's tensor inputs as top-level arguments, not inside lists or dicts")
    attrs = {n.target: _attr(model, unlifted, n.target) for n in graph.nodes if n.op == "get_attr"}
    _static_last_marked(graph)
    gm = fx.GraphModule(attrs, graph, class_name=type(model).__name__)
    gm.meta[OUTPUT_SPEC] = unlifted._out_spec
    return gm


_ATEN = torch.ops.aten


def _is(n: Any, op: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target == op


def _descendants(roots: Sequence[fx.Node]) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen[n] = None
            todo.extend(n.users)
    return list(seen)


def _static_last_marked(graph: fx.Graph) -> None:
    """Rewrite the end-of-sequence pooling of Hugging Face's encoder-decoder classifiers (BART's, T5's:
    ``h[eos_mask, :].view(N, -1, D)[:, -1, :]`` after checking with ``unique_consecutive`` that every example
    holds as many end-of-sequence tokens) into operators of static shape, which planning can measure on fake
    tensors: the position of each row's last marked token is the first maximum of the mask's running count
    (``argmax(cumsum(mask))``), and ``take_along_dim`` reads the hidden state there. Equal counts make the two the
    same; the check stays, as an assertion on the counts (``_assert_async``, a no-op on fake tensors)."""
    for index in [n for n in graph.nodes if _is(n, _ATEN.index.Tensor)]:
        h, indices = index.args
        if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], fx.Node)):
            continue
        mask = indices[0]
        view = next((u for u in index.users if _is(u, _ATEN.view.default)), None)
        tail = next((u for u in view.users if _is(u, _ATEN.slice.Tensor)), None) if view is not None else None
        select = next((u for u in tail.users if _is(u, _ATEN.select.int) and u.args[1:] == (1, -1)), None) \
            if tail is not None else None
        value = mask.meta.get("val")
        if select is None or value is None or value.dtype != torch.bool or value.dim() != 2:
            continue
        counts = next((a for u in mask.users if _is(u, _ATEN.sum.dim_IntList) for a in [u]), None)
        checks = [u for u in counts.users if _is(u, _ATEN.unique_consecutive.default)] if counts is not None else []
        with graph.inserting_before(select):
            last = graph.call_function(_ATEN.argmax.default, (graph.call_function(_ATEN.cumsum.default, (mask, 1)),
                                                              1, True))
            at = graph.call_function(_ATEN.unsqueeze.default, (last, -1))
            pooled = graph.call_function(_ATEN.select.int, (graph.call_function(torch.take_along_dim, (h, at, 1)),
                                                            1, 0))
        select.replace_all_uses_with(pooled)
        if checks:
            with graph.inserting_before(checks[0]):
                first = graph.call_function(_ATEN.slice.Tensor, (counts, 0, 0, 1))
                same = graph.call_function(_ATEN.all.default, (graph.call_function(_ATEN.eq.Tensor, (counts, first)),))
                graph.call_function(_ATEN._assert_async.msg, (same, "All examples must have the same number of "
                                                                    "<eos> tokens."))
        dead = _descendants([index, *checks])
        while dead:
            gone = [n for n in dead if not n.users]
            if not gone:
                break
            for n in gone:
                graph.erase_node(n)
            dead = [n for n in dead if n not in gone]


def keep_whole(gm: fx.GraphModule, model: nn.Module, path: str) -> bool:
    """Replace the nodes ``gm`` captured inside the model's module at ``path`` by one call of that module on the one
    tensor they read from outside it (sizes read off it are recomputed inside); ``False`` (``gm`` unchanged) unless
    they read one tensor, give one tensor to the rest of the graph, and the module's ``forward`` takes one
    argument. ``True`` when the graph holds no node of the module (nothing to replace)."""
    nodes = list(gm.graph.nodes)
    block = [n for n in nodes if n.op != "placeholder" and (module_path(n) == path
                                                             or module_path(n).startswith(path + "."))]
    if not block:
        return True
    inside = set(block)
    outputs = [n for n in block if any(u not in inside for u in n.users)]
    reads = list(dict.fromkeys(a for n in block for a in n.all_input_nodes if a not in inside))
    tensors = [a for a in reads if isinstance(a.meta.get("val"), torch.Tensor)]
    module = model.get_submodule(path)
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty]
    if len(outputs) != 1 or len(tensors) != 1 or len(required) > 1 or not params \
            or not isinstance(outputs[0].meta.get("val"), torch.Tensor):
        return False
    first = min(nodes.index(n) for n in block)
    if any(nodes.index(a) > first for a in tensors):
        return False
    gm.add_submodule(path, module)
    with gm.graph.inserting_before(block[0]):
        call = gm.graph.call_module(path, tuple(tensors))
    call.meta.update({k: v for k, v in outputs[0].meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
    outputs[0].replace_all_uses_with(call)
    for n in reversed(block):
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return True


def _free_dims(t: torch.Tensor) -> int:
    """How many leading dimensions to leave free: all of a token-id tensor's, the batch of others."""
    return t.dim() if not (t.is_floating_point() or t.is_complex()) else min(t.dim(), 1)


def export(model: nn.Module, inputs: dict[str, torch.Tensor], fixed: dict[str, Any], *,
           bake_train_mode: bool = False) -> tuple[fx.GraphModule, list[str]]:
    """Capture ``model`` called with tensor ``inputs`` (by argument name) and the non-default ``fixed`` values,
    in train and in eval mode, merged so that the graph follows ``train()``/``eval()``; and notes on the capture.
    Where the mode changes nothing (:func:`mode_matters`), the train-mode capture serves both and the notes say so.

    The batch dimension, and every dimension of integer inputs (a sequence's length), is captured as dynamic
    where the model allows it, so the stages take other sizes (images keep their size: leaving it free makes
    capture many times slower); where the model allows none, the notes say that batches must have the
    example's shapes.
    """
    signature = inspect.signature(model.forward).parameters
    passed = {k: v for k, v in fixed.items()
              if k in signature and signature[k].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                              inspect.Parameter.VAR_KEYWORD)
              and v is not signature[k].default}
    kwargs = {**inputs, **passed}
    dynamic = {k: ({d: torch.export.Dim.AUTO for d in range(_free_dims(inputs[k]))} if k in inputs else None)
               for k in kwargs}
    notes: list[str] = []
    modes = (True, False) if mode_matters(model, kwargs) else (True,)
    if len(modes) == 1:
        notes.append(ONCE_NOTE)
    try:
        programs = [_export_once(model, kwargs, dynamic, mode) for mode in modes]
    except Exception:  # noqa: BLE001 - a batch size the model cannot leave free: capture the example's
        try:
            programs = [_export_once(model, kwargs, None, mode) for mode in modes]
        except Exception as e:
            rejected = rejecting_module(model, (), kwargs)
            if rejected is not None:
                raise PlanError(misfit_message(*rejected, inputs)) from e
            raise TraceError(f"torch.export cannot capture {type(model).__name__}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}{''.join(getattr(e, '__notes__', []))}"
                             ) from e
        batch = next(iter(inputs.values())).shape[0]
        notes.append(f"torch.export fixed the input shapes: the stages take batches of exactly {batch} examples of "
                     f"the example's shape")
    train, *others = (_graph_module(model, ep, list(inputs)) for ep in programs)
    if not others:
        return train, notes
    merge = merge_modes(train, others[0], partial=bake_train_mode)
    paths = sorted({module_path(n) or type(model).__name__ + ".forward" for n in merge.sources or merge.structural})
    if merge.structural and not bake_train_mode and all(p in dict(model.named_modules()) for p in paths):
        # modules that compute differently by mode (stochastic depth): each kept whole, a call of the model's own
        # module that follows the mode itself, in both captures; then merged again
        if all(keep_whole(train, model, p) for p in paths):
            for p in paths:
                keep_whole(others[0], model, p)
            merge = merge_modes(train, others[0])
            if not merge.structural:
                notes.append(f"kept whole, as each computes differently in train and in eval mode: {paths}")
                return train, notes
            train = _graph_module(model, programs[0], list(inputs))
            merge = merge_modes(train, _graph_module(model, programs[1], list(inputs)))
    if merge.structural and not bake_train_mode:
        raise TraceError(f"{type(model).__name__} computes differently in train and in eval mode in {paths} "
                         f"(a branch on self.training), which one exported graph cannot follow. Ways out: "
                         f"tracer='fx' with leaf_modules={[p for p in paths if '.forward' not in p]} (those "
                         f"modules then stay opaque and switch with the mode), or bake_train_mode=True to keep "
                         f"the train-mode computation in eval as well")
    return train, notes

"""Trace an unmodified nn.Module with torch.fx, keeping train/eval switchable and failing with a teaching error."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import logging
import operator
import sys
import traceback
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from ..errors import TraceError
from .modes import SWITCH_PREFIX, merge_modes

_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = __file__


@contextmanager
def in_mode(module: nn.Module, training: bool) -> Iterator[nn.Module]:
    """Put ``module`` in train (or eval) mode for the block, then restore every submodule's own mode."""
    was_training = {m: m.training for m in module.modules()}
    module.train(training)
    try:
        yield module
    finally:
        for m, t in was_training.items():
            m.training = t


def train_mode(module: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Put ``module`` in train mode for the block, then restore every submodule's own mode."""
    return in_mode(module, True)


@contextmanager
def quiet() -> Iterator[list[warnings.WarningMessage]]:
    """Hold back the warnings and log lines a capture emits (tracer and model chatter, torch.export's graph
    dumps); the warnings are kept to explain a refusal."""
    disabled = logging.root.manager.disable
    logging.disable(max(disabled, logging.WARNING))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        logging.disable(disabled)


def fixed_arguments(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict[str, Any],
                    *, allow_var: bool) -> tuple[list[str], dict[str, Any]]:
    """The ``forward`` arguments the graph takes (given tensors, in signature order) and those it fixes.

    An argument not given is fixed to its default; one given as a non-tensor Python value (``flag=True``,
    ``temperature=0.5``) is fixed to that value: both become constants of the graph. ``*args``/``**kwargs``
    (allowed for ``torch.export`` only) are fixed empty.
    """
    name = type(model).__name__
    params = list(inspect.signature(model.forward).parameters.values())
    var = [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if var and not allow_var:
        raise TraceError(f"{name}.forward takes *args or **kwargs, which torch.fx cannot trace; use "
                         "tracer='export' (or 'auto'), or wrap the model in a module whose forward names its inputs")
    named = [p for p in params if p not in var]
    positional = [p.name for p in named if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(example_inputs) > len(positional):
        raise TraceError(f"{name}.forward takes {len(positional)} positional argument(s) {positional}, but "
                         f"{len(example_inputs)} example inputs were given; drop the extra ones (keyword-only "
                         f"arguments go in example_kwargs)")
    twice = [n for n in positional[:len(example_inputs)] if n in example_kwargs]
    if twice:
        raise TraceError(f"{name}.forward gets {twice} both from example_inputs (by position) and from "
                         f"example_kwargs; give each argument once")
    given = dict(zip(positional, example_inputs)) | dict(example_kwargs)
    unknown = sorted(set(example_kwargs) - {p.name for p in named})
    if unknown:
        raise TraceError(f"example_kwargs names {unknown}, which {name}.forward does not take "
                         f"(its arguments: {[p.name for p in named]})")
    inputs, fixed = [], {}
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            fixed[p.name] = ()
        elif p.kind == p.VAR_KEYWORD:
            fixed[p.name] = {}
        elif p.name in given and isinstance(given[p.name], torch.Tensor):
            inputs.append(p.name)
        elif p.name in given:
            fixed[p.name] = given[p.name]
        elif p.default is p.empty:
            raise TraceError(f"{name}.forward needs argument {p.name!r}, but the example inputs "
                             "do not give it; pass it in example_inputs=(...) or example_kwargs={...}")
        else:
            fixed[p.name] = p.default
    return inputs, fixed


class _Tracer(fx.Tracer):
    """fx tracer with ppll-compile's leaf policy and a record of the module being traced when tracing fails."""

    def __init__(self, root: nn.Module, leaf_names: set[str], leaf_types: tuple[type, ...],
                 keep: set[str] | None, autowrap_functions: tuple[Any, ...] = ()):
        super().__init__(autowrap_functions=autowrap_functions)
        self._root = root
        self._leaf_names = leaf_names
        self._leaf_types = leaf_types
        self._keep = keep  # with split points: only these module paths (ancestors of a split point) are traced into
        self.failed_module: str | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if m is self._root:
            return False
        if qualname in self._leaf_names or (self._leaf_types and isinstance(m, self._leaf_types)):
            return True
        if self._keep is not None and qualname not in self._keep:
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:
                self.failed_module = self.path_of_module(m)
            raise


_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"  # torch.export's entry for a node outside every module


def attribute(target: str, *roots: Any) -> Any:
    """The attribute at dotted path ``target`` of the first of ``roots`` that has it (``AttributeError`` if none)."""
    for root in roots:
        try:
            return functools.reduce(getattr, target.split("."), root)
        except AttributeError:
            continue
    raise AttributeError(target)


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost module a captured node belongs to ('' for the model's own forward)."""
    if node.op == "call_module" and not str(node.target).startswith(SWITCH_PREFIX):
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(v) for k, v in stack.items() if k != _NO_MODULE]
    return paths[-1] if paths else ""


def _split_point_ancestors(model: nn.Module, split_points: Sequence[str]) -> set[str] | None:
    """Module paths to trace into so that every split point module appears as its own node.

    None (trace everything) when a split point is not a module name: it names a node of the full trace.
    """
    names = dict(model.named_modules())
    if not all(sp in names for sp in split_points):
        return None
    keep: set[str] = set()
    for sp in split_points:
        parts = sp.split(".")
        keep.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return keep


def check_leaf_names(model: nn.Module, names: Iterable[str]) -> None:
    """Every name in ``leaf_modules`` must be a submodule of ``model``; the error suggests close names."""
    known = [n for n, _ in model.named_modules() if n]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise TraceError(f"leaf_modules names {name!r}, which is not a submodule of "
                             f"{type(model).__name__}{hint}")


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and ppll-compile: the model code that failed."""
    frames = [f for f in traceback.extract_tb(tb)
              if not f.filename.startswith(_TORCH_DIR) and f.filename != _THIS_FILE]
    return frames[-1] if frames else None


def trace(model: nn.Module, *, example_inputs: Sequence[Any] = (), example_kwargs: dict[str, Any] | None = None,
          leaf_modules: Iterable[str | type] = (), split_points: Sequence[str] | None = None,
          bake_train_mode: bool = False, autowrap_functions: Sequence[Any] = ()) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule that shares its submodules and parameters, in both modes.

    ``example_inputs``/``example_kwargs`` say which forward arguments are given; the tensors among them
    become the graph's inputs, every other argument a constant (:func:`fixed_arguments`). The model is
    traced in train and in eval mode and the two graphs merged (:func:`~ppll_compile.capture.modes.merge_modes`):
    operations whose arguments the mode changes follow ``train()``/``eval()``; a module whose computation
    the mode changes is traced again as an opaque leaf. ``leaf_modules`` (names or types) stay opaque too.
    With ``split_points`` that are all module names, every module that does not contain a split point is
    kept opaque, which also lets models with untraceable parts be planned. When the model's own ``forward``
    branches on ``self.training``, that is an error unless ``bake_train_mode`` keeps the train branch.
    ``autowrap_functions`` (functions the model's modules call by their global name) are each recorded as one
    call, not traced into.
    """
    leaf_names = {m for m in leaf_modules if isinstance(m, str)}
    leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
    check_leaf_names(model, leaf_names)
    keep = _split_point_ancestors(model, split_points) if split_points else None
    _, concrete = fixed_arguments(model, tuple(example_inputs), dict(example_kwargs or {}), allow_var=False)
    while True:
        train, eval = (_trace_in(model, mode, concrete, leaf_names, leaf_types, keep, tuple(autowrap_functions))
                       for mode in (True, False))
        merge = merge_modes(train, eval)
        if not merge.structural:
            return train
        culprits = merge.sources or merge.structural  # where the difference starts, not what reads it
        paths = {module_path(n) for n in culprits}
        if "" in paths and not bake_train_mode:
            raise ModeBranchError(_root_branches(model, culprits))
        new = {p for p in paths if p} - leaf_names
        if not new:  # bake_train_mode: the root's own train branch stays, the rest follows the mode
            merge_modes(train, eval, partial=True)
            return train
        leaf_names |= new


def _trace_in(model: nn.Module, training: bool, concrete: dict[str, Any], leaf_names: set[str],
              leaf_types: tuple[type, ...], keep: set[str] | None,
              autowrap_functions: tuple[Any, ...] = ()) -> fx.GraphModule:
    """One symbolic trace of ``model`` in the given mode, with the fixed arguments' guards removed."""
    tracer = _Tracer(model, leaf_names, leaf_types, keep, autowrap_functions)
    with in_mode(model, training), quiet() as caught:
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as e:
            raise TraceError(_explain(model, tracer.failed_module, e) + warned(caught)) from e
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    _drop_fixed_placeholders(gm, set(concrete))
    return gm


def library_untraced() -> tuple[tuple[Any, ...], tuple[type, ...]]:
    """The functions and module types that a loaded model library registers as not to be traced into by torch.fx
    (timm's ``register_notrace_function`` / ``register_notrace_module``, e.g. a helper that calls ``int()`` on a
    shape); empty when no such library is loaded."""
    layers = sys.modules.get("timm.layers")
    functions = getattr(layers, "get_notrace_functions", lambda: [])()
    modules = getattr(layers, "get_notrace_modules", lambda: [])()
    return (tuple(f for f in functions if callable(f)), tuple(m for m in modules if isinstance(m, type)))


class ModeBranchError(TraceError):
    """The model's own ``forward`` branches on ``self.training``: no front end captures one graph that follows
    both branches, so ``torch.export`` is not tried after it."""


def _root_branches(model: nn.Module, nodes: Sequence[fx.Node]) -> str:
    where = ", ".join(repr(n.name) for n in nodes[:4]) + (" ..." if len(nodes) > 4 else "")
    return (f"{type(model).__name__}.forward computes differently in train and in eval mode (it branches on "
            f"self.training around {where}), so one captured graph cannot behave like the model in both, whichever "
            f"the tracer. Ways out: keep the train-mode branch in train and eval alike with "
            f"`ppll_compile.compile(model, ..., bake_train_mode=True)` (ppll_compile.plan takes it too, ppll-plan "
            f"--bake-train-mode), or move that branch into a submodule (it then stays opaque and switches with the "
            f"mode)")


_GUARDS = {fx._symbolic_trace._assert_is_none, torch._assert, operator.eq}


def _drop_fixed_placeholders(gm: fx.GraphModule, fixed: set[str]) -> None:
    """Remove the placeholders fx keeps for arguments fixed to constants, with the guards that check them."""
    changed = False
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        if node.target.removesuffix("_1") not in fixed and node.target not in fixed:
            continue
        guards = list(node.users)
        guards += [u for g in guards for u in g.users]
        if any(g.target not in _GUARDS for g in guards):
            continue
        for g in reversed(guards):
            gm.graph.erase_node(g)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


def warned(caught: Sequence[warnings.WarningMessage]) -> str:
    """The distinct warnings a failed capture emitted, as lines to append to its error ('' when none)."""
    lines = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    return "".join(f"\nWarned while capturing: {line}" for line in lines[:3])


def _explain(model: nn.Module, failed_module: str | None, e: Exception) -> str:
    where = f"module {failed_module!r}" if failed_module else f"{type(model).__name__}.forward"
    frame = _user_frame(e.__traceback__)
    line = f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
    target = failed_module or "<module>"
    return (f"torch.fx cannot trace {type(model).__name__}: in {where}{line}: {type(e).__name__}: {e}\n"
            f"Ways out: keep that module opaque with leaf_modules=[{target!r}], or name the cuts yourself with "
            f"split_points=[...module names...] so that only the modules holding them are traced into.")


_UNTELLABLE = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode,
               UnsupportedOperatorException, NotImplementedError)
"""Failures on fake tensors that say nothing about the inputs: the model reads tensor values, or an operation has
no fake implementation."""


def _failure(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             fake: bool) -> tuple[nn.Module, Exception] | None:
    """Call ``model`` eagerly (eval mode, no gradients), on fake copies of the tensors if ``fake``: the innermost
    module that raised and the error, or ``None`` when the call runs."""
    entered: list[nn.Module] = []  # the modules called and not yet returned, innermost last

    def enter(m: nn.Module, args: Any) -> None:
        entered.append(m)

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        entered.pop()

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    disabled = logging.root.manager.disable  # torch logs a failing fake kernel's traceback; the error says it
    logging.disable(max(disabled, logging.ERROR))
    try:
        with in_mode(model, False), torch.no_grad(), quiet(), contextlib.ExitStack() as stack:
            if fake:
                mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                args, kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            model(*args, **kwargs)
        return None
    except Exception as e:
        return (entered[-1] if entered else model), e
    finally:
        logging.disable(disabled)
        for h in handles:
            h.remove()


def rejecting_module(model: nn.Module, example_inputs: Sequence[Any],
                     example_kwargs: dict[str, Any]) -> tuple[str, Exception] | None:
    """Where ``model`` refuses its example call: the innermost module that raised (``module 'a.b' (Linear)``, or
    ``Model.forward``) and the error; ``None`` when the call runs.

    The call runs on fake tensors of the inputs' shapes and dtypes first; only when that fails, and not for want of
    tensor values, does it run on the inputs themselves (eval mode, no gradients), which decides.
    """
    args, kwargs = tuple(example_inputs), dict(example_kwargs)
    failure = _failure(model, args, kwargs, fake=True)
    if failure is None or isinstance(failure[1], _UNTELLABLE):
        return None
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):  # a meta model has only the fake call
        failure = _failure(model, args, kwargs, fake=False)
        if failure is None:
            return None
    m, error = failure
    name = next((n for n, sub in model.named_modules() if sub is m), "")
    return (f"module {name!r} ({type(m).__name__})" if name else f"{type(model).__name__}.forward"), error


def misfit_message(where: str, error: BaseException, inputs: dict[str, Any]) -> str:
    """The error for example inputs the model does not take: the inputs, where and how the model refused them,
    and the way out."""
    tensors = {n: v for n, v in inputs.items() if isinstance(v, torch.Tensor)}
    shapes = ", ".join(f"{n} {tuple(v.shape)}" for n, v in tensors.items())
    dtypes = ", ".join(f"{n} {str(v.dtype).removeprefix('torch.')}" for n, v in tensors.items())
    own = str(error).split("While executing")[0]  # torch.fx's interpreter appends the node, which `where` names
    reason = next((line for line in own.splitlines() if line.strip()), "").rstrip(".")
    return (f"the model does not run on the example inputs ({shapes}): {where} fails with {type(error).__name__}"
            f"{': ' + reason if reason else ''}; input dtypes: {dtypes}. Pass example inputs of the shape and dtype "
            f"the model takes (model(*example_inputs) must run)")

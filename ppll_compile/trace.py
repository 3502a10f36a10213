"""Trace an unmodified nn.Module with torch.fx, keeping train/eval switchable and failing with a teaching error."""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import traceback
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .errors import TraceError

__all__ = ["trace", "depends_on_training", "module_path", "train_mode"]

_TRAINING = re.compile(r"\bself\.training\b")
_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = __file__


@functools.lru_cache(maxsize=None)
def depends_on_training(cls: type) -> bool:
    """True when a module class (outside ``torch.nn``) reads ``self.training`` anywhere in its source.

    Such a module behaves differently in train and eval mode (stochastic depth, dropout through a functional
    call, ...). A naive trace would freeze the train-mode branch into the graph, so the tracer keeps it opaque.
    """
    for klass in cls.__mro__:
        if klass is nn.Module or klass.__module__.startswith("torch.nn"):
            break
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if _TRAINING.search(source):
            return True
    return False


@contextmanager
def train_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Put ``module`` in train mode for the block, then restore every submodule's own mode."""
    was_training = {m: m.training for m in module.modules()}
    module.train()
    try:
        yield module
    finally:
        for m, t in was_training.items():
            m.training = t


class _Tracer(fx.Tracer):
    """fx tracer with ppll-compile's leaf policy and a record of the module being traced when tracing fails."""

    def __init__(self, root: nn.Module, leaf_names: set[str], leaf_types: tuple[type, ...],
                 keep: set[str] | None):
        super().__init__()
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
        return super().is_leaf_module(m, qualname) or depends_on_training(type(m))

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:
                self.failed_module = self.path_of_module(m)
            raise


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost module a traced node belongs to ('' for the model's own forward)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return ""


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


def _check_leaf_names(model: nn.Module, names: Iterable[str]) -> None:
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
          leaf_modules: Iterable[str | type] = (), split_points: Sequence[str] | None = None) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule that shares its submodules and parameters.

    ``example_inputs``/``example_kwargs`` say which forward arguments are given; other arguments are fixed
    to their defaults. Modules whose behaviour depends on ``self.training`` stay opaque, as do
    ``leaf_modules`` (names or types). With ``split_points`` that are all module names, every module that
    does not contain a split point is kept opaque, which also lets models with untraceable parts be planned.
    """
    leaf_names = {m for m in leaf_modules if isinstance(m, str)}
    leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
    _check_leaf_names(model, leaf_names)
    keep = _split_point_ancestors(model, split_points) if split_points else None

    sig = inspect.signature(model.forward)
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TraceError(f"{type(model).__name__}.forward takes *args or **kwargs, which torch.fx cannot trace; "
                         "wrap the model in a module whose forward names its inputs")
    given = set(p.name for p in params[:len(example_inputs)]) | set(example_kwargs or {})
    unknown = sorted(set(example_kwargs or {}) - {p.name for p in params})
    if unknown:
        raise TraceError(f"example_kwargs names {unknown}, which {type(model).__name__}.forward does not take "
                         f"(its arguments: {[p.name for p in params]})")
    concrete: dict[str, Any] = {}
    for p in params:
        if p.name in given:
            continue
        if p.default is p.empty:
            raise TraceError(f"{type(model).__name__}.forward needs argument {p.name!r}, but the example inputs "
                             "do not give it; pass it in example_inputs=(...) or example_kwargs={...}")
        concrete[p.name] = p.default

    tracer = _Tracer(model, leaf_names, leaf_types, keep)
    with train_mode(model):
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as e:
            raise TraceError(_explain(model, tracer.failed_module, e)) from e
    if keep is None and depends_on_training(type(model)):
        warnings.warn(f"{type(model).__name__}.forward reads self.training; it was traced in train mode, so the "
                      "compiled stages always take the train-mode branch of that code", stacklevel=3)
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    _drop_fixed_placeholders(gm, params, concrete)
    return gm


def _drop_fixed_placeholders(gm: fx.GraphModule, params: list[inspect.Parameter], concrete: dict[str, Any]) -> None:
    """Remove the placeholders (and None-checks) fx keeps for arguments fixed to their defaults."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    changed = False
    for node, param in zip(placeholders, params):
        if param.name not in concrete:
            continue
        for user in list(node.users):
            if user.target is fx._symbolic_trace._assert_is_none:
                gm.graph.erase_node(user)
                changed = True
        if not node.users:
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()


def _explain(model: nn.Module, failed_module: str | None, e: Exception) -> str:
    where = f"module {failed_module!r}" if failed_module else f"{type(model).__name__}.forward"
    frame = _user_frame(e.__traceback__)
    line = f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
    target = failed_module or "<module>"
    return (f"torch.fx cannot trace {type(model).__name__}: in {where}{line}: {type(e).__name__}: {e}\n"
            f"Ways out: keep that module opaque with leaf_modules=[{target!r}], or name the cuts yourself with "
            f"split_points=[...module names...] so that only the modules holding them are traced into.")

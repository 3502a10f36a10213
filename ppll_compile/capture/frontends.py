"""Capture a model as an fx graph: symbolic tracing, or ``torch.export`` where tracing cannot (``tracer=``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import Tensor, nn

from ..errors import TraceError
from ..plans.file import EXPORT_NOTE
from .export import export
from .fake_state import on_device
from .meta import faked, input_device, is_meta, unfake
from .trace import ModeBranchError, check_leaf_names, fixed_arguments, library_untraced, trace

BUFFER_OWNERS = "ppll_buffer_owners"
"""``GraphModule.meta`` key: for every buffer the graph reads by attribute, the model's module that holds it and
its name there, so that a stage moved to a device can point the model at the moved buffer."""


_EXPORT_ONLY = (("transformers.modeling_utils", "PreTrainedModel"),)
"""Base classes (module, name) of models that ``tracer='auto'`` hands straight to ``torch.export``: Hugging Face
models branch on shapes and on their config's Python values and take ``**kwargs``, which symbolic tracing
cannot follow (``transformers`` ships its own fx tracer for that reason)."""


def _export_only(model: nn.Module) -> str | None:
    """Why symbolic tracing is not tried on ``model`` under ``tracer='auto'``, or ``None`` when it is tried."""
    for cls in type(model).__mro__:
        if (cls.__module__, cls.__qualname__) in _EXPORT_ONLY:
            return (f"{type(model).__name__} is a {cls.__module__.split('.')[0]} {cls.__qualname__}, whose forward "
                    f"torch.fx does not take")
    return None


def _buffer_owners(model: nn.Module, gm: fx.GraphModule) -> dict[str, tuple[nn.Module, str]]:
    owners = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            path, _, name = str(n.target).rpartition(".")
            try:
                owner = model.get_submodule(path)
            except AttributeError:
                continue
            if name in owner._buffers:
                owners[str(n.target)] = (owner, name)
    return owners


def _export(model: nn.Module, tensors: dict[str, Tensor], fixed: dict[str, Any],
            bake_train_mode: bool) -> tuple[fx.GraphModule, list[str]]:
    """:func:`~ppll_compile.capture.export.export`; a meta-built model (or meta inputs) on fake tensors of the inputs'
    device, the graph then reading the model's own tensors."""
    if not is_meta(model) and not any(t.is_meta for t in tensors.values()):
        return export(model, tensors, fixed, bake_train_mode=bake_train_mode)
    with faked(model, input_device(tensors.values())) as (mode, own):
        device = input_device(tensors.values())
        fakes = {k: on_device(mode.from_tensor(t), device) for k, t in tensors.items()}
        gm, notes = export(model, fakes, fixed, bake_train_mode=bake_train_mode)
    unfake(gm, own)
    return gm, notes


LIBRARY_NOTE = "traced with torch.fx, the functions and modules the model's library marks untraceable kept whole"
"""The note of a symbolic trace that kept a library's registered untraceable helpers (timm's
``register_notrace_function``) as single operations."""


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, up to its first ``;`` (what the plan's notes quote of it)."""
    return str(error).split("\n")[0].split(";")[0]


def _fx_error(model: nn.Module, attempt: Callable[[], fx.GraphModule]) -> fx.GraphModule | TraceError:
    """The graph ``attempt`` traces, or why it failed: its :class:`TraceError`, any other exception as one."""
    try:
        return attempt()
    except TraceError as e:
        return e
    except Exception as e:  # noqa: BLE001 - whatever symbolic tracing raises, torch.export is tried next
        error = TraceError(f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}")
        error.__cause__ = e
        return error


def _symbolic(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict[str, Any],
              leaf_modules: tuple[str | type, ...], split_points: Sequence[str] | None,
              bake_train_mode: bool) -> tuple[fx.GraphModule | None, TraceError | None, tuple[str, ...]]:
    """Symbolic tracing: the graph and notes, or why it failed. Where plain tracing fails and a loaded model library
    registers functions or modules as untraceable (:func:`~ppll_compile.capture.trace.library_untraced`), tracing is tried
    once more with those kept whole."""
    def attempt(functions: tuple[Any, ...] = (), modules: tuple[type, ...] = ()) -> fx.GraphModule | TraceError:
        return _fx_error(model, lambda: trace(model, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                              leaf_modules=(*leaf_modules, *modules), split_points=split_points,
                                              bake_train_mode=bake_train_mode, autowrap_functions=functions))
    first = attempt()
    if isinstance(first, fx.GraphModule):
        return first, None, ()
    functions, modules = library_untraced()
    if functions or modules:
        again = attempt(functions, modules)
        if isinstance(again, fx.GraphModule):
            return again, None, (f"{LIBRARY_NOTE} (plain symbolic tracing cannot take it: {_first_line(first)})",)
    return None, first, ()


@dataclass(frozen=True, kw_only=True)
class Capture:
    """A model captured as an fx graph over its own parameters, with how its ``forward`` arguments map onto it."""

    gm: fx.GraphModule
    """The graph; in train mode it computes what the model computes in train mode, in eval mode the same
    for eval (see :mod:`ppll_compile.capture.modes`)."""
    inputs: tuple[Any, ...]
    """The example value of every graph input, in order."""
    fixed: dict[str, Any]
    """The ``forward`` arguments captured as constants: name -> value."""
    tracer: str
    """The front end that captured the graph: ``fx`` or ``export``."""
    notes: tuple[str, ...] = ()
    """What the user should know about the capture (e.g. why ``torch.export`` was used)."""


def capture(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict[str, Any], *, tracer: str = "auto",
            leaf_modules: Iterable[str | type] = (), split_points: Sequence[str] | None = None,
            bake_train_mode: bool = False) -> Capture:
    """Capture ``model`` on its example call with the chosen front end (``auto``, ``fx`` or ``export``; checked by
    :class:`~ppll_compile.options.PlanOptions`).

    Under ``auto``, symbolic tracing is tried first, except on models known to need ``torch.export`` (Hugging Face
    ``PreTrainedModel`` subclasses, given no ``leaf_modules`` or ``split_points``), which go to it at once; whatever
    makes symbolic tracing fail, ``torch.export`` is tried next, and the notes say why it was used (the first line
    of the tracing error). When both fail, the error gives both causes, each with its ways out. Symbolic tracing
    that fails is tried once more with the helpers a loaded model library marks untraceable kept whole (timm's
    ``register_notrace_function``), before ``torch.export``.
    ``leaf_modules`` and ``split_points`` steer symbolic tracing; ``torch.export`` has no opaque modules, so
    ``leaf_modules`` with ``tracer='export'`` is an error. A forward argument ``use_cache`` that is not given is
    captured as ``False`` under ``torch.export`` (a pipeline stage cannot hand a key/value cache back).
    """
    leaf_modules = tuple(leaf_modules)
    check_leaf_names(model, [m for m in leaf_modules if isinstance(m, str)])
    names, fixed = fixed_arguments(model, example_inputs, example_kwargs, allow_var=tracer != "fx")
    given = dict(zip(inspect.signature(model.forward).parameters, example_inputs)) | dict(example_kwargs)
    values = {n: given[n] for n in names}
    fx_error: TraceError | None = None
    known = _export_only(model) if tracer == "auto" and not leaf_modules and not split_points else None
    if known is not None:
        try:  # the error fx would give at once (a **kwargs forward), else why fx is not tried
            fixed_arguments(model, example_inputs, example_kwargs, allow_var=False)
            fx_error = TraceError(known)
        except TraceError as e:
            fx_error = e
    elif tracer != "export":
        traced, fx_error, fx_notes = _symbolic(model, example_inputs, example_kwargs, leaf_modules, split_points,
                                               bake_train_mode)
        if traced is not None:
            traced.meta[BUFFER_OWNERS] = _buffer_owners(model, traced)
            return Capture(gm=traced, inputs=tuple(values.values()), fixed=fixed, tracer="fx", notes=fx_notes)
        if fx_error is not None and (tracer == "fx" or isinstance(fx_error, ModeBranchError)):
            raise fx_error  # a branch on self.training in forward itself: torch.export cannot follow it either
    if tracer == "export" and leaf_modules:
        raise TraceError("leaf_modules keeps modules opaque to torch.fx symbolic tracing; torch.export captures "
                         "every module. Drop leaf_modules, or use tracer='fx'")
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in given:
        fixed["use_cache"] = False
    tensors = {k: v for k, v in values.items() if isinstance(v, Tensor)}
    try:
        gm, notes = _export(model, tensors, fixed, bake_train_mode)
    except TraceError as e:
        if fx_error is None:
            raise
        raise TraceError(f"{fx_error}\nThe other front end, torch.export, cannot capture it either: {e}") from e
    gm.meta[BUFFER_OWNERS] = _buffer_owners(model, gm)
    reason = f" (symbolic tracing cannot take it: {_first_line(fx_error)})" if fx_error is not None else ""
    return Capture(gm=gm, inputs=tuple(values.values()), fixed=fixed, tracer="export",
                   notes=(f"{EXPORT_NOTE}{reason}", *notes))

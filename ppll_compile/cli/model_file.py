"""Loading a user's MODEL.py: the model to plan, its example inputs and, for distillation, the teacher.

MODEL.py defines ``build_model()`` (returning the ``nn.Module``) and ``example_inputs()`` (a tuple of
tensors, or one tensor); module-level ``model`` and ``example_inputs`` attributes work too, and an optional
``example_kwargs`` (or ``example_kwargs()``) gives keyword arguments for ``forward()``. For distillation it
also defines ``build_teacher()`` (or ``teacher``); ``build_model()`` is then the student.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from torch import Tensor, nn

from ..errors import ModelFileError

_module_ids = itertools.count()


class ModelFile(NamedTuple):
    """What a MODEL.py defines."""

    model: nn.Module
    """The model to plan (the student under distillation)."""
    example_inputs: tuple[Any, ...] | None
    """Example positional inputs; ``None`` lets ``plan()`` infer them."""
    example_kwargs: dict[str, Any] | None
    """Example keyword arguments for ``forward()``, if the file gives any."""
    teacher: nn.Module | None
    """The frozen teacher (only when asked for)."""


def _load_file(path: Path) -> ModuleType:
    """Import ``path`` under a fresh module name, with its directory on ``sys.path`` while it runs."""
    if not path.exists():
        raise ModelFileError(f"model file {str(path)!r} does not exist; pass the path of a Python file that "
                             "defines build_model() and example_inputs()")
    if not path.is_file():
        raise ModelFileError(f"model file {str(path)!r} is not a file; pass the path of a Python file that "
                             "defines build_model() and example_inputs()")
    name = f"_ppll_model_{next(_module_ids)}_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {str(path)!r} as Python; expected a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = str(path.resolve().parent)
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ModelFileError(f"loading {path} raised {type(e).__name__}: {_brief(e)}; fix the file "
                             f"(`python {path}` shows the traceback)") from None
    finally:
        if directory in sys.path:
            sys.path.remove(directory)
    return module


def _call(path: Path, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, its exception reported as a ModelFileError naming ``what`` and the file."""
    try:
        return fn()
    except Exception as e:
        raise ModelFileError(f"{what} in {path} raised {type(e).__name__}: {_brief(e)}") from None


def _brief(e: BaseException) -> str:
    """The message of ``e`` without the C++ frames torch appends to some errors (``Exception raised from ...``):
    they say where in torch it failed, not what to change in the file."""
    return re.split(r"\n(?:Exception raised from|frame #)", str(e), maxsplit=1)[0].rstrip()


def _module_of(path: Path, module: ModuleType, name: str, what: str) -> nn.Module:
    """The nn.Module a MODEL.py makes with ``build_<name>()`` or holds as ``<name>``."""
    if callable(getattr(module, f"build_{name}", None)):
        model = _call(path, f"build_{name}()", getattr(module, f"build_{name}"))
    elif hasattr(module, name):
        model = getattr(module, name)
    else:
        raise ModelFileError(f"{path} defines neither build_{name}() nor {name}; define build_{name}() returning "
                             f"the {what}")
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{path}: the {name} is a {type(model).__name__}, expected an nn.Module; make "
                             f"build_{name}() return the {what}")
    return model


def load_model(path: str | Path, teacher: bool = False) -> ModelFile:
    """The model, example inputs, example kwargs and (with ``teacher``) the teacher that the MODEL.py ``path`` defines.

    Raises :class:`ModelFileError`, saying what to fix, when the file is missing, raises, or lacks a model.
    """
    path = Path(path)
    module = _load_file(path)
    model = _module_of(path, module, "model", "nn.Module to plan")
    frozen = _module_of(path, module, "teacher", "frozen teacher nn.Module to distil from") if teacher else None

    inputs = getattr(module, "example_inputs", None)
    if callable(inputs):
        inputs = _call(path, "example_inputs()", inputs)
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    if inputs is not None and not isinstance(inputs, tuple):
        raise ModelFileError(f"{path}: example_inputs is a {type(inputs).__name__}, expected a tuple of tensors "
                             "(or one tensor); return e.g. (torch.randn(8, 3, 32, 32),)")

    kwargs = getattr(module, "example_kwargs", None)
    if callable(kwargs):
        kwargs = _call(path, "example_kwargs()", kwargs)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ModelFileError(f"{path}: example_kwargs is a {type(kwargs).__name__}, expected a dict of "
                             "keyword arguments for forward()")
    return ModelFile(model, inputs, kwargs, frozen)

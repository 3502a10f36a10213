"""Loading a user's MODEL.py: the model to plan, its example inputs and, for distillation, the teacher.

MODEL.py defines ``build_model()`` (returning the ``nn.Module``) and ``example_inputs()`` (a tuple of
tensors, or one tensor); module-level ``model`` and ``example_inputs`` attributes work too, and an optional
``example_kwargs`` (or ``example_kwargs()``) gives keyword arguments for ``forward()``. For distillation it
also defines ``build_teacher()`` (or ``teacher``); ``build_model()`` is then the student.

The file is imported under a module name of its own, never ``__main__``, so a block under
``if __name__ == "__main__":`` does not run. Before anything in it runs, its top level is read (with :mod:`ast`)
and refused if it does work beyond defining the model (:data:`TOP_LEVEL_RULE`): a training script is not run by
being planned.
"""

from __future__ import annotations

import ast
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

SETUP_CALLS = ("torch.manual_seed", "random.seed", "np.random.seed", "numpy.random.seed", "sys.path.insert",
               "sys.path.append", "warnings.filterwarnings", "warnings.simplefilter")
"""The calls a model file may make on a line of their own at its top level: seeding and set-up for its imports."""

TOP_LEVEL_RULE = ("a model file's top level may only import, define (def, class), assign (name = ...), assert or "
                  "raise, call " + ", ".join(f"{c}()" for c in SETUP_CALLS) + ", and hold if/try blocks of "
                  "those; the body of `if __name__ == \"__main__\":` is never run")
"""What ``ppll-plan`` accepts at a model file's top level: anything else (a call on a line of its own such as
``trainer.fit(...)``, a ``for`` or ``while`` loop, a ``with`` block) is taken for the work of a script."""

MAX_MODEL_FILE = 16 * 2**20
"""The largest model file read, in bytes: a Python file defining a model is far smaller."""


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
    _check_top_level(path)
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


def _check_top_level(path: Path) -> None:
    """Refuse ``path``, before any of it runs, if its top level does work beyond :data:`TOP_LEVEL_RULE`."""
    size = path.stat().st_size
    if size > MAX_MODEL_FILE:
        raise ModelFileError(f"model file {str(path)!r} holds {size:,} bytes, more than a Python file defining a "
                             f"model ({MAX_MODEL_FILE // 2**20} MiB at most); pass the .py file that defines "
                             "build_model() and example_inputs()")
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes, not Python text
        raise ModelFileError(f"loading {path} raised {type(e).__name__}: {_brief(e)}; pass a Python file that "
                             "defines build_model() and example_inputs()") from None
    work = work_lines(tree.body)
    if not work:
        return
    (line, what), more = work[0], sorted({n for n, _ in work[1:]})
    others = f" (and top-level work on line{'s' if len(more) > 1 else ''} {', '.join(map(str, more[:5]))}" \
        f"{', ...' if len(more) > 5 else ''})" if more else ""
    raise ModelFileError(f"{path}:{line}: {what} at the top level would run when ppll-plan imports the file"
                         f"{others}; a model file's top level only imports, defines (def, class) and assigns, and "
                         "may seed (ppll-plan --help gives the whole rule). Move that work under "
                         "`if __name__ == \"__main__\":`, which ppll-plan never runs, or into a function; nothing in "
                         "the file was run")


def work_lines(body: list[ast.stmt]) -> list[tuple[int, str]]:
    """The line and a description of every statement of a module's ``body`` that :data:`TOP_LEVEL_RULE` refuses."""
    found: list[tuple[int, str]] = []
    for node in body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            found += work_lines(node.orelse)
        elif isinstance(node, ast.If):
            found += work_lines(node.body) + work_lines(node.orelse)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found += work_lines(part)
        elif not _defines(node):
            found.append((node.lineno, _described(node)))
    return found


_DEFINING = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
             ast.AnnAssign, ast.AugAssign, ast.Assert, ast.Raise, ast.Pass, ast.Delete, ast.Global, ast.Nonlocal)


def _defines(node: ast.stmt) -> bool:
    """Whether ``node`` is a top-level statement :data:`TOP_LEVEL_RULE` accepts (``if`` and ``try`` aside)."""
    if isinstance(node, _DEFINING):
        return True
    if not isinstance(node, ast.Expr):
        return False
    value = node.value
    if isinstance(value, ast.Constant):  # a docstring, or ...
        return True
    return isinstance(value, ast.Call) and ast.unparse(value.func) in SETUP_CALLS


def _described(node: ast.stmt) -> str:
    """A refused statement in words: ``a call of trainer.fit()``, ``a with block``, ``a for loop``."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        name = ast.unparse(node.value.func)
        return f"a call of {name if len(name) <= 40 else name[:37] + '...'}()"
    kinds = {ast.With: "a with block", ast.AsyncWith: "an async with block", ast.For: "a for loop",
             ast.AsyncFor: "an async for loop", ast.While: "a while loop", ast.Expr: "an expression statement"}
    return kinds.get(type(node), f"a {type(node).__name__.lower()} statement")


def _is_main_test(test: ast.expr) -> bool:
    """Whether ``test`` is ``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
    return sides in ({"__name__", "'__main__'"}, {"__name__", '"__main__"'})


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

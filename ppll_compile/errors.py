"""Every exception ppll-compile raises; each message says what was found, what was expected and the way out.

:class:`PPLLError`, :class:`PartitionError` and :class:`InfeasibleMemoryError` are defined in the torch-free
:mod:`partitioners.errors` (the solvers raise them and must not import torch, which importing this package does)
and re-exported here as members of the one family; the others are defined here. :func:`user_stacklevel` points a
warning the package raises at the user's line.
"""

from __future__ import annotations

import os
import sys
import sysconfig

from ppll_compile.partitioners.errors import InfeasibleMemoryError, PartitionError, PPLLError

__all__ = ["PPLLError", "TraceError", "CutError", "PolicyError", "PlanError", "PartitionError",
           "InfeasibleMemoryError", "StageError", "CheckpointError", "ModelFileError"]


class TraceError(PPLLError):
    """The model could not be traced with torch.fx."""


class CutError(PPLLError, ValueError):
    """A requested cut or stage count does not fit the model's legal cut points."""


class PolicyError(PPLLError, ValueError):
    """An auxiliary-head policy is malformed or cannot serve a boundary tensor."""


class PlanError(PPLLError, ValueError):
    """A plan is inconsistent or does not fit the model it is applied to."""


class StageError(PPLLError, RuntimeError):
    """A stage raised (or produced a non-finite loss) while the pipeline ran; it names the stage and batch."""

    def __init__(self, stage: int, batch: int | None, message: str, traceback: str = "") -> None:
        at = f" at batch {batch}" if batch is not None else ""
        text = f"stage {stage} failed{at}: {message}"
        if traceback:
            text += f"\n--- traceback of stage {stage} ---\n{traceback.rstrip()}"
        super().__init__(text)
        self.stage = stage
        self.batch = batch
        self.traceback = traceback


class CheckpointError(PPLLError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or was saved for another model, plan or trainer."""


class ModelFileError(PPLLError):
    """A MODEL.py that is missing, cannot be imported, raises, or does not define what a plan needs."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB = tuple(sorted({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")}))


def _library_prefixes() -> tuple[str, ...]:
    """Where the code of this package, torch (when imported) and Python's standard library lies."""
    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)
    return (_PACKAGE, *((os.path.dirname(os.path.abspath(where)) + os.sep,) if where else ()))


def _library(filename: str, prefixes: tuple[str, ...]) -> bool:
    """Whether code in ``filename`` is not the user's: this package's, torch's or Python's own."""
    if filename.startswith("<frozen "):
        return True
    path = os.path.abspath(filename)
    return path.startswith(prefixes) or (path.startswith(_STDLIB) and "site-packages" not in path)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line, whatever the call path: the first frame, from
    the caller of this function outwards, outside this package, torch and Python's standard library (e.g. the
    line calling ``plan()``, ``compile()`` or ``trainer.fit()``). Where there is none (the package called from a
    library only), the first frame outside this package; else 1. Use it as
    ``warnings.warn(msg, stacklevel=user_stacklevel())``."""
    prefixes = _library_prefixes()
    frame = sys._getframe(1)
    level, outside = 1, None
    while frame is not None:
        name = frame.f_code.co_filename
        if not _library(name, prefixes):
            return level
        if outside is None and not name.startswith("<frozen ") and not os.path.abspath(name).startswith(_PACKAGE):
            outside = level
        frame, level = frame.f_back, level + 1
    return outside if outside is not None else 1

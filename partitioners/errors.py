"""The base of every ppll-compile error and the partitioning errors, defined where the torch-free solvers can raise them.

Why here: the solvers in :mod:`partitioners` are plain functions over numbers and must import neither torch nor
``ppll_compile`` (importing ``ppll_compile.errors`` runs ``ppll_compile/__init__.py``, which imports torch). Yet a
user catches what a solver raises as ``ppll_compile.PartitionError`` and as ``ppll_compile.PPLLError``, and
``except`` matches by real inheritance only. So the one :class:`PartitionError` class, its subclass
:class:`InfeasibleMemoryError` (which carries ``min_limit`` to the user) and their base :class:`PPLLError` are
defined in this dependency-free module; :mod:`ppll_compile.errors` re-exports them beside the package's other
errors, which is where users and the rest of the package import them from.
"""

from __future__ import annotations


class PPLLError(Exception):
    """Base class of every error ppll-compile raises on bad input."""


class PartitionError(PPLLError, ValueError):
    """The partitioner cannot satisfy the request (unknown solver, infeasible memory cap, bad cost vectors, ...)."""


class InfeasibleMemoryError(PartitionError):
    """No partition into the requested number of stages fits the per-device memory limits.

    ``min_limit`` is the smallest uniform per-device limit in bytes that admits a partition into as many stages.
    """

    def __init__(self, message: str, *, min_limit: float) -> None:
        super().__init__(message)
        self.min_limit = min_limit

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuilt, (str(self), self.min_limit)


def _rebuilt(message: str, min_limit: float) -> InfeasibleMemoryError:
    """An :class:`InfeasibleMemoryError` from its pickled message and ``min_limit`` (it crosses process pipes)."""
    return InfeasibleMemoryError(message, min_limit=min_limit)

"""Keep freed memory in the process: glibc's allocator set by ``mallopt`` so that what a stage frees every step
(its gradients, under ``zero_grad(set_to_none=True)``) is not handed back to the kernel and faulted in again.

A trainer calls :func:`keep_freed_memory` before its first training step, whatever its runtime (never earlier:
building a trainer or a runtime leaves the allocator alone, and planning never sets it: glibc cannot read these
settings back, so a plan could not restore them). Without it, glibc gives the freed gradients back (it trims the
top of the main heap, unmaps chunks above its mmap threshold and drops whole heaps of a thread's arena), and the
next backward takes a minor page fault for every page it writes into them: thousands per step for a ResNet-18
stage, in worker threads above all. The three settings, applied at run time (thread arenas that
exist already included):

- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's largest): blocks below it come from the heaps, not from ``mmap``;
- ``M_TRIM_THRESHOLD`` 1 GiB: the main heap keeps up to that much free memory at its top;
- ``M_TOP_PAD`` 64 MiB (the size of a thread arena's heap): a thread arena neither shrinks a heap nor unmaps an
  emptied one (``M_ARENA_MAX`` would act only on arenas not yet made, and makes every thread share one lock).

The cost: the process keeps its peak heap instead of returning it between steps. Opt out with
``PPLL_MALLOC=default`` in the environment. A parameter that the environment sets itself (``MALLOC_TOP_PAD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``) is left as
set. Nothing is changed off Linux, off glibc, or when another allocator (jemalloc, tcmalloc, mimalloc) is loaded.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass

from .errors import PPLLError

__all__ = ["ENV", "keep_freed_memory", "applied_setting"]

ENV = "PPLL_MALLOC"
"""The environment variable that chooses: ``keep`` (the default) or ``default`` (leave glibc's allocator alone)."""
_CHOICES = ("keep", "default")
_MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class _Param:
    name: str
    code: int
    value: int
    env: str
    tunable: str


_PARAMS = (
    _Param(name="M_MMAP_THRESHOLD", code=-3, value=32 * _MIB, env="MALLOC_MMAP_THRESHOLD_", tunable="mmap_threshold"),
    _Param(name="M_TRIM_THRESHOLD", code=-1, value=1024 * _MIB, env="MALLOC_TRIM_THRESHOLD_",
           tunable="trim_threshold"),
    _Param(name="M_TOP_PAD", code=-2, value=64 * _MIB, env="MALLOC_TOP_PAD_", tunable="top_pad"),
)
SETTINGS: tuple[tuple[str, int], ...] = tuple((p.name, p.value) for p in _PARAMS)
"""The ``mallopt`` parameters :func:`keep_freed_memory` sets, with their values in bytes."""
_OTHERS = ("jemalloc", "tcmalloc", "mimalloc", "snmalloc", "hoard")

_lock = threading.Lock()
_applied: AllocatorSetting | None = None


@dataclass(frozen=True, kw_only=True)
class AllocatorSetting:
    """What :func:`keep_freed_memory` did to this process's allocator."""

    applied: tuple[tuple[str, int], ...] = ()
    """The ``mallopt`` parameters it set, with their values in bytes (empty when it changed nothing)."""
    kept: tuple[tuple[str, str], ...] = ()
    """Parameters it left alone because the environment sets them, with the variable that does."""
    reason: str = ""
    """Why it changed nothing (empty when it changed something)."""

    @property
    def changed(self) -> bool:
        """Whether any allocator parameter was set."""
        return bool(self.applied)

    def __str__(self) -> str:
        if not self.applied:
            return f"allocator left as it was: {self.reason}"
        text = "allocator set: " + ", ".join(f"{n}={v}" for n, v in self.applied)
        if self.kept:
            text += "; left as the environment sets them: " + ", ".join(f"{n} ({e})" for n, e in self.kept)
        return text


def other_allocator(maps: str | None = None) -> str | None:
    """The file name of an allocator other than glibc's mapped into this process (``None`` if there is none).

    ``maps`` is the text of ``/proc/self/maps`` (read when not given); jemalloc, tcmalloc (gperftools),
    mimalloc, snmalloc and Hoard are recognised by their library's name, e.g. one put in ``LD_PRELOAD``.
    """
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        name = os.path.basename(fields[5].strip()) if len(fields) == 6 else ""
        if any(o in name.lower() for o in _OTHERS):
            return name
    return None


def _set_by_environment(p: _Param) -> str | None:
    """The variable through which the environment sets parameter ``p`` (``None`` if it does not)."""
    if p.env in os.environ:
        return p.env
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0].strip() == f"glibc.malloc.{p.tunable}" for t in tunables.split(":")):
        return f"GLIBC_TUNABLES glibc.malloc.{p.tunable}"
    return None


def _why_not() -> str | None:
    """Why this process's allocator cannot or must not be set (``None`` when it can)."""
    choice = os.environ.get(ENV, "keep").strip().lower() or "keep"
    if choice not in _CHOICES:
        raise PPLLError(f"{ENV}={os.environ[ENV]!r} is not a known setting; expected 'keep' (the default: the "
                        f"allocator keeps freed memory for the next step) or 'default' (glibc's allocator left "
                        f"as it is); set {ENV}=default or unset it")
    if choice == "default":
        return f"{ENV}=default"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        libc = None
    if not libc:
        return "the C library is not glibc"
    other = other_allocator()
    if other is not None:
        return f"{other} is loaded and allocates instead of glibc"
    return None


def keep_freed_memory() -> AllocatorSetting:
    """Set glibc's allocator so that memory freed in one training step stays in the process for the next.

    Sets :data:`SETTINGS` by ``mallopt`` (see the module's text for why these), except the parameters the
    environment sets itself. Idempotent: once it set the allocator, later calls return the same
    :class:`AllocatorSetting` and change nothing. Changes nothing, and says why, with ``PPLL_MALLOC=default``,
    off Linux, off glibc, or when jemalloc, tcmalloc or mimalloc is loaded; raises :class:`PPLLError` for
    another value of ``PPLL_MALLOC``.
    """
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        why = _why_not()
        if why is not None:
            return AllocatorSetting(reason=why)
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        applied: list[tuple[str, int]] = []
        kept: list[tuple[str, str]] = []
        for p in _PARAMS:
            by = _set_by_environment(p)
            if by is not None:
                kept.append((p.name, by))
            elif mallopt(p.code, p.value) == 1:
                applied.append((p.name, p.value))
        if not applied:
            reason = "the environment sets every parameter" if kept else "mallopt refused every parameter"
            return AllocatorSetting(kept=tuple(kept), reason=reason)
        _applied = AllocatorSetting(applied=tuple(applied), kept=tuple(kept))
        return _applied


def applied_setting() -> AllocatorSetting | None:
    """What :func:`keep_freed_memory` set in this process so far (``None`` while it has set nothing)."""
    return _applied

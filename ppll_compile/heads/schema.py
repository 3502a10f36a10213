"""Options of a config schema (a head type's, a policy's loss section): default, what it must be, and check."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Opt:
    """One option of a schema: its default, what it must be (as errors say it) and the check."""

    default: Any
    expected: str
    check: Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(default: int, low: int = 0) -> Opt:
    """An integer >= ``low``."""
    return Opt(default, f"an integer >= {low}", lambda v: _is_int(v) and v >= low)


def weight(default: float) -> Opt:
    """A finite number >= 0."""
    return Opt(default, "a number >= 0", lambda v: _is_number(v) and v >= 0)


def text(default: str) -> Opt:
    """Any string."""
    return Opt(default, "a string", lambda v: isinstance(v, str))


def choice(default: str | None, *choices: str) -> Opt:
    """One of ``choices``."""
    return Opt(default, "one of " + ", ".join(choices), lambda v: isinstance(v, str) and v in choices)


def positive(default: float) -> Opt:
    """A finite number > 0."""
    return Opt(default, "a number > 0", lambda v: _is_number(v) and v > 0)


def fraction(default: float) -> Opt:
    """A number in [0, 1)."""
    return Opt(default, "a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1)


def ramp(default: tuple[float, float]) -> Opt:
    """A pair [first, last] of numbers >= 0 (a value interpolated over the stages)."""
    return Opt(default, "a pair [first, last] of numbers >= 0",
               lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) and x >= 0 for x in v))


def per_channel(default: tuple[float, ...], positive: bool = False) -> Opt:
    """A non-empty list of numbers (> 0 with ``positive``): one per channel, or one for all."""
    return Opt(default, f"a non-empty list of numbers{' > 0' if positive else ''} (one per channel, or one for all)",
               lambda v: isinstance(v, (list, tuple)) and len(v) > 0
               and all(_is_number(x) and (x > 0 or not positive) for x in v))

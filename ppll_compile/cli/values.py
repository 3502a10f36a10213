"""What ``ppll-plan``'s flags take: sizes, positive numbers, lists of names, replica counts, block pairs."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from ..plans.file import MAX_BATCH, MAX_CLASSES, MAX_DEVICES

SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e(\d+))?\s*([a-z]*)\s*$", re.IGNORECASE)
SIZE_FORMS = ("bytes (1000000), KiB/MiB/GiB/TiB or K/M/G/T (binary, e.g. 16GiB, 1.5G) "
              "or KB/MB/GB/TB (decimal, e.g. 16GB)")


def parse_size(text: str) -> int:
    """Bytes from ``16GiB``, ``16GB``, ``512MiB``, ``1.5G`` or ``1000000``; KB/MB/GB/TB are decimal, the rest binary."""
    m = SIZE_RE.match(str(text))
    unit = m.group(3).lower() if m else ""
    if m is None or unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; expected {SIZE_FORMS}")
    try:
        value = int(round(float(m.group(1)) * 10.0 ** int(m.group(2) or 0) * SIZE_UNITS[unit]))
    except OverflowError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: too large; expected {SIZE_FORMS}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; expected at least 1 byte")
    return value


def positive(convert: Callable[[str], Any], expected: str, high: float = float("inf")) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)``, which must be a positive finite number, at most ``high``."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf") or value > high:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected {expected}")
        return value
    return parse


positive_int = positive(int, "a positive integer")
positive_float = positive(float, "a positive number, e.g. 25e9")
devices = positive(int, f"a positive integer, at most {MAX_DEVICES} (the most devices a plan may use)", MAX_DEVICES)
batch = positive(int, f"a positive integer, at most {MAX_BATCH} (torch's 32-bit batch indices)", MAX_BATCH)
classes = positive(int, f"a positive integer, at most {MAX_CLASSES} (64 x the largest vocabulary)", MAX_CLASSES)
batches = positive(int, "a positive integer, at most 1000000 (more batches take minutes to simulate)", 10**6)


def names(text: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(","))
    if not all(items):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}; expected comma-separated names without blanks")
    return items


def speeds(text: str) -> tuple[float, ...]:
    return tuple(positive_float(s.strip()) for s in text.split(","))


def replicas(text: str) -> bool | int | tuple[int, ...]:
    """``auto`` (the partitioner chooses), ``none``, a cap ``N``, or one count per stage ``1,2``."""
    low = text.strip().lower()
    if low in ("auto", "none"):
        return low == "auto"
    try:
        counts = tuple(int(v) for v in low.split(","))
    except ValueError:
        counts = ()
    if not counts or any(not 1 <= c <= MAX_DEVICES for c in counts):
        raise argparse.ArgumentTypeError(f"invalid replicas {text!r}; expected auto, none, a cap (e.g. 2) or one count "
                                         f"per stage (e.g. 1,2), each from 1 to {MAX_DEVICES} (the most devices)")
    return counts if "," in low else counts[0]


def pairs(text: str) -> tuple[tuple[str, str], ...]:
    pairs = tuple(tuple(p.split(":")) for p in names(text))
    if not all(len(p) == 2 and all(p) for p in pairs):
        raise argparse.ArgumentTypeError(f"invalid blocks {text!r}; expected TEACHER:STUDENT pairs, e.g. "
                                         f"features.3:features.2,features.6:features.4")
    return pairs  # type: ignore[return-value]

"""Sizes and FLOP counts as people read them (``1.5 MiB``, ``2.3G``)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """Human-readable FLOP count, e.g. ``2.3G``."""
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.0f}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")

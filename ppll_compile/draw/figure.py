"""What every picture shares: the output path check, a matplotlib figure, and saving it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SUFFIXES = (".png", ".svg", ".pdf")
"""File suffixes the pictures can be written as."""


def output_path(path: str | Path) -> Path:
    """``path`` as a Path whose suffix names a supported format (its folder created)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        found = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        raise ValueError(f"cannot write {str(path)!r}: it has {found}; the picture format follows the suffix, "
                         f"supported suffixes: {', '.join(SUFFIXES)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def figure(width: float, height: float) -> Any:
    """A matplotlib Figure outside pyplot's global state (rendered with Agg or the format's own backend)."""
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height))


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` in the format its suffix names, on a white background."""
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.2, facecolor="white")

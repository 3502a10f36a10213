"""The auxiliary-head policies shipped with ppll-compile, one YAML file per policy."""

from __future__ import annotations

from pathlib import Path

__all__ = ["path", "names"]

_DIR = Path(__file__).resolve().parent


def names() -> list[str]:
    """The names of the shipped policies, sorted."""
    return sorted(p.stem for p in _DIR.glob("*.yaml"))


def path(name: str) -> Path:
    """The YAML file of the shipped policy ``name``."""
    if name not in names():
        from ppll_compile.errors import PolicyError  # deferred: ppll_compile imports this package

        raise PolicyError(f"no shipped policy {name!r}; shipped policies: {', '.join(names())} "
                          f"(or pass the path to your own policy YAML file)")
    return _DIR / f"{name}.yaml"

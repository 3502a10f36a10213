"""The auxiliary-head policies shipped with ppll-compile, one YAML file per policy."""

from __future__ import annotations

from pathlib import Path

__all__ = ["path", "names", "distill_path", "distill_names"]

_DIR = Path(__file__).resolve().parent
_DISTILL = _DIR / "distill"


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


def distill_names() -> list[str]:
    """The names of the shipped distillation-loss policies (``pipebd`` plans), sorted."""
    return sorted(p.stem for p in _DISTILL.glob("*.yaml"))


def distill_path(name: str) -> Path:
    """The YAML file of the shipped distillation-loss policy ``name``."""
    if name not in distill_names():
        from ppll_compile.errors import PolicyError  # deferred: ppll_compile imports this package

        raise PolicyError(f"no shipped distillation policy {name!r}; shipped: {', '.join(distill_names())} "
                          f"(or pass the path to your own YAML file with 'loss:' and 'last:')")
    return _DISTILL / f"{name}.yaml"

"""The policies shipped with ppll-compile, one YAML file each: aux heads here, distillation losses in distill/."""

from __future__ import annotations

if __name__ == "policies":  # this folder imported by its old top-level name from a source checkout
    raise ImportError("'policies' is installed as 'ppll_compile.policies' (a top-level 'policies' would clash "
                      "with other packages): import ppll_compile.policies")

from pathlib import Path

__all__ = ["path", "names", "distill_path", "distill_names"]

_DIR = Path(__file__).resolve().parent
_DISTILL = _DIR / "distill"


def _stems(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _file(folder: Path, name: str, what: str, way_out: str) -> Path:
    if name not in _stems(folder):
        from ppll_compile.errors import PolicyError  # deferred: ppll_compile imports this package

        raise PolicyError(f"no shipped {what} {name!r}; shipped: {', '.join(_stems(folder))} ({way_out})")
    return folder / f"{name}.yaml"


def names() -> list[str]:
    """The names of the shipped aux-head policies, sorted."""
    return _stems(_DIR)


def path(name: str) -> Path:
    """The YAML file of the shipped aux-head policy ``name``."""
    return _file(_DIR, name, "policy", "or pass the path to your own policy YAML file")


def distill_names() -> list[str]:
    """The names of the shipped distillation-loss policies (``pipebd`` plans), sorted."""
    return _stems(_DISTILL)


def distill_path(name: str) -> Path:
    """The YAML file of the shipped distillation-loss policy ``name``."""
    return _file(_DISTILL, name, "distillation policy", "or pass the path to your own YAML file with 'loss:' and "
                 "'last:'")

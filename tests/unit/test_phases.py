"""The house's layout rules for the phase folders: imports point down the phase order (but for four marked ones),
modules and classes stay small, no module is hidden behind a name of its package, and every phase folder says
what it takes and gives."""

from __future__ import annotations

import ast
import importlib
import io
import sys
import tokenize
from pathlib import Path

import pytest

from tests.helpers import package_modules

ORDER = ["partitioners", "errors", "documents", "phases", "allocator", "policies", "plans", "capture", "cost", "heads", "options",
         "analysis", "place", "lower", "simulation", "runtime", "pipeline", "pipebd", "api", "__init__", "draw", "cli"]
"""The phases bottom to top, by the name under ``ppll_compile`` (``__init__``: the package's root module). A module
imports only from its own phase and the phases below it."""

UPWARD = {
    ("ppll_compile.plans.file", "ppll_compile.cost.hardware"),
    ("ppll_compile.plans.report", "ppll_compile.cost.hardware"),
    ("ppll_compile.plans.report", "ppll_compile.cost.oplog"),
    ("ppll_compile.place.partition", "ppll_compile.lower.profile"),
}
"""The only imports that point up the order: plan files and reports read the hardware presets and the operator
families of ``cost``; ``profile="time"`` times candidate stages by lowering them. Each is marked ``# upward``."""

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
NOT_PHASES = {"ppll_compile", "ppll_compile.policies"}
"""Packages that are no phase: the root (the facade's names) and the shipped policy files."""


MODULES = package_modules()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module of the package, line) of every import in module ``name``, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        else:
            continue
        out += [(t, node.lineno) for t in targets if t in MODULES and t != name]
    return out


def _phase(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _upward() -> dict[tuple[str, str], list[int]]:
    """(module, imported module) -> lines, for every import that points up the phase order."""
    out: dict[tuple[str, str], list[int]] = {}
    for name, path in MODULES.items():
        for target, line in _imports(name, path):
            if ORDER.index(_phase(target)) > ORDER.index(_phase(name)):
                out.setdefault((name, target), []).append(line)
    return out


def _comments(path: Path) -> dict[int, str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def test_every_module_has_a_phase():
    assert {n for n in MODULES if _phase(n) not in ORDER} == set()


def test_imports_point_down_the_phases():
    assert set(_upward()) == UPWARD


def test_every_upward_import_is_marked():
    unmarked = []
    for (name, target), lines in _upward().items():
        comments = _comments(MODULES[name])
        unmarked += [f"{name}:{line} -> {target}" for line in lines
                     if not any(comments.get(n, "").startswith("# upward") for n in (line, line - 1))]
    assert unmarked == []


def test_no_module_is_too_long():
    long = {n: lines for n, p in MODULES.items() if (lines := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_class_is_too_long():
    long = {f"{n}.{c.name}": c.end_lineno - c.lineno + 1 for n, p in MODULES.items()
            for c in ast.walk(ast.parse(p.read_text()))
            if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES}
    assert long == {}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if "." in n))
def test_no_module_is_shadowed(name):
    # a package attribute named like one of its modules must be that module (``import ppll_compile.plan as m``
    # once gave the function ``plan``)
    module = importlib.import_module(name)
    parent, _, child = name.rpartition(".")
    assert getattr(importlib.import_module(parent), child, None) is module is sys.modules[name]


def test_every_phase_says_what_it_takes_and_gives():
    packages = [n for n, p in MODULES.items() if p.name == "__init__.py" and n not in NOT_PHASES]
    assert len(packages) >= 15
    silent = [n for n in packages
              if not all(word in (ast.get_docstring(ast.parse(MODULES[n].read_text())) or "")
                         for word in ("Takes:", "Gives:"))]
    assert silent == []

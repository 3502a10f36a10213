"""The package's layout keeps its design rules: imports point one way, no private names cross modules."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

from tests.helpers import package_modules

MODULES = package_modules()


def _imports(name: str, path: Path) -> list[tuple[str, str]]:
    """(imported module, imported name or "") of every import in module ``name``, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, "") if sub in MODULES else (target, a.name))
    return out


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        for target, _ in _imports(name, path):
            if target in MODULES and target != name:
                g.add_edge(name, target)
    return g


def test_the_module_list_is_complete():
    assert {"ppll_compile.api", "ppll_compile.runtime.trainer", "ppll_compile.partitioners.replicas",
            "ppll_compile.policies"} <= set(MODULES)


def test_no_import_cycles():
    g = _graph()
    # a package's __init__ re-exporting its submodules is not a cycle of the code's own design
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b.startswith(a + ".")])
    assert list(nx.simple_cycles(g)) == []


def test_no_private_name_crosses_modules():
    crossing = [f"{name} imports {name_}: {target}" for name, path in MODULES.items()
                for target, name_ in _imports(name, path)
                if name_.startswith("_") and not name_.startswith("__") and target in MODULES and target != name]
    assert crossing == []


def test_planning_needs_no_process_group_and_solvers_no_torch():
    planning = [n for n in MODULES if n.startswith("ppll_compile") and not n.startswith("ppll_compile.runtime")]
    distributed = {n for n in planning if any(t.startswith("torch.distributed") for t, _ in _imports(n, MODULES[n]))}
    assert distributed == set()
    solvers = [n for n in MODULES if n.startswith("ppll_compile.partitioners")]
    assert {n for n in solvers if any(t.split(".")[0] == "torch" for t, _ in _imports(n, MODULES[n]))} == set()


def test_every_module_says_what_it_is():
    assert [n for n, p in MODULES.items() if not ast.get_docstring(ast.parse(p.read_text()))] == []

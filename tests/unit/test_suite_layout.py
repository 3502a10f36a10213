"""The test suite's own layout: shared helpers live in ``tests/helpers.py`` (and ``tests/models.py``), so no test
module imports another test module, and no file here uses a private name of another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FILES = sorted(HERE.glob("*.py"))
LOCAL = {p.stem for p in FILES}
"""The modules of this folder, importable as ``tests.<name>`` or (with the folder on ``sys.path``) as ``<name>``."""


def _local(module: str, local: set[str]) -> str | None:
    """The module of ``local`` that ``module`` names (``tests.helpers`` or ``helpers``), else ``None``."""
    parts = module.split(".")
    if parts[0] == "tests" and len(parts) == 2:
        parts = parts[1:]
    return parts[0] if len(parts) == 1 and parts[0] in local else None


def uses(source: str, local: set[str] = LOCAL) -> list[tuple[str, str]]:
    """``(module, name or "")`` for every import in ``source`` of a module of ``local`` (this folder's), and for
    every ``alias.name`` read from such a module imported under ``alias``."""
    tree = ast.parse(source)
    out: list[tuple[str, str]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (m := _local(a.name, local)) is not None:
                    out.append((m, ""))
                    aliases[a.asname or a.name] = m
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == "tests":
                for a in node.names:
                    if a.name in local:
                        out.append((a.name, ""))
                        aliases[a.asname or a.name] = a.name
            elif (m := _local(node.module, local)) is not None:
                out += [(m, a.name) for a in node.names]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.append((aliases[node.value.id], node.attr))
    return out


def test_the_checker_sees_every_way_of_naming_a_test_module():
    source = ("from tests.test_a import x\nfrom test_b import _y\nimport test_c\nfrom tests import test_d as d\n"
              "import dist_worker as w\nfrom tests.helpers import sgd\nw._batches(1)\nw.launch()\nd.z\n")
    local = {"test_a", "test_b", "test_c", "test_d", "dist_worker", "helpers"}
    assert sorted(uses(source, local)) == [("dist_worker", ""), ("dist_worker", "_batches"), ("dist_worker", "launch"),
                                           ("helpers", "sgd"), ("test_a", "x"), ("test_b", "_y"), ("test_c", ""),
                                           ("test_d", ""), ("test_d", "z")]
    assert uses("import torch\nfrom ppll_compile import _x\nfrom tests import conftest_like\n", local) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_file_imports_a_test_module_or_a_private_name_of_another_file(path: Path):
    found = [f"{module}.{name}" if name else module for module, name in uses(path.read_text())
             if module != path.stem and (module.startswith("test_") or (name.startswith("_") and
                                                                       not name.startswith("__")))]
    assert found == [], (f"{path.name} uses {', '.join(found)}: shared test code belongs in tests/helpers.py "
                         f"(models in tests/models.py) under a public name; import it from there")

"""The test suite's own layout: in-process tests live in ``tests/unit`` (no model zoo, no processes, no ``slow``
mark), the rest in ``tests/integration``; shared helpers live in ``tests/helpers.py`` (models in ``tests/models.py``,
the golden schedule grids in ``tests/grids.py``), so no test module imports another test module, and no file here
uses a private name of another."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = ("unit", "integration")
FILES = sorted(TESTS.glob("*.py")) + [p for folder in FOLDERS for p in sorted((TESTS / folder).glob("*.py"))]
LOCAL = {p.stem for p in FILES}
"""The modules of the suite, importable as ``tests.<name>``, ``tests.<folder>.<name>`` or (with their folder on
``sys.path``) as ``<name>``."""
HEAVY = re.compile(r"^\s*(import|from) (subprocess|multiprocessing|torchvision|timm|transformers)\b|mark\.slow\b", re.M)
"""What makes a test an integration test: a process, a model of the zoo, the ``slow`` mark."""


def _local(module: str, local: set[str]) -> str | None:
    """The module of ``local`` that ``module`` names (``tests.helpers`` or ``helpers``), else ``None``."""
    parts = module.split(".")
    if parts[0] == "tests" and len(parts) == 3 and parts[1] in FOLDERS:
        parts = parts[2:]
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
    source = ("from tests.unit.test_a import x\nfrom test_b import _y\nimport test_c\nfrom tests import test_d as d\n"
              "import dist_worker as w\nfrom tests.helpers import sgd\nw._batches(1)\nw.launch()\nd.z\n")
    local = {"test_a", "test_b", "test_c", "test_d", "dist_worker", "helpers"}
    assert sorted(uses(source, local)) == [("dist_worker", ""), ("dist_worker", "_batches"), ("dist_worker", "launch"),
                                           ("helpers", "sgd"), ("test_a", "x"), ("test_b", "_y"), ("test_c", ""),
                                           ("test_d", ""), ("test_d", "z")]
    assert uses("import torch\nfrom ppll_compile import _x\nfrom tests import conftest_like\n", local) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_file_imports_a_test_module_or_a_private_name_of_another_file(path: Path):
    found = [f"{module}.{name}" if name else module for module, name in uses(path.read_text())
             if module != path.stem and (module.startswith("test_") or (name.startswith("_") and
                                                                       not name.startswith("__")))]
    assert found == [], (f"{path.name} uses {', '.join(found)}: shared test code belongs in tests/helpers.py "
                         f"(models in tests/models.py) under a public name; import it from there")


def test_every_test_file_is_in_the_unit_or_the_integration_folder():
    assert [p.name for p in TESTS.glob("test_*.py")] == []
    names = [p.name for folder in FOLDERS for p in (TESTS / folder).glob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == [], "pytest needs every test file's name once"


@pytest.mark.parametrize("path", sorted((TESTS / "unit").glob("test_*.py")), ids=lambda p: p.name)
def test_a_unit_test_file_starts_no_process_loads_no_zoo_model_and_is_not_slow(path: Path):
    found = HEAVY.findall(path.read_text())
    assert found == [], f"{path.name}: {found}; such tests belong in tests/integration"

"""Tests of the partitioners package: the exact solver against brute force, the baselines, errors, the registry,
a valid partition of 10,000 segments under a memory cap no worse than the uniform one, and an import without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
import pytest


@pytest.mark.slow
def test_the_solvers_load_without_torch() -> None:
    # the folder loaded on its own, under a name of its own: the solvers import neither torch nor ppll_compile
    folder = Path(__file__).resolve().parents[2] / "partitioners"
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('solvers', {str(folder / '__init__.py')!r},\n"
            f"    submodule_search_locations=[{str(folder)!r}])\n"
            "solvers = importlib.util.module_from_spec(spec); sys.modules['solvers'] = solvers\n"
            "spec.loader.exec_module(solvers)\n"
            "assert solvers.solve(solvers.Problem(compute=[1, 2, 3]), 2) == (2, 3)\n"
            "assert 'torch' not in sys.modules and 'ppll_compile' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], cwd="/", check=True, timeout=60)


@pytest.mark.parametrize("name", ["partitioners", "policies"])
def test_the_old_top_level_names_say_the_new_ones(name: str) -> None:
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1
    assert (f"ImportError: '{name}' is installed as 'ppll_compile.{name}' (a top-level '{name}' would clash with "
            f"other packages): import ppll_compile.{name}") in run.stderr

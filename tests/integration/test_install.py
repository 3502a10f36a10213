"""What installing the project asks of the machine: torch alone from the torch family, nothing that swaps the
torch build already installed (a CPU build stays a CPU build)."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("ppll_compile", "partitioners", "policies")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_the_library_needs_torch_and_no_torchvision():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert core == {"torch", "networkx", "numpy", "pyyaml", "tqdm", "matplotlib"}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    assert "torchvision" in extras["examples"] and "torchvision" in extras["test"]
    imported = set()
    for folder in LIBRARY:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    assert "torchvision" not in imported and "timm" not in imported and "transformers" not in imported


@pytest.mark.slow
@pytest.mark.parametrize("target", [".", ".[test]"])
def test_installing_over_the_installed_torch_keeps_it(target, tmp_path):
    # pip's own resolver, asked what it would install here: the project and nothing of the torch family
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                          "-e", target], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    would = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "ppll-compile" in would
    assert not would & {"torch", "torchvision", "triton"} and not any(n.startswith("nvidia-") for n in would), would

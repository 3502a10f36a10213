"""The examples follow their own advice: the ppll-plan command a docstring gives plans what the example trains, no
example leaves the CPU fallback to a warning, and every torch.load in them loads tensors only."""

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppll_compile.cli.command import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _torch_loads(folders: tuple[str, ...]) -> list[tuple[str, ast.Call]]:
    found = []
    for path in sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node))
    return found


@pytest.mark.slow
def test_the_pipebd_docstring_command_plans_what_the_example_trains(capsys):
    source = (EXAMPLES / "pipebd_mobilenet.py").read_text()
    doc = ast.get_docstring(ast.parse(source))
    command = shlex.split(re.search(r"``(ppll-plan examples/pipebd_mobilenet\.py [^`]*)``", doc).group(1))
    assert main([str(ROOT / command[1]), *command[2:], "--json", "-"]) == 0
    saved = json.loads(capsys.readouterr().out)
    # what main() trains: Adam, and the --policy default
    assert 'optimizer = lambda params: torch.optim.Adam(' in source
    trained_policy = re.search(r'p\.add_argument\("--policy", [^)]*default="(\w+)"', source).group(1)
    assert (saved["mode"], saved["optimizer"], saved["policy"]) == ("pipebd", "adam", trained_policy)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the example's 2 stages have their GPUs here")
def test_the_cifar_style_example_chooses_the_cpu_instead_of_a_warned_fallback():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_cifar_style.py"), "--synthetic", "--epochs", "1",
                           "--steps-per-epoch", "2", "--batch-size", "8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA device(s)" not in proc.stdout + proc.stderr
    assert "final accuracy" in proc.stdout


def test_every_torch_load_loads_tensors_only():
    """Examples, library, benchmarks and tests alike: the declared torch>=2.4 still unpickles without it."""
    assert len(_torch_loads(("examples",))) >= 2  # the Pipe-BD teacher's weights and the CIFAR-style data
    loads = _torch_loads(("examples", "ppll_compile", "partitioners", "policies", "benchmarks", "tests"))
    unsafe = [where for where, call in loads
              if not any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in call.keywords)]
    assert unsafe == []

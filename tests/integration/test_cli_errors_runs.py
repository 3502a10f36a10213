"""Bad arguments and bad files: ppll-plan exits 2 with one message (1 for an internal error) and never a traceback;
compile() names every bad argument."""
import random
import re
import textwrap
from pathlib import Path

import pytest
import yaml
from ppll_compile.cli.command import main

PIPEBD = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

build_teacher = build_model

def example_inputs():
    return (torch.randn(2, 8),)
"""

MODEL = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def example_inputs():
    return (torch.randn(2, {width}),)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A good model file, a good 3-stage plan, and generated bad files and plans."""
    d = tmp_path_factory.mktemp("files")
    rng = random.Random(4)
    out = {"dir": d / "folder"}
    out["dir"].mkdir()
    for name, text in (("model.py", MODEL.format(width=8)), ("misfit.py", MODEL.format(width=5)),
                       ("pipebd.py", PIPEBD)):
        out[name] = d / name
        out[name].write_text(textwrap.dedent(text))
    for name in ("random.yaml", "random.json", "random.py"):
        out[name] = d / name
        out[name].write_bytes(bytes([0xff, 0xfe]) + rng.randbytes(300))  # never valid UTF-8
    out["latin1.yaml"] = d / "latin1.yaml"
    out["latin1.yaml"].write_bytes("name: café\nheads: {vector: {type: mlp}}\n".encode("latin-1"))
    out["plan.yaml"] = d / "plan.yaml"
    assert main([str(out["model.py"]), "--gpus", "3", "--devices", "cpu,cpu,cpu", "--split-points", "_0,_1",
                 "--yaml", str(out["plan.yaml"])]) == 0
    good = yaml.safe_load(out["plan.yaml"].read_text())
    assert [s["last_node"] for s in good["stages"][:-1]] == ["_0", "_1"]

    def edited(name: str, edit) -> None:
        saved = yaml.safe_load(out["plan.yaml"].read_text())
        edit(saved)
        out[name] = d / name
        out[name].write_text(yaml.safe_dump(saved))

    def reverse(p):
        p["stages"][0]["last_node"], p["stages"][1]["last_node"] = "_1", "_0"

    edited("reversed.yaml", reverse)
    edited("duplicated.yaml", lambda p: p["stages"].insert(1, dict(p["stages"][0])))
    edited("banana.yaml", lambda p: p["stages"][1].update(device="banana"))
    edited("tpu.yaml", lambda p: p["stages"][2].update(device="tpu:7"))
    edited("batch.yaml", lambda p: p.update(batch_size="many"))
    return out


def _cases() -> list[tuple[str, list[str], tuple[str, ...]]]:
    """(id, argv with {file} placeholders, what stderr must say)."""
    m = "{model.py}"
    return [
        ("memory-limit-overflow", [m, "--gpus", "2", "--memory-limit", "1e400"], ("'1e400': too large",)),
        ("devices-banana", [m, "--devices", "banana,cpu"], ("devices[0]: 'banana' is not a device", "cpu, cuda")),
        ("devices-tpu", [m, "--devices", "cpu,tpu:7"], ("devices[1]: 'tpu:7' is not a device",)),
        ("devices-meta", [m, "--devices", "meta,cpu"], ("devices[0]: 'meta' is a meta device",)),
        ("time-profile-on-a-missing-device", [m, "--devices", "cuda:99,cpu", "--profile", "time"],
         ("--profile time measures on the first device, 'cuda:99', which this machine does not have",)),
        ("batch-size-too-large", [m, "--gpus", "2", "--batch-size", "1" + "0" * 25],
         ("argument --batch-size: invalid value '1" + "0" * 25 + "'", "at most 2147483647")),
        ("plan-bad-device", [m, "--plan", "{banana.yaml}"], ("banana.yaml: stages[1].device: 'banana'",)),
        ("plan-tpu-device", [m, "--plan", "{tpu.yaml}"], ("tpu.yaml: stages[2].device: 'tpu:7'",)),
        ("plan-reversed-cuts", [m, "--plan", "{reversed.yaml}"],
         ("reversed.yaml: stages[1] ends at '_0', which comes before '_1' where stages[0] ends", "swap")),
        ("plan-duplicated-stage", [m, "--plan", "{duplicated.yaml}"],
         ("duplicated.yaml: stages[0] and stages[1] both end at '_0'", "delete the duplicated stage")),
        ("plan-bad-setting", [m, "--plan", "{batch.yaml}"],
         ("batch.yaml: batch_size must be a positive integer, got 'many'",)),
        ("plan-random-bytes", [m, "--plan", "{random.yaml}"], ("random.yaml: not a plan file", "not UTF-8")),
        ("plan-random-json", [m, "--plan", "{random.json}"], ("random.json: not a plan file", "not UTF-8")),
        ("plan-directory", [m, "--plan", "{dir}"], ("is a directory",)),
        ("policy-random-bytes", [m, "--gpus", "2", "--policy", "{random.yaml}"],
         ("random.yaml: not a policy file", "not UTF-8")),
        ("policy-latin1", [m, "--gpus", "2", "--policy", "{latin1.yaml}"],
         ("latin1.yaml: not a policy file (byte 0xe9 at offset 9 is not UTF-8 text)",)),
        ("policy-directory", [m, "--gpus", "2", "--policy", "{dir}"], ("is a directory",)),
        ("pipebd-policy-random-bytes", ["{pipebd.py}", "--mode", "pipebd", "--gpus", "2", "--policy",
                                        "{random.yaml}"], ("random.yaml: not a policy file", "not UTF-8")),
        ("model-random-bytes", ["{random.py}", "--gpus", "2"], ("random.py raised SyntaxError",)),
        ("model-directory", ["{dir}", "--gpus", "2"], ("is not a file",)),
        ("model-misfit", ["{misfit.py}", "--gpus", "2"],
         ("does not run on the example inputs (input (2, 5)): node '_0' (module '0') fails with RuntimeError",
          "input dtypes: input float32")),
        ("model-misfit-export", ["{misfit.py}", "--gpus", "2", "--tracer", "export"],
         ("does not run on the example inputs (input (2, 5)): module '0' (Linear) fails with RuntimeError",)),
        ("yaml-into-directory", [m, "--gpus", "2", "--yaml", "{dir}"], ("--yaml: cannot write", "it is a directory")),
        ("plot-into-missing-directory", [m, "--gpus", "2", "--plot", "{dir}/missing/cost.png"],
         ("--plot: cannot write", "missing' does not exist")),
    ]


@pytest.mark.parametrize("argv, needles", [pytest.param(a, n, id=i) for i, a, n in _cases()])
def test_bad_arguments_and_files_exit_2_with_one_message(files, capsys, argv, needles):
    argv = [re.sub(r"\{([^}]+)\}", lambda m: str(files[m.group(1)]), a) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    assert err.startswith("ppll-plan: error:") or "\nppll-plan: error:" in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"

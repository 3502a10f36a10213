"""Bad arguments and bad files: ppll-plan exits 2 with one message (1 for an internal error) and never a traceback;
compile() names every bad argument."""
import re
from pathlib import Path

import pytest

from ppll_compile.cli.command import main
from tests.helpers import cli_bad_files


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A good model file, a good 3-stage plan, and generated bad files and plans."""
    return cli_bad_files(tmp_path_factory.mktemp("files"))


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

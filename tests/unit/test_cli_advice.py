"""ppll-plan words the library's advice as its own flags, and its --help states the defaults the code has."""

import argparse
import re

import pytest

from ppll_compile import partitioners, policies
from ppll_compile.cli.advice import cli_worded
from ppll_compile.cli.command import main
from ppll_compile.cost import hardware
from ppll_compile.options import PlanOptions
from tests.helpers import cli_user_error, gated_model_file


@pytest.fixture
def gated(tmp_path) -> str:
    return gated_model_file(tmp_path)


def _help(capsys) -> dict[str, str]:
    """--help's text per long option, its wrapped lines joined."""
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    helps: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        m = re.match(r"  (--[\w-]+)(?: \S+)?(?:  +(.*))?$", line)
        if m:
            flag = m.group(1)
            helps[flag] = m.group(2) or ""
        elif flag is not None and line.startswith("    "):
            helps[flag] += " " + line.strip()
        else:
            flag = None
    return {f: re.sub(r"(\w)- (\w)", r"\1-\2", h).strip() for f, h in helps.items()}  # argparse wraps at hyphens


# ---- --help ---------------------------------------------------------------------------------

def test_help_states_the_plan_options_own_defaults(capsys):
    helps = _help(capsys)
    defaults = PlanOptions()
    stated = {flag: re.search(r"\(default: ([^)]*)\)", h).group(1) for flag, h in helps.items()
              if re.search(r"\(default: ([^)]*)\)", h)}
    expected = {
        "--profile": defaults.profile, "--optimizer": defaults.optimizer, "--partitioner": defaults.partitioner,
        "--tracer": defaults.tracer, "--tied": defaults.tied, "--policy": defaults.policy,
        "--link-bandwidth": f"{defaults.link_bandwidth:.1e}".replace(".0e", "e").replace("e+", "e"),
        "--flops-per-second": f"{defaults.flops_per_second:.0e}".replace("e+", "e"),
    }
    assert {flag: stated.get(flag) for flag in expected} == expected
    assert stated["--profile"] == "roofline" and "FLOPs on fake tensors (default)" not in helps["--profile"]
    assert float(stated["--link-bandwidth"]) == defaults.link_bandwidth
    assert float(stated["--flops-per-second"]) == defaults.flops_per_second


def test_help_lists_what_the_code_ships(capsys):
    helps = _help(capsys)
    assert f"a shipped name ({', '.join(policies.names())})" in helps["--policy"]
    assert f"the distillation losses ({', '.join(policies.distill_names())})" in helps["--policy"]
    assert f"nothing timed here: {', '.join(hardware.NAMES[:-1])}, cpu (this machine)," in helps["--hardware"]
    baselines = sorted(set(partitioners.SOLVERS) - {"exact"})
    assert helps["--partitioner"] == f"exact or a baseline: {', '.join(baselines)} (default: exact)"
    assert helps["--remeasure"] == ("with --plan: measure the saved plan's costs again on this machine, in the "
                                    "profile it was made with")


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "2", "--tracer", "export", "--leaf-modules", "2"],
     "--leaf-modules keeps modules opaque to torch.fx symbolic tracing; torch.export captures every module. Drop "
     "--leaf-modules, or use --tracer fx"),
    (["--gpus", "9", "--leaf-modules", "2"],
     "plan at most 5 stages (--gpus 5 or fewer): the model has 4 legal cut point(s); got --gpus 9"),
    (["--gpus", "3", "--gpus-per-node", "2"],
     "--gpus 3 is not a multiple of --gpus-per-node 2: the devices must fill whole nodes; plan for 2 or 4 devices, "
     "or set --gpus-per-node to the devices each node gives the pipeline"),
    (["--gpus", "2", "--hardware", "h100", "--profile", "time"],
     "--profile time times the stages on this machine, but --hardware h100 plans for other devices; use --profile "
     "roofline (the default) to price them with its figures, or drop --hardware to time them here"),
    (["--gpus", "2", "--replicas", "2", "--partitioner", "greedy"],
     "--replicas 2 lets the exact partitioner place replicas; drop --partitioner greedy"),
], ids=["export-leaf-modules", "too-many-gpus", "gpus-per-node", "hardware-time", "replicas-partitioner"])
def test_library_errors_are_worded_as_flags(gated, capsys, argv, message):
    assert cli_user_error(capsys, [gated, *argv]) == f"ppll-plan: error: {message}\n"


def test_the_cpu_fallback_note_and_warning_name_the_devices_flag(gated, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    advice = ("this machine has {n} CUDA device(s), so cuda:60, cuda:61 cannot be used; all 2 stages run on the "
              "CPU (pass --devices DEV,... to choose)")
    argv = [gated, "--devices", "cuda:60,cuda:61", "--leaf-modules", "2"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    notes = [line for line in out.splitlines() if "CUDA" in line]
    assert len(notes) == 1 and re.fullmatch(r"note: " + re.escape(advice).replace(r"\{n\}", r"\d+"), notes[0])
    assert main([*argv, "--yaml", str(tmp_path / "plan.yaml")]) == 0  # not shown: said as a warning
    warned = [line for line in capsys.readouterr().err.splitlines() if "CUDA" in line]
    assert len(warned) == 1 and re.fullmatch(r"ppll-plan: warning: " + re.escape(advice).replace(r"\{n\}", r"\d+"),
                                              warned[0])


# ---- the wording itself -------------------------------------------------------------------------

def _few_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tool")
    p.add_argument("--gpus", metavar="N")
    p.add_argument("--blocks", metavar="T:S,...")
    p.add_argument("--bake-train-mode", action="store_true")
    p.add_argument("--replicas", metavar="auto|none|N")
    p.add_argument("--batch-size", metavar="B")
    p.add_argument("--split-points", metavar="A,B")
    return p


@pytest.mark.parametrize("message, worded", [
    ("keep it opaque with leaf_modules=['layer1.0'], or gpus=2",
     "keep it opaque with leaf_modules=['layer1.0'] (in Python: ppll_compile.compile(..., "
     "leaf_modules=['layer1.0']); ppll-plan has no flag for it), or --gpus 2"),
    ("pass teacher=<the frozen nn.Module>", "pass build_teacher() in MODEL.py (with --mode pipebd)"),
    ("blocks=[('a.1', 'b'), ('c', 'd')] and bake_train_mode=True; or blocks=[(teacher_module, student_module), ...]",
     "--blocks a.1:b,c:d and --bake-train-mode; or --blocks T:S,..."),
    ("replicas=True, replicas=False, replicas=(1, 2), gpus=N.", "--replicas auto, --replicas none, --replicas 1,2, "
     "--gpus N."),
    ("with optimizer='adam' (ppll_compile.compile(model, ..., gpus=2)) and my_gpus=3, x.gpus=4",
     "with optimizer='adam' (in Python: ppll_compile.compile(..., optimizer='adam'); ppll-plan has no flag for it) "
     "(ppll_compile.compile(model, ..., gpus=2)) and my_gpus=3, x.gpus=4"),
])
def test_advice_follows_the_parsers_own_flags(message, worded):
    assert cli_worded(message, _few_flags()) == worded


def test_an_untouched_message_stays_as_it_is():
    message = ("devices[0]: 'banana' is not a device; the model's gpus, its policy and plans (gpus) stay as written, "
               "and so do paths: use /runs/gpus=2/batch_size.py, C:\\split_points\\x.yaml, and a file's keys: "
               "plan.yaml: batch_size must be a positive integer")
    assert cli_worded(message, _few_flags()) == message

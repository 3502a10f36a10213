"""ppll-plan imports a model file without running its work: a training script is refused before any of it runs,
a `__main__` block never runs; the table's legend; the flags of the newest plan options."""

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest

from ppll_compile.cli.advice import cli_worded, flag_table
from ppll_compile.cli.arguments import parser, plan_options
from ppll_compile.cli.command import main
from ppll_compile.cli.model_file import TOP_LEVEL_RULE
from ppll_compile.options import PlanOptions

FLOPS = ["--gpus", "2", "--profile", "flops"]

MODEL = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def example_inputs():
    return (torch.randn(2, 8),)
"""

SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
example_inputs = (torch.randn(2, 8),)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    model(example_inputs[0]).sum().backward()
    optimizer.step()
with open({marker!r}, "w") as f:
    f.write("trained")
torch.save(model.state_dict(), {marker!r})
"""
"""A training script in the README recipe's shape: its work (lines 8, 11 and 13) at the top level."""


def _write(folder: Path, text: str, name: str = "model.py") -> str:
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip())
    return str(path)


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err


# ---- a model file is imported, never run ---------------------------------------------------------------

def test_a_training_script_is_refused_before_any_of_it_runs(tmp_path, capsys):
    marker = tmp_path / "trained.txt"
    path = _write(tmp_path, SCRIPT.format(marker=str(marker)), "train.py")
    err = _error(capsys, [path, *FLOPS])
    assert err == (f"ppll-plan: error: {path}:8: a for loop at the top level would run when ppll-plan imports the "
                   "file (and top-level work on lines 11, 13); a model file's top level only imports, defines (def, "
                   "class) and assigns, and may seed (ppll-plan --help gives the whole rule). Move that work under "
                   '`if __name__ == "__main__":`, which ppll-plan never runs, or into a function; nothing in the file '
                   "was run\n")
    assert not marker.exists()


@pytest.mark.parametrize("work, what, offset", [
    ("print('training')", "a call of print()", 0),
    ("trainer.fit(loader, epochs=2)", "a call of trainer.fit()", 0),
    ("while True:\n    pass", "a while loop", 0),
    ("if torch.cuda.is_available():\n    torch.cuda.synchronize()", "a call of torch.cuda.synchronize()", 1),
    ("try:\n    import timm\nexcept ImportError:\n    main()", "a call of main()", 3),
    ("x + 1", "an expression statement", 0),
])
def test_each_kind_of_top_level_work_is_named_by_its_line(tmp_path, capsys, work, what, offset):
    path = _write(tmp_path, MODEL + work + "\n")
    line = len(MODEL.strip().splitlines()) + 1 + offset
    err = _error(capsys, [path, *FLOPS])
    assert err.startswith(f"ppll-plan: error: {path}:{line}: {what} at the top level would run when ppll-plan "
                          "imports the file; ")


def test_the_main_block_never_runs_and_setup_is_accepted(tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    path = _write(tmp_path, '"""A model file that is also a script."""\nimport sys\nimport warnings\n' + MODEL
                  + textwrap.dedent(f"""
        torch.manual_seed(0)
        sys.path.insert(0, "unused")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            import not_installed_anywhere
        except ImportError:
            not_installed_anywhere = None
        if not_installed_anywhere is None:
            WIDTH = 16
        assert WIDTH == 16

        if __name__ == "__main__":
            open({str(marker)!r}, "w").write("ran")
            raise SystemExit(1)
    """))
    assert main([path, *FLOPS, "--json", str(tmp_path / "plan.json")]) == 0
    assert (tmp_path / "plan.json").is_file() and not marker.exists()


def test_a_file_that_is_not_python_is_refused_before_it_runs(tmp_path, capsys):
    path = tmp_path / "model.safetensors.py"
    path.write_bytes(b"\x00\x01binary")
    err = _error(capsys, [str(path), *FLOPS])
    assert err == (f"ppll-plan: error: loading {path} raised SyntaxError: source code string cannot contain null "
                   "bytes; pass a Python file that defines build_model() and example_inputs()\n")


def test_help_states_the_rule(capsys):
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert " ".join(TOP_LEVEL_RULE.split()) in text
    assert "is refused, naming the line, before any of it runs" in text


# ---- the legend -----------------------------------------------------------------------------------------

def test_legend_prints_under_the_table(tmp_path, capsys):
    path = _write(tmp_path, MODEL)
    assert main([path, *FLOPS, "--legend"]) == 0
    out = capsys.readouterr().out
    table, legend = out.split("\n\nstage table:\n")
    assert table.startswith("PPLL plan for Sequential") and "\nmemory table:\n  stage  " in legend
    assert re.search(r"^  fwd +the stage's forward: FLOPs per batch", legend, re.MULTILINE)


def test_legend_goes_to_stderr_with_the_plan_on_stdout(tmp_path, capsys):
    path = _write(tmp_path, MODEL)
    assert main([path, *FLOPS, "--json", "-", "--legend"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("{") and "stage table:\n  stage" in err and "stage table" not in out


# ---- flags of the plan options --------------------------------------------------------------------------

def test_every_plan_option_has_its_flag():
    flags = flag_table(parser())
    assert [f.name for f in dataclasses.fields(PlanOptions) if f.name not in flags] == []


def test_frozen_and_checkpoint_activations_map_onto_their_options():
    args = parser().parse_args(["m.py", "--frozen", "encoder.pos_embed", "head,norm", "--checkpoint-activations"])
    assert plan_options(args) == {"frozen": ("encoder.pos_embed", "head", "norm"), "checkpoint_activations": True}
    assert plan_options(parser().parse_args(["m.py"])) == {}
    PlanOptions.make(**plan_options(args))  # the options take them as given


def test_frozen_before_the_model_file_is_told_apart(tmp_path, capsys):
    err = _error(capsys, ["--frozen", "encoder.pos_embed", "model.py"])
    assert err == ("ppll-plan: error: --frozen took 'model.py' for a parameter name (it takes every word after it); "
                   "give MODEL.py before --frozen, e.g. ppll-plan model.py --frozen NAME\n")


def test_advice_on_the_new_options_is_worded_as_flags():
    text = "pass frozen=['encoder.pos_embed', 'head'] to accept them, or checkpoint_activations=True"
    assert cli_worded(text, parser()) == ("pass --frozen encoder.pos_embed head to accept them, or "
                                          "--checkpoint-activations")

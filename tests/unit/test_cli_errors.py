"""Bad arguments and bad files: ppll-plan exits 2 with one message (1 for an internal error) and never a traceback;
compile() names every bad argument."""

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import ppll_compile.cli.command
from ppll_compile import Plan, PlanError, PolicyError, TraceError, compile, plan
from ppll_compile.cli.command import main
from ppll_compile.pipebd.policy import load_distill_policy
from tests.helpers import cli_bad_files


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


X = torch.randn(2, 8)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A good model file, a good 3-stage plan, and generated bad files and plans."""
    return cli_bad_files(tmp_path_factory.mktemp("files"))


def test_an_internal_error_exits_1_with_a_short_message_and_the_traceback_under_debug(files, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(ppll_compile.cli.command, "plan", broken)
    argv = [str(files["model.py"]), "--gpus", "2"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert err == "ppll-plan: internal error: RuntimeError: boom; rerun with --debug for the traceback\n"
    assert main([*argv, "--debug"]) == 1
    _, err = capsys.readouterr()
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert err.endswith("ppll-plan: internal error: RuntimeError: boom\n")


def test_a_pipebd_plan_file_loads_the_teacher_without_mode(files, tmp_path, capsys):
    saved = tmp_path / "pipebd.yaml"
    assert main([str(files["pipebd.py"]), "--mode", "pipebd", "--gpus", "1", "--yaml", str(saved)]) == 0
    capsys.readouterr()
    assert main([str(files["pipebd.py"]), "--plan", str(saved), "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["mode"] == "pipebd" and "Traceback" not in err


def test_debug_shows_the_traceback_of_a_user_error_too(files, capsys):
    assert main([str(files["model.py"]), "--plan", str(files["reversed.yaml"]), "--debug"]) == 2
    _, err = capsys.readouterr()
    assert "Traceback (most recent call last)" in err and "ppll-plan: error: " in err


# ---- compile() names every bad argument -------------------------------------------------

def test_gpus_must_be_a_positive_int_not_a_bool():
    with pytest.raises(ValueError, match=r"^gpus must be a positive integer, got True$"):
        compile(_mlp(), True, example_inputs=(X,))
    with pytest.raises(ValueError, match=r"^batch_size must be a positive integer, got True$"):
        plan(_mlp(), 2, example_inputs=(X,), batch_size=True)


def test_a_policy_file_that_is_not_utf8_is_named(files):
    with pytest.raises(PolicyError, match=re.escape(f"{files['latin1.yaml']}: not a policy file (byte 0xe9 at "
                                                    "offset 9 is not UTF-8 text)")):
        compile(_mlp(), 2, example_inputs=(X,), policy=str(files["latin1.yaml"]))
    with pytest.raises(PolicyError, match=re.escape(f"{files['random.yaml']}: not a policy file (byte 0xff at "
                                                    "offset 0 is not UTF-8 text)")):
        load_distill_policy(str(files["random.yaml"]))


def test_a_plan_file_that_is_not_utf8_is_named(files):
    with pytest.raises(PlanError, match=re.escape(f"{files['random.yaml']}: not a plan file (byte 0xff at offset "
                                                  "0 is not UTF-8 text)")):
        compile(_mlp(), example_inputs=(X,), plan=str(files["random.yaml"]))
    with pytest.raises(PlanError, match=re.escape(f"{files['random.json']}: not a plan file")):
        Plan.load(files["random.json"])


def test_a_plan_with_a_bad_device_does_not_load(files):
    with pytest.raises(PlanError, match=re.escape(f"{files['banana.yaml']}: stage 1: device 'banana' is not a "
                                                  "device; a stage runs on cpu, cuda, mps, xpu")):
        Plan.load(files["banana.yaml"])


def test_a_plan_directory_is_called_a_directory(files):
    with pytest.raises(PlanError, match=re.escape(f"plan file {str(files['dir'])!r} is a directory; pass the path "
                                                  "of a plan file")):
        compile(_mlp(), example_inputs=(X,), plan=files["dir"])
    with pytest.raises(PlanError, match="is a directory"):
        Plan.load(files["dir"])


def test_one_tensor_as_example_inputs_is_a_1_tuple():
    assert plan(_mlp(), 2, example_inputs=X) == plan(_mlp(), 2, example_inputs=(X,))
    assert compile(_mlp(), 2, example_inputs=X).plan.inputs[0].shape == (2, 8)


def test_an_example_input_that_does_not_fit_names_the_module_shapes_and_dtypes():
    start = "the model does not run on the example inputs (input (2, 5)): "
    end = ("; input dtypes: input float32. Pass example inputs of the shape and dtype the model takes "
           "(model(*example_inputs) must run)")
    traced = (start + "node '_0' (module '0') fails with RuntimeError: a and b must have same reduction dim, but got "
              "[2, 5] X [8, 16]" + end)
    exported = start + "module '0' (Linear) fails with RuntimeError: mat1 and mat2 shapes cannot be multiplied " \
                       "(2x5 and 8x16)" + end
    with pytest.raises(PlanError, match=f"^{re.escape(traced)}$"):
        compile(_mlp(), 2, example_inputs=(torch.randn(2, 5),))
    with pytest.raises(PlanError, match=f"^{re.escape(exported)}$"):
        compile(_mlp(), 2, example_inputs=(torch.randn(2, 5),), tracer="export")


def test_a_model_that_runs_but_not_on_fake_tensors_is_not_called_a_misfit():
    class ToNumpy(nn.Module):
        def forward(self, x):
            return x * float(x.detach().numpy().std())

    model = nn.Sequential(nn.Linear(8, 16), ToNumpy(), nn.Linear(16, 4))
    with pytest.raises(TraceError, match="^torch.fx cannot trace Sequential"):
        plan(model, 2, example_inputs=(X,))


def test_a_module_that_rejects_its_input_without_a_message_is_named():
    class Check(nn.Module):
        def forward(self, x):
            if x.shape[-1] != 8:
                raise AssertionError
            return x

    model = nn.Sequential(Check(), _mlp())
    with pytest.raises(PlanError, match=re.escape("(input (2, 5)): module '0' (Check) fails with AssertionError; "
                                                  "input dtypes: input float32. Pass example inputs")):
        plan(model, 2, example_inputs=(torch.randn(2, 5),))


def test_extra_example_inputs_are_an_error_naming_how_many_forward_takes():
    with pytest.raises(TraceError, match=re.escape("Sequential.forward takes 1 positional argument(s) ['input'], "
                                                   "but 2 example inputs were given; drop the extra ones")):
        compile(_mlp(), 2, example_inputs=(X, X))


def test_an_argument_given_by_position_and_by_keyword_is_an_error():
    with pytest.raises(TraceError, match=re.escape("Sequential.forward gets ['input'] both from example_inputs (by "
                                                   "position) and from example_kwargs")):
        compile(_mlp(), 2, example_inputs=(X,), example_kwargs={"input": X})


def test_a_batch_of_0_is_an_error():
    with pytest.raises(ValueError, match=re.escape("the example inputs hold a batch of 0 examples (shape (0, 8))")):
        compile(_mlp(), 2, example_inputs=(torch.randn(0, 8),))


def test_a_plan_with_a_duplicated_stage_or_reversed_cuts_says_how_to_fix_the_file(files):
    with pytest.raises(PlanError, match=re.escape(f"{files['duplicated.yaml']}: stages[0] and stages[1] both end at "
                                                  "'_0'; every stage must end after the one before it")):
        compile(_mlp(), example_inputs=(X,), plan=files["duplicated.yaml"])
    with pytest.raises(PlanError, match=re.escape(f"{files['reversed.yaml']}: stages[1] ends at '_0', which comes "
                                                  "before '_1' where stages[0] ends; the stages must follow the "
                                                  "model's order")):
        compile(_mlp(), example_inputs=(X,), plan=files["reversed.yaml"])


def test_devices_must_be_known_device_types():
    with pytest.raises(ValueError, match=re.escape("devices[1]: 'tpu:7' is not a device; a stage runs on cpu, cuda, "
                                                   "mps, xpu")):
        compile(_mlp(), example_inputs=(X,), devices=["cpu", "tpu:7"])
    with pytest.raises(TypeError, match=re.escape("devices must be a list with one entry per item, got 'cpu'")):
        compile(_mlp(), example_inputs=(X,), devices="cpu")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an mps device")
def test_compile_onto_a_device_kind_this_machine_lacks_is_an_error():
    with pytest.raises(PlanError, match=re.escape("devices asks for 'mps', which this machine does not have")):
        compile(_mlp(), example_inputs=(X,), devices=["mps", "cpu"])
    assert plan(_mlp(), example_inputs=(X,), devices=["mps", "cpu"]).devices == ("mps", "cpu")


def test_a_good_saved_plan_is_reapplied_unchanged(files):
    saved = Plan.load(files["plan.yaml"])
    assert plan(_mlp(), example_inputs=(X,), plan=files["plan.yaml"]).cuts == saved.cuts == ("_0", "_1")

"""Every size a user writes in a policy or plan file is bounded by what a device could hold: a bad value is refused
when the file is read, naming the file, the field, the value and the bound, before anything is built; files too big
or nested too deep are refused with a message, and ppll-plan says so in one line."""

import copy
import textwrap

import pytest
import torch
import yaml

import ppll_compile
import ppll_compile.cli.command
from tests.helpers import Net, cli_error, policy_file


# -- plan files ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good() -> dict:
    """A 2-stage plan of :class:`Net`, as a plan file's mapping."""
    made = ppll_compile.plan(Net(), 2, example_inputs=(torch.randn(2, 3, 4, 4),), devices=["cpu", "cpu"],
                             profile="flops", split_points=["a"])
    return made.to_dict()
WAY_OUT = "; fix the plan file, or re-create it with `ppll-plan MODEL.py --yaml plan.yaml`"


# -- ppll-plan ----------------------------------------------------------------------------------------------------

MODEL = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

def example_inputs():
    return (torch.randn(2, 3, 4, 4),)
"""


def test_ppll_plan_refuses_oversized_policies_and_plans_in_one_line(tmp_path, capsys, good):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(MODEL))
    deep = policy_file(tmp_path, {"heads": {"feature_map": {"type": "conv", "depth": 2**70}}}, "deep.yaml")
    assert cli_error([model, "--gpus", "2", "--policy", deep], capsys) == (
        f"ppll-plan: error: {deep}: heads.feature_map.depth must be an integer from 0 to 1024 (deeper than "
        f"ResNet-1001's trunk), got 1180591620717411303424\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("heads: " + "[" * 20000 + "]" * 20000 + "\n")
    assert cli_error([model, "--gpus", "2", "--policy", nested], capsys) == (
        f"ppll-plan: error: {nested}: the policy is nested deeper than the YAML reader can follow (a policy nests a "
        f"few levels: section, entry, option); pass the right file, or flatten it\n")
    for field, value, message in (
            ("replicas", 2**70, "stages[0].replicas must be an integer from 1 to 4096 (the most devices a plan may "
                                f"use), got 1180591620717411303424{WAY_OUT}"),
            ("head", 2**70, "stages[0].head.config.depth must be an integer from 0 to 1024 (deeper than "
                            "ResNet-1001's trunk), got 1180591620717411303424")):
        d = copy.deepcopy(good)
        if field == "replicas":
            d["stages"][0]["replicas"] = value
        else:
            d["stages"][0]["head"]["config"] = {"type": "conv", "depth": value}
        plan_file = tmp_path / f"{field}.yaml"
        plan_file.write_text(yaml.safe_dump(d))
        assert cli_error([model, "--plan", plan_file], capsys) == f"ppll-plan: error: {plan_file}: {message}\n"
    nested = tmp_path / "nested_plan.yaml"
    nested.write_text("version: 1\nstages: " + "[" * 20000 + "]" * 20000 + "\n")
    assert cli_error([model, "--plan", nested], capsys).startswith(
        f"ppll-plan: error: {nested}: the plan is nested deeper than the reader can follow")

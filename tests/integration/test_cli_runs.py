"""The ppll-plan command: flags, model files, outputs, plan round trips and the errors it reports."""
import json
from pathlib import Path

import pytest
from ppll_compile.cli.command import main
import yaml
from ppll_compile import Plan
from tests.helpers import CLI_EXAMPLES, CLI_RESNET32, cli_apply, cli_file


SMALL = ["--batch-size", "8"]


TINY = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def example_inputs():
    return torch.randn(2, 8)  # a single tensor is accepted
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 4-stage ResNet-32 plan written by ``--yaml``."""
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    assert main([CLI_RESNET32, "--gpus", "4", *SMALL, "--yaml", str(path)]) == 0
    return path


def _scaled_costs(saved: Path, tmp_path: Path) -> Path:
    """``saved`` with every stage's costs times 1000, as if measured on a much slower machine."""
    d = yaml.safe_load(saved.read_text())
    for s in d["stages"]:
        for key in ("compute_cost", "comm_cost", "cost"):
            s[key] *= 1000
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name,policy", [("vit_small", "vit"), ("resnet50", "auto")])
def test_examples_plan(capsys, name, policy):
    assert main([str(CLI_EXAMPLES / f"{name}.py"), "--gpus", "4", "--batch-size", "2", "--policy", policy,
                 "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["stages"]) == 4 and d["batch_size"] == 2


def test_the_tracer_flag_reaches_the_capture(capsys):
    assert main([CLI_RESNET32, *SMALL, "--gpus", "2", "--tracer", "export", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["notes"][0] == "captured with torch.export"


def test_saved_plan_reapplies_unchanged(saved, capsys):
    original = yaml.safe_load(saved.read_text())
    d = cli_apply(capsys, saved)
    assert [s["nodes"] for s in d["stages"]] == [s["nodes"] for s in original["stages"]]
    assert d["batch_size"] == 8
    assert Plan.from_dict(d) == Plan.load(saved)  # shown as saved: its partitioner and costs too


def test_remeasure_or_a_planning_flag_measures_a_saved_plan_again(saved, tmp_path, capsys):
    slow = _scaled_costs(saved, tmp_path)
    costs = [s.cost for s in Plan.load(slow).stages]
    fresh = [s.cost for s in Plan.load(saved).stages]
    assert [cli_apply(capsys, slow)["stages"][i]["cost"] for i in range(4)] == costs
    for extra in (["--remeasure"], ["--optimizer", "sgd"]):
        assert main([CLI_RESNET32, "--plan", str(slow), *extra, "--json", "-"]) == 0
        out, err = capsys.readouterr()
        assert [s["cost"] for s in json.loads(out)["stages"]] == fresh
        assert "costs as saved" not in err


def test_an_edited_plan_is_measured_afresh_and_says_why(saved, tmp_path, capsys):
    d = yaml.safe_load(saved.read_text())
    d["stages"][0]["head"]["config"]["width"] = 4
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(d))
    assert main([CLI_RESNET32, "--plan", str(edited), "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stages"][0]["aux_flops"] < d["stages"][0]["aux_flops"]
    assert (f"ppll-plan: {edited} was edited (it differs from what re-applying it gives in stages[0].head), so its "
            f"costs are measured afresh") in err.splitlines()
    d = yaml.safe_load(saved.read_text())
    d["stages"][0]["last_node"] = d["legal_cuts"][d["legal_cuts"].index(d["stages"][0]["last_node"]) + 1]
    edited.write_text(yaml.safe_dump(d))
    assert main([CLI_RESNET32, "--plan", str(edited), "--json", "-"]) == 0
    assert (f"ppll-plan: {edited} was edited (stage 0: first_node/last_node must be the first/last of its nodes), "
            f"so its costs are measured afresh") in capsys.readouterr().err.splitlines()


def test_plan_with_edited_device_and_head(saved, tmp_path, capsys):
    d = yaml.safe_load(saved.read_text())
    d["stages"][1]["device"] = "cuda:7"
    d["stages"][0]["head"]["config"]["width"] = 4  # narrower than the boundary tensor's channels
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(d))
    new = cli_apply(capsys, edited)
    # cuda:7 is used where it exists, else every stage falls back to the CPU with a note naming it
    assert new["stages"][1]["device"] == "cuda:7" or any("cuda:7" in n for n in new["notes"])
    assert new["stages"][0]["head"]["config"]["width"] == 4
    assert new["stages"][0]["aux_flops"] < d["stages"][0]["aux_flops"]


def test_graph_detail_chooses_the_boxes(tmp_path, capsys):
    graph = tmp_path / "graph.svg"
    assert main([CLI_RESNET32, "--gpus", "2", *SMALL, "--graph", str(graph)]) == 0
    assert f"wrote {graph} (the traced graph by stage: 23 boxes grouping 130 nodes by module)" in \
        capsys.readouterr().err
    assert main([CLI_RESNET32, "--gpus", "2", *SMALL, "--graph", str(graph), "--graph-detail", "nodes"]) == 0
    assert f"wrote {graph} (the traced graph by stage: a box per node, 130)" in capsys.readouterr().err
    model = cli_file(tmp_path, TINY)
    assert main([model, "--gpus", "2", "--graph", str(graph), "--graph-detail", "modules"]) == 0
    assert f"wrote {graph} (the traced graph by stage: 7 boxes grouping 7 nodes by module)" in \
        capsys.readouterr().err

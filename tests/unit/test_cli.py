"""The ppll-plan command: flags, model files, outputs, plan round trips and the errors it reports."""

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from models import Residual, conv_student, conv_teacher
from torch import nn

import ppll_compile
from ppll_compile import Plan
from ppll_compile.cli.command import _options, _parser, main
from ppll_compile.cli.arguments import _parse_size
from tests.helpers import CLI_EXAMPLES, CLI_RESNET32, cli_apply, cli_file

X = torch.randn(4, 3, 16, 16)

SMALL = ["--batch-size", "8"]

TINY = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def example_inputs():
    return torch.randn(2, 8)  # a single tensor is accepted
"""


def _stage_rows(table: str) -> list[str]:
    """The rows between the table's ``-----`` rule and its ``bottleneck`` totals line."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("bottleneck"))
    assert all(re.match(r"^\d+\*?\s", line) for line in lines[start:end])
    return lines[start:end]


def _expect_exit_2(capsys, argv: list[str], *needles: str) -> str:
    """Run ``argv``, expect exit status 2 and every needle in stderr; return stderr."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 4-stage ResNet-32 plan written by ``--yaml``."""
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    assert main([CLI_RESNET32, "--gpus", "4", *SMALL, "--yaml", str(path)]) == 0
    return path


# ---- outputs -----------------------------------------------------------------------------

def test_show_prints_the_stage_table(capsys):
    assert main([CLI_RESNET32, "--gpus", "4", "--show"]) == 0
    out, err = capsys.readouterr()
    assert len(_stage_rows(out)) == 4
    assert "bottleneck" in out and "imbalance" in out
    assert "ResNet32" in out and "batch 64" in out
    # the CPU-fallback warning (if any) appears once: as a note in the table, not again on stderr
    assert (out + err).count("cannot be used") <= 1


def test_table_is_the_default_output(capsys):
    assert main([CLI_RESNET32, "--gpus", "2", *SMALL]) == 0
    out, _ = capsys.readouterr()
    assert len(_stage_rows(out)) == 2 and "imbalance" in out


def test_json_to_stdout_is_one_pure_document(capsys):
    assert main([CLI_RESNET32, "--gpus", "4", *SMALL, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert len(d["stages"]) == 4
    assert d["totals"]["imbalance"] == Plan.from_dict(d).imbalance
    assert d["batch_size"] == 8
    assert err.count("cannot be used") <= 1


def test_json_stdout_with_show_sends_the_table_to_stderr(capsys):
    assert main([CLI_RESNET32, "--gpus", "3", *SMALL, "--json", "-", "--show"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["stages"]) == 3
    assert len(_stage_rows(err)) == 3 and "imbalance" in err


def test_outputs_combine(tmp_path, capsys):
    j, y = tmp_path / "p.out", tmp_path / "p.yaml"
    assert main([CLI_RESNET32, "--gpus", "2", *SMALL, "--show", "--json", str(j), "--yaml", str(y)]) == 0
    out, err = capsys.readouterr()
    assert len(_stage_rows(out)) == 2
    assert f"wrote {y}" in err
    # --json writes JSON whatever the suffix; both files describe the same plan
    assert Plan.from_json(j.read_text()).to_dict() == Plan.from_yaml(y.read_text()).to_dict()


def test_flags_reach_the_plan(capsys):
    argv = [CLI_RESNET32, "--devices", "cpu,cpu", *SMALL, "--optimizer", "adam", "--partitioner", "uniform",
            "--device-speeds", "1,0.5", "--link-bandwidth", "1e9", "--flops-per-second", "2e12",
            "--memory-limit", "4GiB", "--json", "-"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["optimizer"], d["partitioner"], d["device_speeds"]) == ("adam", "uniform", [1.0, 0.5])
    assert (d["link_bandwidth"], d["flops_per_second"], d["memory_limit"]) == (1e9, 2e12, 4 * 2**30)
    assert [s["device"] for s in d["stages"]] == ["cpu", "cpu"]


def test_split_points_cut_by_hand(capsys):
    assert main([CLI_RESNET32, *SMALL, "--split-points", "layer1,layer2", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["partitioner"] == "manual"
    assert [s["last_module"].split(".")[0] for s in d["stages"]] == ["layer1", "layer2", "fc"]
    assert [s["first_module"].split(".")[0] for s in d["stages"][1:]] == ["layer2", "layer3"]


def test_options_map_flags_one_to_one():
    args = _parser().parse_args(["m.py", "--gpus", "2", "--devices", "cuda:0, cuda:1", "--device-speeds", "1,0.5",
                                 "--memory-limit", "1.5G", "--split-points", "a,b", "--profile", "time"])
    assert _options(args) == {"gpus": 2, "devices": ("cuda:0", "cuda:1"), "device_speeds": (1.0, 0.5),
                              "memory_limit": int(1.5 * 2**30), "split_points": ("a", "b"), "profile": "time"}
    args = _parser().parse_args(["m.py", "--tracer", "export", "--tied", "untie", "--bake-train-mode"])
    assert _options(args) == {"tracer": "export", "tied": "untie", "bake_train_mode": True}


def test_help_returns_zero(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: ppll-plan" in out and "examples:" in out and "--memory-limit" in out


# ---- model files -------------------------------------------------------------------------

def test_module_level_model_and_sibling_imports(tmp_path, capsys):
    cli_file(tmp_path, "import torch.nn as nn\nclass Net(nn.Sequential):\n    pass\n", "tiny_layers_cli.py")
    path = cli_file(tmp_path, """
        import torch
        from torch import nn
        from tiny_layers_cli import Net  # a sibling module: the file's directory is on sys.path while loading

        model = Net(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        example_inputs = (torch.randn(4, 8),)
    """)
    path_before = list(sys.path)
    assert main([path, "--gpus", "2", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["model"], d["num_classes"], d["batch_size"], len(d["stages"])) == ("Net", 3, 4, 2)
    assert sys.path == path_before


def test_missing_example_inputs_are_inferred(tmp_path, capsys):
    path = cli_file(tmp_path, "from torch import nn\n\ndef build_model():\n"
                           "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n")
    assert main([path, "--gpus", "2", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"][0]["shape"][1:] == [8]


def test_uninferable_example_inputs(tmp_path, capsys):
    path = cli_file(tmp_path, "from torch import nn\n\ndef build_model():\n"
                           "    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten(), nn.LazyLinear(4))\n")
    _expect_exit_2(capsys, [path, "--gpus", "2"], "cannot infer an input shape")


def test_missing_model_file(tmp_path, capsys):
    _expect_exit_2(capsys, [str(tmp_path / "nope.py"), "--gpus", "2"], "ppll-plan: error:", "nope.py", "does not exist")


def test_model_file_that_raises(tmp_path, capsys):
    path = cli_file(tmp_path, "x = 1\nraise RuntimeError('boom at import')\n", "broken.py")
    _expect_exit_2(capsys, [path, "--gpus", "2"], "ppll-plan: error:", "broken.py", "RuntimeError: boom at import")
    assert not [m for m in sys.modules if m.endswith("_broken")]


def test_build_model_that_raises(tmp_path, capsys):
    path = cli_file(tmp_path, "def build_model():\n    return 1 / 0\n")
    _expect_exit_2(capsys, [path, "--gpus", "2"], "build_model()", "ZeroDivisionError")


def test_model_file_without_a_model(tmp_path, capsys):
    path = cli_file(tmp_path, "x = 1\n")
    _expect_exit_2(capsys, [path, "--gpus", "2"],
                   "defines neither build_model() nor model; define build_model() returning")


def test_model_that_is_not_a_module(tmp_path, capsys):
    path = cli_file(tmp_path, "def build_model():\n    return 'resnet'\n")
    _expect_exit_2(capsys, [path, "--gpus", "2"], "str", "expected an nn.Module")


def test_example_inputs_of_the_wrong_type(tmp_path, capsys):
    path = cli_file(tmp_path, TINY.replace("return torch.randn(2, 8)", "return {'x': torch.randn(2, 8)}"))
    _expect_exit_2(capsys, [path, "--gpus", "2"], "example_inputs is a dict", "tuple of tensors")


# ---- bad flags and infeasible requests ---------------------------------------------------

@pytest.mark.parametrize("value", ["0", "abc", "-3"])
def test_bad_gpus(tmp_path, capsys, value):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", value], "--gpus", "positive integer")


def test_bad_memory_limit(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "2", "--memory-limit", "12XB"], "--memory-limit",
                   "12XB",
           "GiB", "GB")


def test_bad_choice(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "2", "--optimizer", "lion"], "invalid choice", "adam")


def test_unknown_partitioner(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "2", "--partitioner", "foo"],
                   "unknown partitioner 'foo'",
           "known partitioners", "exact")


def test_too_many_gpus(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "500"], "ppll-plan: error:", "at most")


def test_memory_limit_too_small(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "2", "--memory-limit", "1KiB"], "smallest limit")


def test_devices_and_gpus_disagree(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "3", "--devices", "cpu,cpu"], "devices", "--gpus 3")


def test_both_outputs_to_stdout(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "2", "--json", "-", "--yaml", "-"], "stdout")


def test_unwritable_output(tmp_path, capsys):
    _expect_exit_2(capsys, [cli_file(tmp_path, TINY), "--gpus", "2", "--yaml", str(tmp_path / "no" / "dir" / "p.yaml")],
           "cannot write")


def test_illegal_split_point(capsys):
    _expect_exit_2(capsys, [CLI_RESNET32, *SMALL, "--split-points", "layer1.0.conv2"], "nearest legal cuts")


# ---- --yaml then --plan ------------------------------------------------------------------


def _capture_pictures(monkeypatch) -> dict:
    """Record the plan the --plot and --graph pictures are drawn from (and draw nothing)."""
    import ppll_compile.draw as draw
    from ppll_compile.draw.graph import GraphPicture, describe_graph
    drawn: dict = {}
    monkeypatch.setattr(draw, "plot_costs", lambda plan, path: drawn.setdefault("plot", plan))

    def graph(source, path, **kw):
        drawn["graph"] = source[1]
        return GraphPicture(path=Path(path), engine="none", description=describe_graph(*source, **kw))
    monkeypatch.setattr(draw, "draw_graph", graph)
    return drawn


BENCHMARK_PLAN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "plan-resnet32-2.json"


def test_a_measured_plan_is_shown_and_drawn_with_its_saved_costs(tmp_path, capsys, monkeypatch):
    drawn = _capture_pictures(monkeypatch)
    saved = Plan.load(BENCHMARK_PLAN)
    assert saved.profile == "roofline"  # measured on the machine that saved it, not re-measured here
    argv = [CLI_RESNET32, "--plan", str(BENCHMARK_PLAN), "--show", "--plot", str(tmp_path / "cost.png"),
            "--graph", str(tmp_path / "graph.svg"), "--json", str(tmp_path / "shown.json")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert Plan.load(tmp_path / "shown.json") == saved
    assert drawn["plot"] == saved and drawn["graph"] == saved
    assert _stage_rows(out) == _stage_rows(saved.table())  # the file's times, not a new timing
    assert (f"ppll-plan: costs as saved in {BENCHMARK_PLAN} (roofline profile); --remeasure measures them on this "
            f"machine") in err.splitlines()


def test_remeasure_and_graph_detail_need_their_flags(tmp_path, capsys):
    model = cli_file(tmp_path, TINY)
    _expect_exit_2(capsys, [model, "--remeasure"], "ppll-plan: error: --remeasure measures a saved plan's costs "
                   "again; add --plan PLAN.yaml (without --plan every plan is measured)")
    _expect_exit_2(capsys, [model, "--graph-detail", "nodes"], "ppll-plan: error: --graph-detail chooses what the "
                   "--graph picture shows; add --graph PATH.svg")
    _expect_exit_2(capsys, [model, "--graph", "g.svg", "--graph-detail", "all"], "invalid choice: 'all'")


def test_plan_with_a_moved_cut(saved, tmp_path, capsys):
    d = yaml.safe_load(saved.read_text())
    old_cut = d["stages"][0]["last_node"]
    new_cut = d["legal_cuts"][d["legal_cuts"].index(old_cut) + 1]
    d["stages"][0]["last_node"] = new_cut  # the only field to edit: nodes and costs are derived afresh
    edited = tmp_path / "moved.yaml"
    edited.write_text(yaml.safe_dump(d))
    new = cli_apply(capsys, edited)
    assert new["stages"][0]["last_node"] == new_cut
    assert new_cut in new["stages"][0]["nodes"] and new_cut not in new["stages"][1]["nodes"]
    assert len(new["stages"][0]["nodes"]) > len(d["stages"][0]["nodes"])
    assert [s["last_node"] for s in new["stages"][1:]] == [s["last_node"] for s in d["stages"][1:]]


def test_plan_with_an_illegal_cut(saved, tmp_path, capsys):
    d = yaml.safe_load(saved.read_text())
    illegal = d["stages"][0]["nodes"][-3]  # inside a residual block
    assert illegal not in d["legal_cuts"]
    d["stages"][0]["last_node"] = illegal
    edited = tmp_path / "illegal.yaml"
    edited.write_text(yaml.safe_dump(d))
    _expect_exit_2(capsys, [CLI_RESNET32, "--plan", str(edited)], illegal, "nearest legal cuts")


def test_missing_plan_file(tmp_path, capsys):
    _expect_exit_2(capsys, [CLI_RESNET32, "--plan", str(tmp_path / "none.yaml")], "none.yaml", "does not exist")


# ---- the CPU-fallback warning ------------------------------------------------------------

def _cuda_notes(p: Plan) -> list[str]:
    """The plan's notes on CUDA devices (beside the roofline's note on the figures it used)."""
    return [n for n in p.notes if "CUDA" in n]


def _fallback(devices: list[str], stages: int, replicas: int | None = None) -> str:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placed = "the stage runs" if stages == 1 else f"all {stages} stages run"
    if replicas is not None:
        placed = placed.replace(" run", f" ({replicas} replicas) run")
    return (f"this machine has {have} CUDA device(s), so {', '.join(devices)} cannot be used; {placed} on the CPU "
            f"(pass devices=[...] to choose)")


def _warned(build) -> tuple[list[str], object]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = build()
    return [str(w.message) for w in caught if "CUDA" in str(w.message)], made


MISSING = ["cuda:60", "cuda:61", "cuda:62"]  # no machine has them


@pytest.mark.parametrize("stages", [1, 3])
def test_the_cpu_fallback_counts_the_stages(stages, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    devices = MISSING[:stages]
    messages, p = _warned(lambda: ppll_compile.plan(Residual(), devices=devices, example_inputs=(X,)))
    assert messages == [_fallback(devices, stages)] and _cuda_notes(p) == [_fallback(devices, stages)]
    assert p.devices == ("cpu",) * stages


def test_the_cpu_fallback_of_replicated_stages_counts_stages_and_replicas(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    messages, p = _warned(lambda: ppll_compile.plan(
        conv_student(), teacher=conv_teacher(), devices=MISSING, split_points=["5"], replicas=(2, 1),
        example_inputs=(torch.randn(8, 3, 16, 16),)))
    assert p.num_stages == 2 and p.world_size == 3
    assert messages == [_fallback(MISSING, 2, replicas=3)]
    assert _cuda_notes(p) == messages


def test_under_torchrun_only_the_first_process_of_a_machine_warns(monkeypatch):
    for local_rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        messages, p = _warned(lambda: ppll_compile.plan(Residual(), devices=MISSING[:2], example_inputs=(X,)))
        assert len(messages) == expected
        assert _cuda_notes(p) == [_fallback(MISSING[:2], 2)]  # every process's plan records it


# ---- sizes -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("1000000", 1_000_000), ("16GiB", 16 * 2**30), ("16GB", 16 * 10**9), ("512MiB", 512 * 2**20),
    ("1.5G", int(1.5 * 2**30)), ("4k", 4096), ("2KB", 2000), ("3kib", 3 * 1024), ("1TiB", 2**40),
    ("2tb", 2 * 10**12), ("8M", 8 * 2**20), ("100b", 100), (" 7 MB ", 7 * 10**6), ("1e9", 10**9),
])
def test_parse_size(text, expected):
    assert _parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "", "GiB", "-1G", "0", "1.5.2G", "16 GiBs"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected"):
        _parse_size(text)


# ---- examples ----------------------------------------------------------------------------

def test_resnet32_has_32_layers():
    sys.path.insert(0, str(CLI_EXAMPLES))
    try:
        import resnet32
    finally:
        sys.path.remove(str(CLI_EXAMPLES))
    model = resnet32.build_model(num_classes=100)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 32 and linears[0].out_features == 100
    assert 0.45e6 < sum(p.numel() for p in model.parameters()) < 0.5e6
    assert resnet32.example_inputs()[0].shape == (64, 3, 32, 32)


# ---- simulation and pictures ------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"


def test_simulate_prints_the_simulated_schedule(tmp_path, capsys):
    model = cli_file(tmp_path, TINY)
    assert main([model, "--gpus", "2", "--simulate", "--steps", "10", "--queue-depth", "1", "--json",
                 str(tmp_path / "p.json")]) == 0
    out, _ = capsys.readouterr()
    from ppll_compile import simulate
    expected = simulate(Plan.load(tmp_path / "p.json"), steps=10, queue_depth=1).table()
    assert out.strip() == expected.strip()


def test_pictures_are_written_and_reported(tmp_path, capsys):
    model = cli_file(tmp_path, TINY)
    cost, graph, gantt = tmp_path / "cost.png", tmp_path / "graph.png", tmp_path / "gantt.svg"
    assert main([model, "--gpus", "2", "--plot", str(cost), "--graph", str(graph), "--gantt", str(gantt)]) == 0
    _, err = capsys.readouterr()
    assert cost.read_bytes().startswith(PNG) and graph.read_bytes().startswith(PNG)
    assert b"<svg" in gantt.read_bytes()[:2000]
    assert f"wrote {cost} (cost per stage, bottleneck stage " in err
    assert f"wrote {graph} (the traced graph by stage: a box per node, 7)" in err
    assert f"wrote {gantt} (simulated timeline of 8 batches)" in err  # 4 batches per stage by default


def test_gantt_of_a_recorded_trace_needs_no_model(tmp_path, capsys):
    from ppll_compile import Event, Timeline
    events = [Event(stage=s, replica=0, batch=b, kind=k, start=t, end=t + 1.0)
              for s in range(2) for b in range(3) for k, t in (("forward", 3 * b + s), ("backward", 3 * b + s + 1))]
    trace = Timeline.of(events).save(tmp_path / "trace.json")
    out_png = tmp_path / "measured.png"
    assert main(["--gantt", str(out_png), "--trace", str(trace)]) == 0
    _, err = capsys.readouterr()
    assert out_png.read_bytes().startswith(PNG)
    assert err.strip() == f"ppll-plan: wrote {out_png} (measured timeline of 2 lanes)"


def test_picture_flags_are_checked_before_the_model_loads(tmp_path, capsys):
    missing = str(tmp_path / "absent.py")
    _expect_exit_2(capsys, [missing, "--plot", "cost.jpg"],
                   "ppll-plan: error: --plot cost.jpg: unknown picture format; use one of .png, .svg, .pdf")
    _expect_exit_2(capsys, [missing, "--trace", "t.json"],
                   "ppll-plan: error: --trace names a recorded timeline to draw; add --gantt PATH.png")
    _expect_exit_2(capsys, ["--show"], "ppll-plan: error: the MODEL.py argument is required (only --gantt PATH "
                   "--trace TRACE.json works without it)")
    _expect_exit_2(capsys, ["--gantt", "g.png", "--trace", missing.replace(".py", ".json")],
                   "does not exist; write one with trainer.timeline().save(path)")

"""Pictures of plans: cost bars that add up to the stage costs, graphs coloured by stage with the cuts, Gantt charts."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from models import Residual, conv_student, conv_teacher

import ppll_compile
from ppll_compile.draw import draw_gantt, draw_graph, plot_costs
from ppll_compile.draw.graph import MAX_NODES, describe_graph
from tests.helpers import DRAW_PNG, draw_is_png, draw_is_svg, draw_quietly, draw_timeline

X = torch.randn(4, 3, 16, 16)


@pytest.fixture(scope="module")
def residual():
    return draw_quietly(lambda: ppll_compile.compile(Residual(), 3, example_inputs=(X,), split_points=["stem", "relu"]))


@pytest.fixture(scope="module")
def pipebd():
    return draw_quietly(lambda: ppll_compile.compile(conv_student(), teacher=conv_teacher(), split_points=["5"],
                                                 example_inputs=(torch.randn(8, 3, 16, 16),), replicas=(2, 1)))


# ---- cost bars ----------------------------------------------------------------------------------------

def _bottleneck_at(plan, j):
    """The plan with stage ``j`` made the slowest by a longer send (a hand edit)."""
    extra = plan.bottleneck_cost
    stages = [dataclasses.replace(s, comm_cost=s.comm_cost + extra, cost=s.cost + extra) if s.index == j else s
              for s in plan.stages]
    return dataclasses.replace(plan, stages=tuple(stages))


@pytest.mark.parametrize("which", ["residual", "pipebd", "residual-stage-1"])
def test_cost_bars_add_up_to_the_stage_costs_and_mark_the_bottleneck(which, residual, pipebd, tmp_path):
    plan = pipebd.plan if which == "pipebd" else residual.plan
    if which == "residual-stage-1":
        plan = _bottleneck_at(plan, 1)
    bars = plot_costs(plan, tmp_path / "cost.png")
    assert draw_is_png(bars.path)
    assert len(bars.totals) == plan.num_stages
    for s, total in zip(plan.stages, bars.totals):
        assert total == pytest.approx(s.cost * 1e3, rel=1e-12, abs=0)
        assert bars.segments["communication"][s.index] == s.comm_cost * 1e3
    costs = [s.cost for s in plan.stages]
    slowest = costs.index(max(costs))
    assert costs.count(max(costs)) == 1 and (which != "residual-stage-1" or slowest == 1)
    assert bars.bottleneck == plan.bottleneck_stage == slowest
    assert bars.totals.index(max(bars.totals)) == slowest
    assert bars.labels == tuple(f"stage {s.index}" + (" x 2" if s.replicas == 2 else "") for s in plan.stages)
    assert f"K={plan.num_stages}" in bars.title and f"{plan.predicted_speedup:.2f}x" in bars.title
    assert plan.mode.upper() in bars.title and plan.model in bars.title
    head = "teacher forward" if plan.mode == "pipebd" else "aux head"
    for s in plan.stages:  # the head's share of the compute follows its FLOP share
        flops = s.flops_fwd + s.flops_bwd + s.aux_flops
        compute = sum(bars.segments[k][s.index] for k in list(bars.segments)[:3])
        assert bars.segments[head][s.index] == pytest.approx(compute * s.aux_flops / flops, rel=1e-12)


def _png_size(path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    head = path.read_bytes()[:24]
    assert head.startswith(DRAW_PNG)
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.fixture(scope="module")
def resnet32():
    """ResNet-32 in 2 stages: 130 traced nodes in one long chain."""
    spec = importlib.util.spec_from_file_location("resnet32", Path(__file__).parents[2] / "examples" / "resnet32.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return draw_quietly(lambda: ppll_compile.compile(module.build_model(), 2,
                                                 example_inputs=(torch.randn(2, 3, 32, 32),)))


def test_a_long_graph_is_drawn_as_its_module_summary_by_default(resnet32, tmp_path):
    gm, plan = resnet32.graph_module, resnet32.plan
    assert len(gm.graph.nodes) == 130 > MAX_NODES
    desc = describe_graph(gm, plan)
    assert desc.summary and desc.depth == 2 and len(desc.nodes) == 23  # conv1, bn1, relu, 15 blocks, ...
    assert [n.label for n in desc.nodes[4:6]] == ["layer1.0\n8 nodes", "layer1.1\n8 nodes"]
    assert describe_graph(gm, plan, detail="modules") == desc
    nodes = describe_graph(gm, plan, detail="nodes")
    assert not nodes.summary and len(nodes.nodes) == 130
    summary = draw_graph(resnet32, tmp_path / "summary.png", engine="matplotlib")
    every = draw_graph(resnet32, tmp_path / "nodes.png", engine="matplotlib", detail="nodes")
    assert summary.description == desc and every.description == nodes
    (w, h), (_, h_nodes) = _png_size(summary.path), _png_size(every.path)
    assert h < 2500 and h < 4 * w  # the one-column node picture is about 10,000 pixels tall
    assert h_nodes > 4 * h


# ---- gantt --------------------------------------------------------------------------------------------


def test_gantt_has_a_lane_per_replica_and_a_bar_per_event(tmp_path):
    timeline = draw_timeline()
    gantt = draw_gantt(timeline, tmp_path / "gantt.png")
    assert draw_is_png(gantt.path)
    assert gantt.lanes == ((0, 0), (1, 0), (1, 1), (2, 0)) == tuple(timeline.lanes)
    assert gantt.bars == len(timeline.events) and gantt.batches == (0, 1, 2, 3)
    assert gantt.kinds == ("receive", "forward", "backward", "allreduce", "step", "send")
    assert "Simulated" in gantt.title
    first = draw_gantt(timeline, tmp_path / "first.svg", batches=2)
    assert draw_is_svg(first.path) and first.batches == (0, 1)
    assert first.bars == sum(e.batch < 2 for e in timeline.events) and "first 2 of 4 batches" in first.title
    titled = draw_gantt(draw_timeline("measured"), tmp_path / "titled.pdf", title="ResNet-32 on 4 GPUs")
    assert titled.title == "ResNet-32 on 4 GPUs (measured)" and titled.path.read_bytes().startswith(b"%PDF")

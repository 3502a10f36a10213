"""Pictures of plans: cost bars that add up to the stage costs, graphs coloured by stage with the cuts, Gantt charts."""

import dataclasses
import re
import shutil

import pytest
import torch
from models import Masked, Residual, conv_student, conv_teacher

import ppll_compile
from ppll_compile import PPLLError
from ppll_compile.draw import draw_gantt, draw_graph, plot_costs
from ppll_compile.draw.costs import cost_bars
from ppll_compile.draw.graph import describe_graph
from ppll_compile.plans.timeline import Timeline
from tests.helpers import draw_is_png, draw_is_svg, draw_quietly, draw_timeline

X = torch.randn(4, 3, 16, 16)


@pytest.fixture(scope="module")
def residual():
    return draw_quietly(lambda: ppll_compile.compile(Residual(), 3, example_inputs=(X,), split_points=["stem", "relu"]))


@pytest.fixture(scope="module")
def masked():
    """Every block reads the mask, so the cuts after blocks 0 and 1 send (x, mask) to later stages."""
    inputs = (torch.randn(2, 5, 8), torch.ones(2, 5))
    return draw_quietly(lambda: ppll_compile.compile(Masked(depth=3), 3, example_inputs=inputs,
                                                 split_points=["blocks.0", "blocks.1"]))


@pytest.fixture(scope="module")
def replicated():
    return draw_quietly(lambda: ppll_compile.plan(conv_student(), example_inputs=(torch.randn(8, 3, 16, 16),),
                                              split_points=["5"], replicas=(2, 1), profile="flops"))


@pytest.fixture(scope="module")
def pipebd():
    return draw_quietly(lambda: ppll_compile.compile(conv_student(), teacher=conv_teacher(), split_points=["5"],
                                                 example_inputs=(torch.randn(8, 3, 16, 16),), replicas=(2, 1)))


def test_a_replicated_stage_shows_its_gradient_all_reduce(replicated, pipebd):
    p = replicated
    bars = cost_bars(p)
    s0 = p.stages[0]
    assert s0.replicas == 2 and bars.labels[0] == "stage 0 x 2"
    sync = 2 * (2 - 1) / 2 * (s0.grad_bytes + s0.head.param_count * 4) / p.link_bandwidth
    assert bars.segments["gradient all-reduce"] == (pytest.approx(sync * 1e3, rel=1e-12), 0.0)
    compute = sum(bars.segments[k][0] for k in ("backbone forward", "backbone backward", "aux head"))
    per_replica = (s0.flops_fwd + s0.flops_bwd + s0.aux_flops) / p.flops_per_second / 2
    assert compute == pytest.approx(per_replica * 1e3, rel=1e-9)  # what is left is the planner's own compute
    assert bars.segments["optimizer step"] == (0.0, 0.0)  # a FLOP profile does not cost it
    d = pipebd.plan
    distill = cost_bars(d)
    assert list(distill.segments)[:3] == ["student forward", "student backward", "teacher forward"]
    sync = 2 * (2 - 1) / 2 * d.stages[0].grad_bytes / d.link_bandwidth
    assert distill.segments["gradient all-reduce"] == (pytest.approx(sync * 1e3, rel=1e-12), 0.0)
    assert "FLOP shares" in cost_bars(dataclasses.replace(p, profile="time")).subtitle


# ---- graph --------------------------------------------------------------------------------------------

def _expected_cuts(gm, plan):
    stage_of = {n: s.index for s in plan.stages for n in s.nodes}
    return {(u.name, v.name) for u in gm.graph.nodes for v in u.users
            if u.name in stage_of and v.name in stage_of and stage_of[v.name] > stage_of[u.name]}


@pytest.mark.parametrize("which", ["residual", "masked", "pipebd"])
def test_nodes_take_their_stage_colour_and_cuts_leave_from_the_boundary(which, residual, masked, pipebd):
    compiled = {"residual": residual, "masked": masked, "pipebd": pipebd}[which]
    gm, plan = compiled.graph_module, compiled.plan
    desc = describe_graph(gm, plan)
    assert not desc.summary and [n.id for n in desc.nodes] == [n.name for n in gm.graph.nodes]
    assert len(set(desc.stage_colors)) == plan.num_stages
    box = {n.id: n for n in desc.nodes}
    for s in plan.stages:
        for name in s.nodes:
            assert box[name].stage == s.index and box[name].color == desc.stage_colors[s.index]
    ops = {n.name: n.op for n in gm.graph.nodes}
    others = [n for n in desc.nodes if n.stage is None]
    assert others and all(ops[n.id] in ("placeholder", "get_attr", "output") for n in others)
    assert all(n.color not in desc.stage_colors for n in others)
    cuts = {(e.src, e.dst) for e in desc.cut_edges}
    assert cuts == _expected_cuts(gm, plan) and cuts
    for e in desc.cut_edges:  # every cut value is one the stage sends on
        sent = plan.stages[box[e.src].stage].boundary
        if plan.mode == "ppll":
            spec = next(t for t in sent if t.name == e.src)
            assert e.label == "x".join(map(str, spec.shape))
        else:  # pipebd boundaries name the teacher's node; the shape is the same
            assert e.label == "x".join(map(str, sent[0].shape))
    if which == "masked":
        assert {(e.src, e.label) for e in desc.cut_edges} >= {("unsqueeze", "2x5x1")}


def test_large_graphs_are_summarised_by_module(tmp_path):
    inputs = (torch.randn(2, 5, 8), torch.ones(2, 5))
    compiled = draw_quietly(lambda: ppll_compile.compile(Masked(depth=6), 3, example_inputs=inputs))
    gm, plan = compiled.graph_module, compiled.plan
    names = [n.name for n in gm.graph.nodes]
    assert len(names) > 12
    desc = describe_graph(gm, plan, max_nodes=12)
    assert desc.summary and desc.depth is not None and len(desc.nodes) <= 12
    assert [m for n in desc.nodes for m in n.members] == names  # every node once, in graph order
    stage_of = {n: s.index for s in plan.stages for n in s.nodes}
    for box in desc.nodes:
        assert {stage_of[m] for m in box.members if m in stage_of} <= {box.stage}
    group = {m: n for n in desc.nodes for m in n.members}
    assert {(e.src, e.dst) for e in desc.cut_edges} == {(group[u].id, group[v].id)
                                                        for u, v in _expected_cuts(gm, plan)}
    assert len(describe_graph(gm, plan, max_nodes=len(names)).nodes) == len(names)
    with pytest.raises(ValueError, match=re.escape("max_nodes=2 is too small: even one box per stage, input and "
                                                   "output gives 5 boxes; pass max_nodes >= 5")):
        describe_graph(gm, plan, max_nodes=2)
    picture = draw_graph(compiled, tmp_path / "summary.png", max_nodes=12, engine="matplotlib")
    assert draw_is_png(picture.path) and picture.description == desc


def test_detail_modules_summarises_a_small_graph_and_bad_details_are_named(residual):
    gm, plan = residual.graph_module, residual.plan
    assert not describe_graph(gm, plan).summary
    modules = describe_graph(gm, plan, detail="modules")
    assert modules.summary and [m for n in modules.nodes for m in n.members] == [n.name for n in gm.graph.nodes]
    with pytest.raises(ValueError, match=re.escape("detail 'all' is not known; details: auto, modules, nodes")):
        describe_graph(gm, plan, detail="all")


@pytest.mark.skipif(shutil.which("dot") is None, reason="the Graphviz `dot` program is not installed")
def test_graphviz_draws_one_cluster_per_stage(residual, tmp_path):
    picture = draw_graph(residual, tmp_path / "graph.svg", engine="graphviz")
    assert picture.engine == "graphviz" and draw_is_svg(picture.path)
    assert picture.source.count("subgraph cluster_stage") == residual.plan.num_stages
    red = [line for line in picture.source.splitlines() if "->" in line and ' color="#d62728"' in line]
    assert len(red) == len(picture.description.cut_edges) == 3
    auto = draw_graph((residual.graph_module, residual.plan), tmp_path / "graph.png")
    assert auto.engine == "graphviz" and draw_is_png(auto.path)


def test_matplotlib_draws_without_graphviz(residual, tmp_path, monkeypatch):
    png = draw_graph(residual, tmp_path / "graph.png", engine="matplotlib")
    svg = draw_graph(residual, tmp_path / "graph.svg", engine="matplotlib")
    assert png.engine == svg.engine == "matplotlib" and png.source is None
    assert draw_is_png(png.path) and draw_is_svg(svg.path)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert draw_graph(residual, tmp_path / "auto.png").engine == "matplotlib"
    with pytest.raises(PPLLError, match=re.escape(
            "engine='graphviz' needs the Graphviz `dot` program, which is not on PATH; install Graphviz "
            "(`apt-get install graphviz` or `brew install graphviz`) or pass engine='matplotlib'")):
        draw_graph(residual, tmp_path / "graph.png", engine="graphviz")


def test_without_the_graphviz_package_auto_draws_with_matplotlib(residual, tmp_path, monkeypatch):
    # the graphviz package is the optional `draw` extra: `auto` does without it, `graphviz` says how to get it
    import importlib.util
    import sys
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/dot")
    monkeypatch.setitem(sys.modules, "graphviz", None)  # import graphviz raises ImportError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "graphviz" else real(name, *a))
    assert draw_graph(residual, tmp_path / "auto.png").engine == "matplotlib"
    with pytest.raises(PPLLError, match=re.escape(
            "drawing with graphviz needs the `graphviz` Python package: `pip install 'ppll-compile[draw]'` (or "
            "`pip install graphviz`), or pass engine='matplotlib'")):
        draw_graph(residual, tmp_path / "graph.png", engine="graphviz")


# ---- gantt --------------------------------------------------------------------------------------------


# ---- errors -------------------------------------------------------------------------------------------

def test_bad_suffixes_engines_and_inputs_say_what_to_do(residual, tmp_path):
    message = ("cannot write '{}': it has {}; the picture format follows the suffix, supported suffixes: "
               ".png, .svg, .pdf")
    for path, found in ((tmp_path / "cost.jpg", "suffix '.jpg'"), (tmp_path / "cost", "no suffix")):
        with pytest.raises(ValueError, match=re.escape(message.format(path, found))):
            plot_costs(residual.plan, path)
    with pytest.raises(ValueError, match=re.escape(message.format(tmp_path / "g.dot", "suffix '.dot'"))):
        draw_graph(residual, tmp_path / "g.dot")
    with pytest.raises(ValueError, match=re.escape(message.format(tmp_path / "t.html", "suffix '.html'"))):
        draw_gantt(draw_timeline(), tmp_path / "t.html")
    with pytest.raises(ValueError, match=re.escape("engine 'neato' is not known; engines: auto, graphviz, "
                                                   "matplotlib")):
        draw_graph(residual, tmp_path / "g.png", engine="neato")
    with pytest.raises(TypeError, match=re.escape("draw_graph takes a compiled pipeline (with .graph_module and "
                                                  ".plan) or a tuple (graph_module, plan), got Plan")):
        draw_graph(residual.plan, tmp_path / "g.png")
    with pytest.raises(ValueError, match=re.escape("batches must be a positive number of batches to show, got 0")):
        draw_gantt(draw_timeline(), tmp_path / "t.png", batches=0)
    with pytest.raises(ValueError, match=re.escape("the timeline has no events")):
        draw_gantt(Timeline.of([]), tmp_path / "t.png")
    assert not list(tmp_path.iterdir())

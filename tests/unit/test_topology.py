"""Topology: stages on nodes of ``gpus_per_node`` devices, each boundary and all-reduce priced at the link it
crosses, in the solvers (exact, against brute force), the plan, its file and table, the simulator and the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
from models import conv_student, conv_teacher
from ppll_compile.partitioners import Problem, bottleneck, brute_force, solve, stage_costs
from ppll_compile.partitioners.objective import Links
from ppll_compile.partitioners.replicas import ReplicaProblem, brute_force_replicated, layout_costs, solve_replicated
from torch import nn

import ppll_compile
from ppll_compile import Plan, PlanError
from ppll_compile.cli.command import main
from ppll_compile.options import PlanOptions

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

X = torch.randn(8, 16)
SLOW = 1e3
"""Bytes per second across nodes in the plan tests: a boundary of 256 floats per sample takes 8 s, of 4 0.13 s."""


def _narrow() -> nn.Sequential:
    """An MLP whose only 4-wide boundary (after its first layer and that layer's ReLU) is by far its smallest."""
    torch.manual_seed(0)
    widths = [16, 256, 256, 256, 4, 256, 256, 256]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def _plan(gpus: int = 4, **options) -> Plan:
    return ppll_compile.plan(_narrow(), gpus, example_inputs=(X,), profile="flops", devices=["cpu"] * gpus,
                             policy="dgl", **options)


def test_links_place_consecutive_devices_on_nodes() -> None:
    links = Links(gpus_per_node=4, intra=100.0, inter=10.0)
    assert [links.crosses(d, 1) for d in range(8)] == [False, False, False, True, False, False, False, True]
    assert [links.crosses(first, 2) for first in range(6)] == [False, False, True, False, False, False]
    assert [links.spans(first, 2) for first in range(6)] == [False, False, False, True, False, False]
    assert [links.allreduce_bandwidth(first, 3) for first in range(5)] == [100.0, 100.0, 10.0, 10.0, 100.0]
    assert links.across([1.0, 0.5, 0.0]) == [10.0, 5.0, 0.0]
    assert Links.firsts([2, 1, 3]) == [0, 2, 3]
    one_node = Links(intra=100.0, inter=10.0)
    assert (one_node.crosses(3, 1), one_node.spans(0, 8), one_node.allreduce_bandwidth(0, 8)) == (False, False, 100.0)
    assert one_node.across([1.0]) is None
    assert links.crosses(torch.arange(4).numpy(), 1).tolist() == [False, False, False, True]


# compute and boundary sizes of six segments: four stages on two nodes of two cross nodes after stage 1
COMPUTE = [1, 3, 1, 2, 2, 3]
BOUNDARY = [8, 1, 8, 4, 4, 0]


def test_a_slow_inter_node_link_crosses_at_the_smallest_boundary() -> None:
    plain = Problem(compute=COMPUTE, comm=[b / 4 for b in BOUNDARY])
    on_nodes = dataclasses.replace(plain, cross_comm=[b * 2 for b in BOUNDARY], gpus_per_node=2)
    assert solve(plain, 4) == brute_force(plain, 4) == (2, 4, 5, 6)  # one node: stage 1 ends at a 4-byte boundary
    assert bottleneck(plain, (2, 4, 5, 6)) == 4.25
    every = [(*cuts, 6) for cuts in ((a, b, c) for a in range(1, 6) for b in range(a + 1, 6) for c in range(b + 1, 6))]
    costs = sorted((bottleneck(on_nodes, ends), ends) for ends in every)
    assert costs[0] == (5.0, (1, 2, 4, 6)) and costs[1][0] == 6.0  # the unique optimum on nodes
    assert solve(on_nodes, 4) == brute_force(on_nodes, 4) == (1, 2, 4, 6)  # crosses at the 1-byte boundary
    assert stage_costs(on_nodes, (1, 2, 4, 6)) == [1 + 8 / 4, 3 + 1 * 2, 1 + 2 + 4 / 4, 5]
    replicated = ReplicaProblem(compute=COMPUTE, comm=[b / 4 for b in BOUNDARY], cross_comm=[b * 2 for b in BOUNDARY],
                                gpus_per_node=2, devices=4, max_replicas=1, stages=4)
    assert solve_replicated(replicated).ends == brute_force_replicated(replicated).ends == (1, 2, 4, 6)


def test_replicas_all_reduce_over_the_links_they_span() -> None:
    problem = ReplicaProblem(compute=[8.0, 8.0], grad_bytes=[4.0, 4.0], comm=[2.0, 0.0], cross_comm=[6.0, 0.0],
                             allreduce_bandwidth=4.0, inter_node_bandwidth=1.0, gpus_per_node=2, devices=4)
    # devices 0-1 | 2-3: the all-reduce inside a node, the send across (device 1 -> 2)
    assert layout_costs(problem, (1, 2), (2, 2)) == [8 / 2 + 2 * 1 / 2 * 4 / 4 + 6 / 2, 8 / 2 + 2 * 1 / 2 * 4 / 4]
    # device 0 | 1-3: the send inside node 0, the all-reduce over both nodes
    assert layout_costs(problem, (1, 2), (1, 3)) == [8 + 2.0, 8 / 3 + 2 * 2 / 3 * 4 / 1]
    # 0-2 | 3: the all-reduce over both nodes, the send inside node 1
    assert layout_costs(problem, (1, 2), (3, 1)) == [8 / 3 + 2 * 2 / 3 * 4 / 1 + 2 / 3, 8.0]
    one_node = dataclasses.replace(problem, gpus_per_node=None)
    assert layout_costs(one_node, (1, 2), (1, 3)) == [10.0, 8 / 3 + 2 * 2 / 3 * 4 / 4]
    # (2, 1) on 3 devices is as fast (8.0), but a plan fills whole nodes when one can: the 4th device is used
    assert (solve_replicated(problem).replicas, solve_replicated(problem).bottleneck) == ((2, 2), 8.0)
    assert (brute_force_replicated(problem).replicas, brute_force_replicated(problem).bottleneck) == ((2, 2), 8.0)
    assert (solve_replicated(one_node).replicas, solve_replicated(one_node).bottleneck) == ((2, 2), 6.0)  # buys nothing


def test_gpus_must_fill_whole_nodes() -> None:
    message = ("gpus=6 is not a multiple of gpus_per_node=4: the devices must fill whole nodes; plan for 4 or 8 "
               "devices, or set gpus_per_node to the devices each node gives the pipeline")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        PlanOptions(gpus=6, gpus_per_node=4)
    with pytest.raises(ValueError, match=re.escape("gpus=3 is not a multiple of gpus_per_node=2: the devices must "
                                                   "fill whole nodes; plan for 2 or 4 devices")):
        ppll_compile.plan(_narrow(), example_inputs=(X,), profile="flops", replicas=(1, 2), gpus_per_node=2)
    with pytest.raises(ValueError, match=re.escape("gpus=2 is not a multiple of gpus_per_node=8: the devices must "
                                                   "fill whole nodes; plan for 8 devices")):
        _plan(2, gpus_per_node=8)
    with pytest.raises(ValueError, match=re.escape("inter_node_bandwidth=1000.0 prices links across nodes, but "
                                                   "gpus_per_node is not given (one node); set gpus_per_node=N or "
                                                   "drop inter_node_bandwidth")):
        PlanOptions(inter_node_bandwidth=SLOW)


def test_links_default_to_the_link_bandwidth() -> None:
    assert PlanOptions().links() == Links(gpus_per_node=None, intra=25e9, inter=25e9)
    assert PlanOptions(gpus_per_node=8, link_bandwidth=1e9).links() == Links(gpus_per_node=8, intra=1e9, inter=1e9)
    assert PlanOptions(gpus_per_node=8, intra_node_bandwidth=4e11, inter_node_bandwidth=5e10).links() \
        == Links(gpus_per_node=8, intra=4e11, inter=5e10)


def test_a_plan_on_nodes_crosses_at_the_narrow_layer_and_says_so() -> None:
    plain = _plan()
    plan = _plan(gpus_per_node=2, intra_node_bandwidth=1e12, inter_node_bandwidth=SLOW)
    assert [s.crosses_nodes for s in plan.stages] == [False, True, False, False]
    assert plan.stages[1].boundary[0].shape == (8, 4)  # the 4-wide boundary goes across nodes
    assert plain.stages[1].boundary[0].shape != (8, 4)  # which the plan on one node does not choose
    assert plan.stages[1].comm_cost == 8 * 4 * 4 / SLOW and plan.stages[2].comm_cost == 8 * 256 * 4 / 1e12
    assert (plan.gpus_per_node, plan.intra_node_bandwidth, plan.inter_node_bandwidth) == (2, 1e12, SLOW)
    table = plan.table()
    lines = table.splitlines()
    assert lines[0].startswith("PPLL plan for Sequential: 4 stages on 4 devices (2 nodes of 2), batch 8")
    assert lines[1].split() == ["stage", "device", "first", "last", "nodes", "params", "fwd", "bwd", "aux", "memory",
                                "boundary", "link", "head", "cost", "ms"]
    assert [line.split()[12] for line in lines[3:7]] == ["intra", "node", "intra", "-"]  # after "1.1 MiB" "8x4"
    assert "931.3 GiB/s links inside nodes, 1000 B/s across, optimizer sgd" in table
    assert "link" not in plain.table().splitlines()[1] and "GiB/s links, optimizer" in plain.table()


def test_the_topology_round_trips_and_old_plans_still_load(tmp_path) -> None:
    plan = _plan(gpus_per_node=2, inter_node_bandwidth=SLOW)
    for suffix in (".json", ".yaml"):
        again = Plan.load(plan.save(tmp_path / f"plan{suffix}"))
        assert again == plan and again.table() == plan.table()
    d = plan.to_dict()
    assert (d["gpus_per_node"], d["intra_node_bandwidth"], d["inter_node_bandwidth"]) == (2, 25e9, SLOW)
    assert [s["crosses_nodes"] for s in d["stages"]] == [False, True, False, False]
    plain = _plan().to_dict()  # one node: the file is as it was before nodes existed
    assert not {"gpus_per_node", "intra_node_bandwidth", "inter_node_bandwidth"} & set(plain)
    assert all("crosses_nodes" not in s for s in plain["stages"])
    assert Plan.from_dict(json.loads(json.dumps(plain))) == _plan()
    d["stages"][1]["crosses_nodes"] = False
    with pytest.raises(PlanError, match=re.escape("stage 1: crosses_nodes is False but its last device and the next "
                                                  "stage's first sit on two nodes (gpus_per_node=2); set "
                                                  "crosses_nodes: true")):
        Plan.from_dict(d)
    replanned = ppll_compile.plan(_narrow(), example_inputs=(X,), plan=tmp_path / "plan.yaml")
    assert (replanned.gpus_per_node, replanned.inter_node_bandwidth) == (2, SLOW) and replanned.cuts == plan.cuts


def test_the_simulator_sends_over_each_stages_own_link() -> None:
    plan = _plan(gpus_per_node=2, intra_node_bandwidth=1e12, inter_node_bandwidth=SLOW)
    sim = ppll_compile.simulate(plan, steps=4)
    sends = {(e.stage, e.end - e.start) for e in sim.timeline.events if e.kind == "send"}
    assert {j for j, _ in sends} == {0, 1, 2}
    assert {round(t, 12) for j, t in sends if j == 1} == {round(8 * 4 * 4 / SLOW, 12)}  # across nodes
    assert min(t for j, t in sends if j == 2) == pytest.approx(8 * 256 * 4 / 1e12, rel=1e-6)  # inside a node
    fast = ppll_compile.simulate(plan, steps=4, link_bandwidth=1e12)  # one bandwidth for every link, as asked
    assert {round(e.end - e.start, 15) for e in fast.timeline.events if e.kind == "send" and e.stage == 1} \
        == {round(8 * 4 * 4 / 1e12, 15)}


def test_ppll_plan_flags(tmp_path, capsys) -> None:
    model = tmp_path / "model.py"
    model.write_text("import torch\nfrom torch import nn\n\ndef build_model():\n"
                     "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), "
                     "nn.Linear(16, 4))\n\ndef example_inputs():\n    return torch.randn(2, 8)\n")
    out = tmp_path / "plan.json"
    argv = [str(model), "--gpus", "4", "--profile", "flops", "--devices", "cpu,cpu,cpu,cpu", "--gpus-per-node", "2",
            "--intra-node-bandwidth", "4e11", "--inter-node-bandwidth", "5e10", "--json", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(argv) == 0
    plan = Plan.load(out)
    assert (plan.gpus_per_node, plan.intra_node_bandwidth, plan.inter_node_bandwidth) == (2, 4e11, 5e10)
    assert [s.crosses_nodes for s in plan.stages] == [False, True, False, False]
    capsys.readouterr()
    assert main([*argv[:2], "3", *argv[3:9], "--json", str(out)]) == 2
    assert "--gpus 3 is not a multiple of --gpus-per-node 2: the devices must fill whole nodes" in capsys.readouterr().err


def test_distillation_replicas_stay_inside_a_node_when_the_link_across_is_slow() -> None:
    x = torch.randn(8, 3, 16, 16)

    def layout(inter: float) -> list[tuple[int, bool, tuple[int, ...]]]:
        plan = ppll_compile.plan(conv_student(), 4, teacher=conv_teacher(), example_inputs=(x,), profile="flops",
                                 gpus_per_node=2, link_bandwidth=1e12, inter_node_bandwidth=inter)
        first = 0
        for s in plan.stages:  # each stage's all-reduce at the link its replicas span
            bandwidth = 1e12 if first // 2 == (first + s.replicas - 1) // 2 else inter
            assert plan.allreduce_cost(s) == 2 * (s.replicas - 1) / s.replicas * s.grad_bytes / bandwidth
            first += s.replicas
        return [(s.replicas, s.crosses_nodes, s.blocks) for s in plan.stages]

    assert layout(1e12) == [(4, False, (0, 1, 2, 3))]  # one stage on both nodes
    assert layout(1e3) == [(2, False, (0, 1, 2, 3))]  # its all-reduce would cross nodes: one node's devices

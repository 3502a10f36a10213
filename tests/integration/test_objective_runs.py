"""The stage-cost objective is defined once: the numbers a plan reports are the solver's objective for the layout it
chose, to the last bit, and an infeasible memory cap reports the smallest cap that works."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
import re

import pytest
import torch
from ppll_compile.partitioners.problem import format_bytes
from ppll_compile.partitioners.replicas import brute_force_replicated, layout_costs, solve_replicated
from torch import nn

import ppll_compile
from ppll_compile import api, partitioners
from ppll_compile.errors import InfeasibleMemoryError, PartitionError, PPLLError

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _mlp(rng: random.Random, depth: int = 6) -> nn.Sequential:
    widths = [rng.choice([8, 16, 24, 48]) for _ in range(depth)]
    layers: list[nn.Module] = [nn.Linear(12, widths[0]), nn.ReLU()]
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 5))


def _plan(model: nn.Module, gpus: int, **options) -> ppll_compile.Plan:
    return ppll_compile.plan(model, gpus, example_inputs=(torch.randn(8, 12),), profile="flops",
                             devices=["cpu"] * gpus, policy="dgl", **options)


def _spied(monkeypatch: pytest.MonkeyPatch, rng: random.Random) -> list[tuple]:
    """Record what the partitioner is given and what it chooses; the segments' seconds are drawn at random (their
    memory and gradient bytes stay the model's, which the plan's own figures are checked against)."""
    seen: list[tuple] = []
    segment_costs, ppll_layout = api.segment_costs, api.ppll_layout

    def random_costs(*args, **kwargs):
        costs, figures, notes = segment_costs(*args, **kwargs)
        n = len(costs.compute)
        compute = [rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, 0.1, 1.25]) * 1e-3 for _ in range(n)]
        start = [0.0] + [rng.choice([0.0, 0.5, 1.0]) * c for c in compute[1:]]
        head = [rng.choice([0.0, 0.25, 1.0]) * 1e-3 if i < n - 1 else 0.0 for i in range(n)]
        comm = [rng.choice([0.0, 0.3, 1.0]) * 1e-3 if i < n - 1 else 0.0 for i in range(n)]
        return dataclasses.replace(costs, compute=compute, start=start, head=head, comm=comm, step=None,
                                   head_step=None), figures, notes

    def spy(costs, request, opts):
        layout = ppll_layout(costs, request, opts)
        seen.append((costs, request, opts, layout))
        return layout

    monkeypatch.setattr(api, "segment_costs", random_costs)
    monkeypatch.setattr(api, "ppll_layout", spy)
    return seen


@pytest.mark.parametrize("seed", range(8))
def test_the_plans_costs_are_the_exact_solvers_objective(monkeypatch, seed):
    rng = random.Random(seed)
    model = _mlp(rng)
    seen = _spied(monkeypatch, rng)
    gpus = rng.choice([2, 3, 4])
    speeds = [rng.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(gpus)]
    with pytest.raises(InfeasibleMemoryError) as info:
        _plan(model, gpus, device_speeds=speeds, memory_limit=1)
    limit = int(info.value.min_limit * rng.choice([1.0, 1.0, 1.3, 2.0]))  # at the smallest cap, or above it
    seen.clear()
    plan = _plan(model, gpus, device_speeds=speeds, memory_limit=limit)
    (costs, request, opts, layout), = seen
    problem = costs.problem(request.speeds, opts.memory_limit)
    assert problem.start is not None and any(problem.start)  # costs that depend on where a stage starts
    solver = partitioners.stage_costs(problem, layout.ends)
    assert [s.cost for s in plan.stages] == solver == list(layout.costs)
    assert plan.bottleneck_cost == partitioners.bottleneck(problem, layout.ends) \
        == partitioners.bottleneck(problem, partitioners.brute_force(problem, gpus))  # the optimum, exactly
    assert [s.compute_cost + s.comm_cost for s in plan.stages] == solver


@pytest.mark.parametrize("seed", range(6))
def test_the_plans_costs_are_the_replica_solvers_objective(monkeypatch, seed):
    rng = random.Random(100 + seed)
    model = _mlp(rng)
    seen = _spied(monkeypatch, rng)
    gpus = rng.choice([2, 3, 4])
    replicas = rng.choice([True, 2])
    plan = _plan(model, gpus, replicas=replicas, link_bandwidth=rng.choice([1e6, 1e7, 1e9]))
    (costs, request, opts, layout), = seen
    problem = costs.replica_problem(opts, gpus, None if replicas is True else replicas)
    assert layout.costs == solve_replicated(problem).costs
    assert [s.cost for s in plan.stages] == list(layout.costs) == layout_costs(problem, layout.ends, layout.replicas)
    assert [s.replicas for s in plan.stages] == list(layout.replicas)
    assert plan.bottleneck_cost == brute_force_replicated(problem).bottleneck


@pytest.mark.parametrize("options", [{}, {"replicas": True}])
def test_an_infeasible_memory_cap_reports_the_smallest_that_works(options):
    rng = random.Random(7)
    model = _mlp(rng)
    with pytest.raises(ppll_compile.PartitionError) as info:
        _plan(model, 3, memory_limit=1000, **options)
    error = info.value
    assert isinstance(error, InfeasibleMemoryError) and isinstance(error, PPLLError)
    assert isinstance(error, ppll_compile.PPLLError) and PartitionError is ppll_compile.PartitionError
    assert error.min_limit > 1000 and float(error.min_limit).is_integer()
    found = re.search(r"the smallest (?:uniform )?limit that works is ([0-9.]+ \w+)", str(error))
    assert found is not None and found.group(1) == format_bytes(error.min_limit)
    plan = _plan(model, 3, memory_limit=int(error.min_limit), **options)  # the smallest cap that works works
    assert max(s.memory_bytes for s in plan.stages) <= error.min_limit
    with pytest.raises(InfeasibleMemoryError) as again:  # and one byte less does not
        _plan(model, 3, memory_limit=int(error.min_limit) - 1, **options)
    assert again.value.min_limit == error.min_limit
    copy = pickle.loads(pickle.dumps(error))  # it crosses process pipes whole
    assert (type(copy), str(copy), copy.min_limit) == (InfeasibleMemoryError, str(error), error.min_limit)
    assert not math.isinf(error.min_limit)


@pytest.mark.parametrize("seed", range(6))
def test_the_plans_costs_on_nodes_are_the_exact_solvers_objective(monkeypatch, seed):
    rng = random.Random(200 + seed)
    model = _mlp(rng)
    seen = _spied(monkeypatch, rng)
    gpus, per_node = rng.choice([(2, 1), (4, 2), (3, 3), (3, 1), (4, 4)])
    speeds = [rng.choice([0.5, 1.0, 2.0]) for _ in range(gpus)]
    plan = _plan(model, gpus, device_speeds=speeds, gpus_per_node=per_node, intra_node_bandwidth=1e9,
                 inter_node_bandwidth=rng.choice([1e7, 1e8]), link_bandwidth=1e9)
    (costs, request, opts, layout), = seen
    problem = costs.problem(request.speeds, opts.memory_limit, opts.links())
    assert problem.gpus_per_node == per_node and problem.cross_comm is not None
    solver = partitioners.stage_costs(problem, layout.ends)
    assert [s.cost for s in plan.stages] == solver == list(layout.costs)
    assert plan.bottleneck_cost == partitioners.bottleneck(problem, partitioners.brute_force(problem, gpus))
    assert [s.crosses_nodes for s in plan.stages] == [(j + 1) % per_node == 0 and j < gpus - 1 for j in range(gpus)]


@pytest.mark.parametrize("seed", range(6))
def test_the_plans_costs_on_nodes_are_the_replica_solvers_objective(monkeypatch, seed):
    rng = random.Random(300 + seed)
    model = _mlp(rng)
    seen = _spied(monkeypatch, rng)
    gpus, per_node = rng.choice([(4, 2), (4, 1), (3, 3), (6, 2), (6, 3)])
    plan = _plan(model, gpus, replicas=True, gpus_per_node=per_node, link_bandwidth=1e6,
                 inter_node_bandwidth=rng.choice([1e4, 1e5]))
    (costs, request, opts, layout), = seen
    problem = costs.replica_problem(opts, gpus, None)
    assert (problem.gpus_per_node, problem.inter_node_bandwidth) == (per_node, opts.inter_node_bandwidth)
    assert layout.costs == solve_replicated(problem).costs
    assert [s.cost for s in plan.stages] == list(layout.costs) == layout_costs(problem, layout.ends, layout.replicas)
    assert plan.bottleneck_cost == brute_force_replicated(problem).bottleneck
    assert [plan.allreduce_cost(s) for s in plan.stages] == [
        2 * (s.replicas - 1) / s.replicas * (s.grad_bytes + (0 if s.is_last else 4 * s.head.param_count))
        / (1e6 if (plan.first_device(s) // per_node == (plan.first_device(s) + s.replicas - 1) // per_node)
           else opts.inter_node_bandwidth) for s in plan.stages]

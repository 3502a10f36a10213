"""What the simulator predicts for a cluster: tokens per second of a causal LM, the bubble and its fill/drain share
against hand-computed schedules, and the memory each device holds."""

import dataclasses
import json
import random

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.plans.plan import Plan, format_bytes
from ppll_compile.simulation.simulate import Simulation, simulate
from tests.helpers import CONV_X, quiet, synthetic_plan
from tests.models import conv_student

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


@pytest.fixture(scope="module")
def mlp_plan() -> Plan:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with quiet():
        return ppll_compile.plan(model, 2, example_inputs=(torch.randn(4, 8),))


def _waits(sim: Simulation) -> float:
    return sum(s.idle + s.blocked + s.barrier for s in sim.stages)


def test_inputs_that_are_not_token_sequences_report_no_tokens(mlp_plan):
    sim = simulate(mlp_plan, steps=8)
    assert (sim.sequence_length, sim.token_throughput) == (None, None)
    assert "tokens/s" not in sim.table() and sim.to_dict()["token_throughput"] is None
    d = mlp_plan.to_dict()
    for shape, dtype in (([4, 8], "float32"), ([4], "int64"), ([4, 8, 2], "int64"), ([8, 4], "int64")):
        d["inputs"] = [{"name": "x", "shape": shape, "dtype": dtype, "bytes": 0}]
        assert simulate(Plan.from_dict(d), steps=2).sequence_length is None, (shape, dtype)
    d["inputs"] = [{"name": "x", "shape": [4, 8], "dtype": "int32", "bytes": 128}]
    assert simulate(Plan.from_dict(d), steps=2).sequence_length == 8


# ---- the bubble -----------------------------------------------------------------------------------------

def test_the_bubble_of_a_two_stage_schedule_by_hand(mlp_plan):
    # the schedule of test_simulate's two-stage test: stage 0 computes 4 x 2 and sends 4 x 1 (busy 12), is
    # blocked 3 and idle from 15 to 26; stage 1 waits 0..2 for batch 0 and computes 4 x 6 (busy 24): makespan 26
    plan = synthetic_plan(mlp_plan, [dict(compute=2.0, fwd=1, bwd=1, out=1), dict(compute=6.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=4, queue_depth=1)
    assert sim.makespan == 26
    assert [(s.fill, s.drain) for s in sim.stages] == [(0, 11), (2, 0)]
    assert sim.bubble == pytest.approx(1 - (12 + 24) / (2 * 26), abs=1e-15) == pytest.approx(16 / 52, abs=1e-15)
    assert sim.fill_drain == 13 / 52  # the rest, 3 / 52, is stage 0 blocked in steady state
    assert "  bubble 30.8% (fill/drain 25.0%)  " in sim.table().splitlines()[-1]


def test_the_bubble_of_a_barrier_schedule_by_hand(mlp_plan):
    # the schedule of test_simulate's barrier test (makespan 14, every stage ends at 14): busy 2 x (4 + 1),
    # 2 x (3 + 1 + 1) and 2 x 2; waits: stage 0 at the barrier 4, stage 1 for input 4, stage 2 at the barrier 2
    # and for input 8; fill 0, 2 and 4
    plan = synthetic_plan(mlp_plan, [dict(compute=4.0, fwd=1, head_fwd=1, bwd=2, out=1),
                                     dict(compute=3.0, fwd=1, bwd=2, grad=1, out=2, replicas=2),
                                     dict(compute=2.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=2, queue_depth=1, decoupled=False)
    assert [(s.fill, s.drain) for s in sim.stages] == [(0, 0), (2, 0), (4, 0)]
    assert sim.bubble == pytest.approx(1 - (10 + 10 + 4) / 42, abs=1e-15) == pytest.approx(3 / 7, abs=1e-15)
    assert sim.fill_drain == 6 / 42


@pytest.mark.parametrize("stages, steps", [(4, 6), (2, 1), (3, 64)])
def test_equal_stages_that_send_when_done_are_all_fill_and_drain(mlp_plan, stages, steps):
    # no FLOPs split the compute, so the output is ready when the work is: stage j starts batch 0 at j and ends
    # the last at j + steps; makespan S - 1 + n, every stage busy n: bubble (S - 1) / (S - 1 + n)
    plan = synthetic_plan(mlp_plan, [dict(compute=1.0, out=0)] * (stages - 1) + [dict(compute=1.0)])
    sim = simulate(plan, steps=steps)
    assert sim.makespan == stages - 1 + steps
    assert [(s.fill, s.drain) for s in sim.stages] == [(j, stages - 1 - j) for j in range(stages)]
    assert sim.fill_drain == (stages - 1) / (stages - 1 + steps)
    assert sim.bubble == pytest.approx(sim.fill_drain, abs=1e-15)


def test_equal_stages_that_forward_early_fill_by_their_forward_only(mlp_plan):
    # forward 1 then backward 1: stage j starts batch 0 at j (its input leaves stage j-1 after the forward) and
    # never waits after it; makespan 2 + 2 x 64, fill + drain 2 per stage
    plan = synthetic_plan(mlp_plan, [dict(compute=2.0, fwd=1, bwd=1, out=0)] * 2 + [dict(compute=2.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=64)
    assert sim.makespan == 130 and sim.fill_drain == 3 * 2 / (3 * 130)
    assert sim.bubble == pytest.approx(sim.fill_drain, abs=1e-15)


@pytest.mark.parametrize("cores", [None, 1, 2])
def test_the_bubble_is_every_wait_of_every_stage_on_random_plans(mlp_plan, cores):
    # every stage's [0, makespan] is busy (compute, all-reduce, send) or waiting (input, room, barrier)
    rng = random.Random(cores or 0)
    for _ in range(20):
        n = rng.randint(2, 5)
        specs = [dict(compute=rng.uniform(0.5, 3.0), fwd=rng.randint(0, 3), bwd=rng.randint(0, 3),
                      out=rng.randint(0, 1000), grad=rng.randint(0, 1000), replicas=rng.randint(1, 2))
                 for _ in range(n)]
        plan = synthetic_plan(mlp_plan, specs, bandwidth=1000.0)  # a plan's bytes are integers: up to a second
        sim = simulate(plan, steps=rng.randint(1, 12), queue_depth=rng.randint(1, 3),
                       decoupled=rng.random() < 0.7, cores=cores)
        area = n * sim.makespan
        for s in sim.stages:
            assert s.compute + s.allreduce + s.send + s.idle + s.blocked + s.barrier == pytest.approx(sim.makespan)
            assert 0 <= s.fill and 0 <= s.drain and s.fill + s.drain <= s.idle + 1e-9
        assert sim.bubble == pytest.approx(_waits(sim) / area, abs=1e-12)
        assert sim.fill_drain <= sim.bubble + 1e-12


# ---- memory per device ----------------------------------------------------------------------------------

def test_every_device_holds_its_stage_once_per_replica(mlp_plan):
    plan = synthetic_plan(mlp_plan, [dict(compute=1.0, out=0, replicas=2), dict(compute=1.0, out=0),
                                     dict(compute=1.0, replicas=3)])
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, memory_bytes=m)
                                                  for s, m in zip(plan.stages, (1000, 3 << 20, 2000))))
    sim = simulate(plan, steps=4)
    assert [s.memory for s in sim.stages] == [1000, 3 << 20, 2000]
    assert sim.device_memory == (1000, 1000, 3 << 20, 2000, 2000, 2000)
    assert sim.peak_memory == 3 << 20
    assert "  peak memory 3.0 MiB per device  4 steps  " in sim.table().splitlines()[-1]
    d = json.loads(json.dumps(sim.to_dict()))
    assert d["device_memory"] == [1000, 1000, 3 << 20, 2000, 2000, 2000] and d["peak_memory"] == 3 << 20
    assert [s["memory"] for s in d["stages"]] == [1000, 3 << 20, 2000]


def test_a_replicated_real_plan_holds_its_planned_stage_memory_per_device():
    with quiet():
        plan = ppll_compile.plan(conv_student(), example_inputs=(CONV_X,), split_points=["5"], replicas=(2, 1))
    sim = simulate(plan, steps=4)
    first, second = (s.memory_bytes for s in plan.stages)
    assert first > 0 and second > 0
    assert sim.device_memory == (first, first, second) and sim.peak_memory == max(first, second)
    assert f"  peak memory {format_bytes(max(first, second))} per device  " in sim.table()

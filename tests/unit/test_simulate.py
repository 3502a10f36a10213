"""The plan-time schedule simulator: hand-computed schedules (early forwarding, deferred sends, the barrier
before every step, the optimizer step), steady state, replicas, bandwidth, queue blocking, and agreement with an
independent event-driven simulation on random plans."""

import heapq
import itertools
import json
import random
import re
from collections import deque

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.plans.plan import Plan
from ppll_compile.simulation.simulate import Simulation, simulate
from tests.helpers import CONV_X, lane, quiet, synthetic_plan
from tests.models import conv_student, conv_teacher

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


@pytest.fixture(scope="module")
def mlp_plan() -> Plan:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    with quiet():
        return ppll_compile.plan(model, 3, example_inputs=(torch.randn(4, 8),))


@pytest.fixture(scope="module")
def replicated_plan() -> Plan:
    """PPLL, stage 0 on two replicas: its all-reduce covers the backbone and the aux head's gradients."""
    with quiet():
        return ppll_compile.plan(conv_student(), example_inputs=(CONV_X,), split_points=["5"], replicas=(2, 1))


@pytest.fixture(scope="module")
def pipebd_plan() -> Plan:
    with quiet():
        return ppll_compile.plan(conv_student(), teacher=conv_teacher(), example_inputs=(CONV_X,),
                                 split_points=["5"], replicas=(2, 1))


def _spans(sim: Simulation, stage: int, kind: str) -> list[float]:
    return [end - start for _, k, start, end in lane(sim, stage) if k == kind]


def _one_batch(plan: Plan, after_steps: bool = False) -> list[float]:
    """When each stage is done (all but its optimizer step) with one batch that meets no other: stage j starts it
    once every stage before it made its output (the block's forward, or Pipe-BD's teacher blocks, by FLOP share
    of the compute but the step) and sent it, and then works its whole ``cost`` but the ``step_cost`` (which
    follows). ``after_steps``: the batch follows a barrier at 0, so stage j is free from its ``step_cost`` on.
    Without step costs: when each stage finishes the batch."""
    done, arrival = [], 0.0
    for s in plan.stages:
        compute = s.compute_cost - plan.allreduce_cost(s) - s.step_cost
        if plan.mode == "ppll":
            first, total = s.flops_fwd, s.flops_fwd + s.flops_bwd + s.head.flops_fwd + s.head.flops_bwd
        else:
            first, total = s.aux_flops, s.aux_flops + s.flops_fwd + s.flops_bwd
        begin = max(arrival, s.step_cost) if after_steps else arrival
        done.append(begin + s.cost - s.step_cost)
        arrival = begin + (compute * first / total if total else compute) + s.comm_cost  # no FLOPs: all of it first
    return done


# ---- hand-computed schedules ----------------------------------------------------------------------------

def test_two_stage_schedule_event_by_event(mlp_plan):
    # stage 0: forward 1 (the block: its output exists after it), backward 1, send 1 (cost 3); stage 1:
    # forward 3, backward 3 (cost 6); one-batch queue: room for batch b once stage 1 started batch b-1
    plan = synthetic_plan(mlp_plan, [dict(compute=2.0, fwd=1, bwd=1, out=1), dict(compute=6.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=4, queue_depth=1)
    assert lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "send", 1, 2), (0, "backward", 2, 3),     # the queue is empty: sent at once
        (1, "forward", 3, 4), (1, "send", 4, 5), (1, "backward", 5, 6),     # room at 4: stage 1 took batch 0 at 2
        (2, "forward", 6, 7), (2, "backward", 7, 8), (2, "send", 8, 9),     # no room at 7 (batch 1 taken at 8):
        #                                                                     deferred until done at 8, room then
        (3, "forward", 9, 10), (3, "backward", 10, 11), (3, "send", 11, 15),  # deferred, then blocked until stage 1
    ]                                                                         # takes batch 2 at 14
    assert lane(sim, 1) == [
        (0, "receive", 0, 2), (0, "forward", 2, 5), (0, "backward", 5, 8),  # batch 0 arrives when its send ends
        (1, "forward", 8, 11), (1, "backward", 11, 14),                     # batch 1 arrived at 5
        (2, "forward", 14, 17), (2, "backward", 17, 20),                    # batch 2 at 9
        (3, "forward", 20, 23), (3, "backward", 23, 26),                    # batch 3 at 15
    ]
    # warm-up: stage 1 ends batch 0 at 8; step: (26 - 14) / 2 over batches 2..3
    assert (sim.makespan, sim.warmup, sim.step_time) == (26, 8, 6)
    s0, s1 = sim.stages
    # stage 0: 4 x 2 computing, 4 x 1 sending, blocked 14 - 11 = 3, idle after 15 until 26
    assert (s0.compute, s0.allreduce, s0.send, s0.blocked, s0.barrier, s0.idle) == (8, 0, 4, 3, 0, 11)
    assert (s1.compute, s1.allreduce, s1.send, s1.blocked, s1.barrier, s1.idle) == (24, 0, 0, 0, 0, 2)
    assert s1.utilisation == 24 / 26 and s0.utilisation == 8 / 26
    assert sim.throughput == mlp_plan.batch_size / 6 and sim.predicted == mlp_plan.batch_size / 6


def test_three_stage_schedule_with_a_replicated_stage_event_by_event(mlp_plan):
    # stage 0: forward 1, backward 1, send 2; stage 1 on two replicas: forward 1, backward 2 (FLOPs 1:2),
    # all-reduce 2*(1/2)*1 = 1, send 2/2 = 1; stage 2: forward 1, backward 1. Every send finds room (the next
    # stage always took the batch before by then), so each goes right after the block's forward.
    plan = synthetic_plan(mlp_plan, [dict(compute=2.0, fwd=1, bwd=1, out=2),
                                 dict(compute=3.0, fwd=1, bwd=2, grad=1, out=2, replicas=2),
                                 dict(compute=2.0, fwd=5, bwd=5)])
    sim = simulate(plan, steps=3, queue_depth=1)
    assert [s.cost for s in sim.stages] == [s.cost for s in plan.stages] == [4, 5, 2]
    assert sim.timeline.lanes == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "send", 1, 3), (0, "backward", 3, 4),
        (1, "forward", 4, 5), (1, "send", 5, 7), (1, "backward", 7, 8),    # room at 5: stage 1 took batch 0 at 3
        (2, "forward", 8, 9), (2, "send", 9, 11), (2, "backward", 11, 12),  # ... batch 1 at 8
    ]
    assert lane(sim, 1) == lane(sim, 1, replica=1) == [
        (0, "receive", 0, 3), (0, "forward", 3, 4), (0, "send", 4, 5), (0, "backward", 5, 7), (0, "allreduce", 7, 8),
        (1, "forward", 8, 9), (1, "send", 9, 10), (1, "backward", 10, 12), (1, "allreduce", 12, 13),  # arrived at 7
        (2, "forward", 13, 14), (2, "send", 14, 15), (2, "backward", 15, 17), (2, "allreduce", 17, 18),  # ... 11
    ]
    assert lane(sim, 2) == [
        (0, "receive", 0, 5), (0, "forward", 5, 6), (0, "backward", 6, 7),
        (1, "receive", 7, 10), (1, "forward", 10, 11), (1, "backward", 11, 12),
        (2, "receive", 12, 15), (2, "forward", 15, 16), (2, "backward", 16, 17),
    ]
    # stage 1 finishes last (18), after the last stage (17); warm-up 7; step (17 - 7) / 2
    assert (sim.makespan, sim.warmup, sim.step_time) == (18, 7, 5)
    # idle: stage 0 after 12; stage 1 before 3; stage 2: 5 + 3 + 3 receiving, then after 17
    assert [(s.blocked, s.barrier, s.idle) for s in sim.stages] == [(0, 0, 6), (0, 0, 3), (0, 0, 12)]
    assert sim.stages[1].allreduce == 3 and sim.stages[1].utilisation == 12 / 18


@pytest.mark.parametrize("base, first, rest", [("mlp_plan", dict(fwd=1, head_fwd=1), "head"),
                                               ("pipebd_plan", dict(aux=1, fwd=1), "student blocks")])
def test_early_forwarding_sends_before_the_rest_of_the_forward_and_defers_on_a_full_queue(base, first, rest,
                                                                                         request):
    # stage 0: forward 2 = 1 until its output exists (PPLL: the block; Pipe-BD: the teacher blocks) + 1 after it
    # (PPLL: the head; Pipe-BD: the student blocks), backward 1, send 1 (cost 4); stage 1: forward 3, backward 3
    # (cost 6); one-batch queue: room for batch b at stage 0's output time `out` iff stage 1 started batch b-1
    plan = synthetic_plan(request.getfixturevalue(base), [dict(compute=3.0, bwd=1, out=1, **first),
                                                      dict(compute=6.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=5, queue_depth=1)
    assert lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "send", 1, 2), (0, "forward", 2, 3), (0, "backward", 3, 4),  # empty queue
        (1, "forward", 4, 5), (1, "send", 5, 6), (1, "forward", 6, 7), (1, "backward", 7, 8),  # batch 0 taken at 2
        (2, "forward", 8, 9), (2, "send", 9, 10), (2, "forward", 10, 11), (2, "backward", 11, 12),  # batch 1 at 8
        (3, "forward", 12, 14), (3, "backward", 14, 15), (3, "send", 15, 16),  # out 13 < 14 (batch 2 taken):
        #                                                                        deferred; room when done at 15
        (4, "forward", 16, 18), (4, "backward", 18, 19), (4, "send", 19, 21),  # out 17 < 20 (batch 3): deferred;
    ], rest                                                                      # done 19, blocked until 20
    assert lane(sim, 1) == [
        (0, "receive", 0, 2), (0, "forward", 2, 5), (0, "backward", 5, 8),
        (1, "forward", 8, 11), (1, "backward", 11, 14),    # arrived at 6
        (2, "forward", 14, 17), (2, "backward", 17, 20),   # at 10
        (3, "forward", 20, 23), (3, "backward", 23, 26),   # at 16
        (4, "forward", 26, 29), (4, "backward", 29, 32),   # at 21
    ]
    # warm-up 8; step (32 - 14) / 3 over batches 2..4: the bottleneck stage's cost
    assert (sim.makespan, sim.warmup, sim.step_time) == (32, 8, 6)
    s0, s1 = sim.stages
    assert (s0.compute, s0.send, s0.blocked, s0.barrier, s0.idle) == (15, 5, 1, 0, 32 - 21)
    assert (s1.compute, s1.send, s1.blocked, s1.barrier, s1.idle) == (30, 0, 0, 0, 2)


@pytest.mark.parametrize("depth, blocked", [(1, [0, 0, 1, 2, 2, 2]), (2, [0, 0, 0, 0, 1, 2]), (6, [0] * 6)])
def test_a_fast_stage_before_a_slow_one_blocks_on_a_full_queue(mlp_plan, depth, blocked):
    # stage 0: compute 1 (no FLOPs counted: all forward, the output exists at its end), send 1; stage 1: compute 4
    plan = synthetic_plan(mlp_plan, [dict(compute=1.0, out=1), dict(compute=4.0)])
    sim = simulate(plan, steps=6, queue_depth=depth)
    assert [d - 1 for d in _spans(sim, 0, "send")] == blocked
    assert sim.stages[0].blocked == sum(blocked)
    assert _spans(sim, 0, "backward") == [0] * 6 and _spans(sim, 0, "forward") == [1] * 6
    assert sim.step_time == 4 and sim.makespan == 2 + 6 * 4


def test_a_barrier_before_every_step_overlaps_the_stages_within_a_batch_event_by_event(mlp_plan):
    # stage 0: block forward 1, send 1, head forward 1, backward 2 (cost 5); stage 1 on two replicas: forward 1,
    # send 2/2 = 1, backward 2, all-reduce 2*(1/2)*1 = 1 (cost 5); stage 2: forward 1, backward 1 (cost 2).
    # Batch b: each stage starts as soon as its input arrived (and it passed the barrier of b-1); every stage's
    # step waits until all are done: stage 0 at 5, stage 1 at 2 + 5 = 7, stage 2 at 2 + 2 + 2 = 6, so batch 0
    # ends at 7 on every stage and batch 1 at 14.
    plan = synthetic_plan(mlp_plan, [dict(compute=4.0, fwd=1, head_fwd=1, bwd=2, out=1),
                                 dict(compute=3.0, fwd=1, bwd=2, grad=1, out=2, replicas=2),
                                 dict(compute=2.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=2, queue_depth=1, decoupled=False)
    assert lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "send", 1, 2), (0, "forward", 2, 3), (0, "backward", 3, 5),    # barrier 5..7
        (1, "forward", 7, 8), (1, "send", 8, 9), (1, "forward", 9, 10), (1, "backward", 10, 12),  # barrier 12..14
    ]
    assert lane(sim, 1) == lane(sim, 1, replica=1) == [
        (0, "receive", 0, 2), (0, "forward", 2, 3), (0, "send", 3, 4), (0, "backward", 4, 6), (0, "allreduce", 6, 7),
        (1, "receive", 7, 9), (1, "forward", 9, 10), (1, "send", 10, 11), (1, "backward", 11, 13),
        (1, "allreduce", 13, 14),
    ]
    assert lane(sim, 2) == [
        (0, "receive", 0, 4), (0, "forward", 4, 5), (0, "backward", 5, 6),      # barrier 6..7
        (1, "receive", 7, 11), (1, "forward", 11, 12), (1, "backward", 12, 13),  # barrier 13..14
    ]
    # the stages overlap within a batch (stage 1's forward runs beside stage 0's head), never across one
    assert all(e.start >= 7 for e in sim.timeline.events if e.batch == 1)
    assert all(e.end <= 7 for e in sim.timeline.events if e.batch == 0)
    assert (sim.makespan, sim.warmup, sim.step_time) == (14, 7, 7)
    assert [(s.blocked, s.barrier, s.idle) for s in sim.stages] == [(0, 4, 0), (0, 0, 4), (0, 2, 8)]
    # decoupled, batch 1 goes on at once: stage 0 starts it at 5, stage 1 at 7 (free; the input came at 7),
    # sends it at 8..9, done at 12; stage 2 gets it at 9, done at 11: makespan 12
    assert simulate(plan, steps=2, queue_depth=1).makespan == 12


# ---- the optimizer step ---------------------------------------------------------------------------------

def test_the_optimizer_step_is_its_own_span_after_the_backward_and_before_a_deferred_send(mlp_plan):
    # stage 0: compute 3 = block forward 1 (no head FLOPs: the output exists after it), backward 1, step 1; send 1
    # (cost 4). stage 1: compute 7 = forward 3, backward 3, step 1 (cost 7). One-batch queue.
    plan = synthetic_plan(mlp_plan, [dict(compute=3.0, fwd=1, bwd=1, step=1.0, out=1),
                                 dict(compute=7.0, fwd=1, bwd=1, step=1.0)])
    sim = simulate(plan, steps=4, queue_depth=1)
    assert lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "send", 1, 2), (0, "backward", 2, 3), (0, "step", 3, 4),
        (1, "forward", 4, 5), (1, "send", 5, 6), (1, "backward", 6, 7), (1, "step", 7, 8),      # batch 0 taken at 2
        (2, "forward", 8, 9), (2, "send", 9, 10), (2, "backward", 10, 11), (2, "step", 11, 12),  # batch 1 at 9: a tie
        (3, "forward", 12, 13), (3, "backward", 13, 14), (3, "step", 14, 15), (3, "send", 15, 17),  # batch 2 at 16:
    ]                                                                             # deferred past the step, blocked 1
    assert lane(sim, 1) == [
        (0, "receive", 0, 2), (0, "forward", 2, 5), (0, "backward", 5, 8), (0, "step", 8, 9),
        (1, "forward", 9, 12), (1, "backward", 12, 15), (1, "step", 15, 16),   # batch 1 arrived at 6
        (2, "forward", 16, 19), (2, "backward", 19, 22), (2, "step", 22, 23),  # batch 2 at 10
        (3, "forward", 23, 26), (3, "backward", 26, 29), (3, "step", 29, 30),  # batch 3 at 17
    ]
    assert (sim.makespan, sim.warmup, sim.step_time) == (30, 9, 7)
    s0, s1 = sim.stages
    assert (s0.cost, s0.compute, s0.send, s0.blocked, s0.idle) == (4, 12, 4, 1, 30 - 17)  # compute: the steps too
    assert (s1.cost, s1.compute, s1.send, s1.blocked, s1.idle) == (7, 28, 0, 0, 2)
    assert sim.timeline.busy(1) == 28


def test_the_barrier_comes_before_the_step_so_each_stage_leaves_it_at_its_own_time(mlp_plan):
    # stage 0: forward 1 (no FLOPs counted), step 2, send 1 (cost 4); stage 1: forward 1, backward 1, step 0.5.
    # Batch 0: stage 0 done at 2, stage 1 at 4: both step from 4, stage 0 until 6, stage 1 until 4.5.
    plan = synthetic_plan(mlp_plan, [dict(compute=3.0, step=2.0, out=1), dict(compute=2.5, fwd=1, bwd=1, step=0.5)])
    sim = simulate(plan, steps=2, queue_depth=1, decoupled=False)
    assert lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "send", 1, 2), (0, "backward", 2, 2), (0, "step", 4, 6),       # barrier 2..4
        (1, "forward", 6, 7), (1, "send", 7, 8), (1, "backward", 8, 8), (1, "step", 10, 12),     # barrier 8..10
    ]
    assert lane(sim, 1) == [
        (0, "receive", 0, 2), (0, "forward", 2, 3), (0, "backward", 3, 4), (0, "step", 4, 4.5),
        (1, "receive", 4.5, 8), (1, "forward", 8, 9), (1, "backward", 9, 10), (1, "step", 10, 10.5),
    ]
    assert (sim.makespan, sim.warmup, sim.step_time) == (12, 4.5, 6)
    assert [(s.barrier, s.idle) for s in sim.stages] == [(4, 0), (0, 2 + 3.5 + 1.5)]


# ---- steady state ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("computes", [[1.0, 3.0, 2.0], [3.0, 1.0, 2.0], [1.0, 2.0, 3.0], [2.5, 2.5, 1.0]])
@pytest.mark.parametrize("depth", [1, 2])
def test_the_steady_state_step_is_the_bottleneck_stage(mlp_plan, computes, depth):
    plan = synthetic_plan(mlp_plan, [dict(compute=c, fwd=1, bwd=2, out=1) for c in computes])
    sim = simulate(plan, queue_depth=depth)
    assert sim.step_time == pytest.approx(plan.bottleneck_cost, rel=1e-12)
    assert sim.throughput == pytest.approx(plan.batch_size / plan.bottleneck_cost, rel=1e-12) == sim.predicted


@pytest.mark.parametrize("name", ["mlp_plan", "replicated_plan", "pipebd_plan"])
def test_real_plans_run_at_their_predicted_rate(name, request):
    # decoupled, early forwarding changes when a stage's input comes, not how much work each stage does per
    # batch: the steady state is still the bottleneck stage's cost
    plan = request.getfixturevalue(name)
    sim = simulate(plan)
    assert [s.cost for s in sim.stages] == pytest.approx([s.cost for s in plan.stages], rel=1e-12)
    assert sim.step_time == pytest.approx(plan.bottleneck_cost, rel=1e-9)
    assert sim.throughput == pytest.approx(sim.predicted, rel=1e-9)
    assert sim.batch_size == plan.batch_size and sim.link_bandwidth == plan.link_bandwidth
    # with the barrier, every batch is one batch alone (test below), each stage free once its step ended: its
    # slowest stage's finish
    barrier = simulate(plan, decoupled=False)
    assert barrier.step_time == pytest.approx(max(_one_batch(plan, after_steps=True)), rel=1e-9)
    assert plan.bottleneck_cost * (1 - 1e-9) <= barrier.step_time < sum(s.cost for s in plan.stages)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_barrier_before_every_step_costs_the_slowest_stage_of_one_batch(mlp_plan, depth):
    # After the barrier of batch b-1 every stage is free at once (time T), so batch b is one batch alone: stage j
    # starts it at T + (block forward + send of every stage before it), finishes at that + its cost, and all
    # step at T + the largest such finish. Stage 0: forward 1 (no FLOPs: all of it before the output), send 1:
    # done at 2; stage 1: starts at 2, block forward 1, send 2, backward 3: done at 8; stage 2: starts at
    # 2 + 1 + 2 = 5, compute 3.5: done at 8.5. Step 8.5: between the bottleneck (6) and the sum (11.5).
    plan = synthetic_plan(mlp_plan, [dict(compute=1.0, out=1), dict(compute=4.0, fwd=1, bwd=3, out=2),
                                 dict(compute=3.5)])
    sim = simulate(plan, steps=10, queue_depth=depth, decoupled=False)
    assert _one_batch(plan) == [2, 8, 8.5]
    assert sim.step_time == 8.5 and sim.makespan == 85 and sim.warmup == 8.5
    assert [s.blocked for s in sim.stages] == [0, 0, 0]  # a queue never holds more than one batch
    assert [s.barrier for s in sim.stages] == [10 * 6.5, 10 * 0.5, 0]
    assert [s.idle for s in sim.stages] == [0, 10 * 2, 10 * 5]
    assert all(8.5 * e.batch <= e.start <= e.end <= 8.5 * (e.batch + 1) for e in sim.timeline.events)


@pytest.mark.parametrize("decoupled", [True, False])
def test_one_step_is_its_own_step_time(mlp_plan, decoupled):
    # one batch: each stage starts once the stages before it made and sent their outputs; with early
    # forwarding the stages overlap, so it takes less than the sum of the stages' costs
    # (each stage steps when done with it, or with the barrier once all are done)
    sim = simulate(mlp_plan, steps=1, decoupled=decoupled)
    done = _one_batch(mlp_plan)
    finish = [(d if decoupled else max(done)) + s.step_cost for d, s in zip(done, mlp_plan.stages)]
    assert sim.step_time == sim.makespan == pytest.approx(max(finish), rel=1e-12)
    assert sim.warmup == pytest.approx(finish[-1], rel=1e-12)
    assert sim.makespan < sum(s.cost for s in mlp_plan.stages)


# ---- replicas, FLOP shares, bandwidth -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["replicated_plan", "pipebd_plan"])
def test_a_replicated_stage_has_identical_lanes_and_all_reduces_its_gradients(name, request):
    plan = request.getfixturevalue(name)
    sim = simulate(plan, steps=5)
    first = plan.stages[0]
    assert sim.timeline.lanes == [(0, 0), (0, 1), (1, 0)]
    assert lane(sim, 0, 0) == lane(sim, 0, 1)
    head_grads = first.head.param_count * 4 if plan.mode == "ppll" else 0
    assert plan.mode == "pipebd" or head_grads > 0
    sync = 2 * (2 - 1) / 2 * (first.grad_bytes + head_grads) / plan.link_bandwidth
    assert _spans(sim, 0, "allreduce") == pytest.approx([sync] * 5, rel=1e-12) and sync > 0
    assert sim.stages[0].allreduce == pytest.approx(5 * sync, rel=1e-12)
    assert not _spans(sim, 1, "allreduce") and sim.stages[1].allreduce == 0
    compute = first.compute_cost - sync - first.step_cost  # the step is its own part, after the all-reduce
    # batch 0 is sent early: the forward until the output (PPLL: the block; Pipe-BD: the teacher blocks), the
    # send, then the rest of it (PPLL: the head; Pipe-BD: the student blocks)
    early, fwd = (first.flops_fwd, first.flops_fwd + first.head.flops_fwd) if plan.mode == "ppll" else (
        first.aux_flops, first.aux_flops + first.flops_fwd)
    total = fwd + first.flops_bwd + (first.head.flops_bwd if plan.mode == "ppll" else 0)
    assert 0 < early < fwd < total
    step = ["step"] if first.step_cost > 0 else []
    assert [k for b, k, _, _ in lane(sim, 0) if b == 0] == ["forward", "send", "forward", "backward", "allreduce",
                                                             *step]
    assert _spans(sim, 0, "step") == pytest.approx([first.step_cost] * 5 if step else [], rel=1e-12)
    assert _spans(sim, 0, "forward")[:2] == pytest.approx([compute * early / total, compute * (fwd - early) / total],
                                                          rel=1e-12)
    assert _spans(sim, 0, "backward")[0] == pytest.approx(compute * (total - fwd) / total, rel=1e-12)


def test_the_link_bandwidth_scales_sends_and_all_reduces_only(replicated_plan):
    plan = replicated_plan
    base, slow = simulate(plan, steps=3), simulate(plan, steps=3, link_bandwidth=plan.link_bandwidth / 4)
    first = plan.stages[0]
    send = sum(t.bytes for t in first.boundary) / (plan.link_bandwidth / 4) / 2
    assert slow.link_bandwidth == plan.link_bandwidth / 4 and slow.stages[0].blocked == 0
    assert send == pytest.approx(4 * first.comm_cost, rel=1e-12)
    assert _spans(slow, 0, "send") == pytest.approx([send] * 3, rel=1e-12)
    assert slow.stages[0].send == pytest.approx(3 * send, rel=1e-12)
    assert _spans(slow, 0, "allreduce") == pytest.approx([4 * d for d in _spans(base, 0, "allreduce")], rel=1e-12)
    for kind in ("forward", "backward"):
        assert _spans(slow, 0, kind) == pytest.approx(_spans(base, 0, kind), rel=1e-12)
    sync = 2 * (first.grad_bytes + first.head.param_count * 4) / 2 / plan.link_bandwidth
    assert slow.stages[0].cost == pytest.approx(first.cost + 3 * (sync + first.comm_cost), rel=1e-12)
    assert slow.stages[1].cost == pytest.approx(plan.stages[1].cost, rel=1e-12)


# ---- an independent event-driven reference --------------------------------------------------------------

def _reference(work: list[tuple[float, float, float]], steps: int, depth: int, decoupled: bool) -> dict:
    """Times of every (stage, batch) from a heap of timed events: ``start``, ``out`` (the output exists),
    ``put`` and ``sent`` (the send begins and ends), ``done`` (backward and all-reduce), ``step`` (the barrier
    let the step go; ``done`` without one) and ``end`` (the stage is free); and the ``deferred`` sends.

    ``work[j] = (early, rest, send)``: the forward until the output exists, the rest of the forward + backward
    + all-reduce, the transfer. State changes at one instant are applied until none is left, and an output with
    no room is deferred only once no event at that instant is left, so the order of simultaneous events does
    not matter.
    """
    n = len(work)
    heap: list = []
    order = itertools.count()
    inbox = [deque() for _ in range(n)]
    taken = [0] * n
    idle = [True] * n
    at_out: list = [None] * n       # batch whose output exists and waits for the decision to send
    at_barrier: list = [None] * n   # batch done, its step waiting for the other stages
    waiting: list = [None] * n      # batch stepped, its deferred send waiting for room
    times: dict = {k: {} for k in ("start", "out", "put", "sent", "done", "step", "end")}
    deferred: set = set()

    def schedule(t, kind, j, b):
        heapq.heappush(heap, (t, next(order), kind, j, b))

    def room(j, b):
        return b < depth or taken[j + 1] > b - depth

    def send(t, j, b):
        times["put"][j, b] = t
        schedule(t + work[j][2], "sent", j, b)

    def step(t, j, b):
        times["step"][j, b] = t
        if (j, b) in deferred:
            waiting[j] = b
        else:
            times["end"][j, b], idle[j] = t, True

    def progress(t):
        changed = True
        while changed:
            changed = False
            for j in range(n):
                ready = inbox[j][0] if inbox[j] else None
                if j == 0:
                    ready = taken[0] if taken[0] < steps else None
                if idle[j] and ready is not None:
                    if j > 0:
                        inbox[j].popleft()
                    idle[j], taken[j], times["start"][j, ready] = False, taken[j] + 1, t
                    schedule(t + work[j][0], "out", j, ready)
                    changed = True
                for slot, go in ((at_out, lambda b: room(j, b)), (waiting, lambda b: room(j, b)),
                                 (at_barrier, lambda b: all((k, b) in times["done"] for k in range(n)))):
                    b = slot[j]
                    if b is not None and go(b):
                        slot[j] = None
                        if slot is at_barrier:
                            step(t, j, b)
                        else:
                            send(t, j, b)
                        changed = True

    t = 0.0
    progress(t)
    while True:
        if any(b is not None for b in at_out) and (not heap or heap[0][0] > t):
            for j, b in enumerate(at_out):  # no room now: the send waits for the stage's step
                if b is not None:
                    at_out[j] = None
                    deferred.add((j, b))
                    schedule(t + work[j][1], "done", j, b)
            progress(t)
            continue
        if not heap:
            break
        t, _, kind, j, b = heapq.heappop(heap)
        times[kind][j, b] = t
        if kind == "out":
            if j == n - 1:
                schedule(t + work[j][1], "done", j, b)
            else:
                at_out[j] = b
        elif kind == "sent":
            inbox[j + 1].append(b)
            if (j, b) in deferred:
                times["end"][j, b], idle[j] = t, True
            else:
                schedule(t + work[j][1], "done", j, b)
        elif decoupled:  # done
            step(t, j, b)
        else:
            at_barrier[j] = b
        progress(t)
    return {**times, "deferred": deferred}


def _random_case(rng: random.Random, bases: list[Plan]) -> tuple[Plan, dict, list[tuple[float, float, float]]]:
    n = rng.randint(1, 6)
    bandwidth = rng.uniform(100.0, 2000.0)
    specs = [dict(compute=rng.choice([0.0, rng.uniform(0.0, 3.0)]), fwd=rng.randint(0, 5), bwd=rng.randint(0, 5),
                  head_fwd=rng.randint(0, 2), head_bwd=rng.randint(0, 2), aux=rng.randint(0, 3),
                  grad=rng.randint(0, 2000), out=rng.randint(0, 3000), replicas=rng.randint(1, 4)) for _ in range(n)]
    plan = synthetic_plan(rng.choice(bases), specs, bandwidth)
    options = dict(steps=rng.randint(1, 12), queue_depth=rng.randint(1, 3), decoupled=rng.random() < 0.6,
                   link_bandwidth=rng.choice([None, rng.uniform(100.0, 2000.0)]))
    bw = options["link_bandwidth"] or bandwidth
    work = []
    for j, s in enumerate(specs):
        first, total = (s["fwd"], s["fwd"] + s["head_fwd"] + s["bwd"] + s["head_bwd"]) if plan.mode == "ppll" \
            else (s["aux"], s["aux"] + s["fwd"] + s["bwd"])
        early = s["compute"] * first / total if total else s["compute"]
        sync = 2 * (s["replicas"] - 1) / s["replicas"] * s["grad"] / bw
        work.append((early, s["compute"] - early + sync, 0.0 if j == n - 1 else s["out"] / bw / s["replicas"]))
    return plan, options, work


def test_an_independent_event_driven_simulation_agrees_on_random_plans(mlp_plan, pipebd_plan):
    rng = random.Random(12345)
    close = dict(rel=1e-12, abs=1e-12)
    for case in range(80):
        plan, options, work = _random_case(rng, [mlp_plan, pipebd_plan])
        sim = simulate(plan, **options)
        steps = options["steps"]
        ref = _reference(work, steps, options["queue_depth"], options["decoupled"])
        n = plan.num_stages
        assert options["decoupled"] or not ref["deferred"], case  # the barrier leaves room in every queue
        assert sim.timeline.lanes == [(j, r) for j, s in enumerate(plan.stages) for r in range(s.replicas)]
        for j, s in enumerate(plan.stages):
            lanes = [lane(sim, j, r) for r in range(s.replicas)]
            assert all(lane == lanes[0] for lane in lanes), case
            for b in range(steps):
                spans = [(k, t0, t1) for c, k, t0, t1 in lanes[0] if c == b]
                get = {k: (t0, t1) for k, t0, t1 in spans}
                forward = [(t0, t1) for k, t0, t1 in spans if k == "forward"]
                at = (case, j, b)
                assert forward[0][0] == pytest.approx(ref["start"][j, b], **close), at
                assert get["allreduce" if s.replicas > 1 else "backward"][1] == pytest.approx(ref["done"][j, b],
                                                                                              **close), at
                if j == n - 1:
                    assert "send" not in get, at
                elif (j, b) in ref["deferred"]:  # from the step, waiting for room included
                    assert get["send"] == pytest.approx((ref["step"][j, b], ref["sent"][j, b]), **close), at
                    assert len(forward) == 1 and [k for k, _, _ in spans][-1] == "send", at
                else:  # early: right when the output exists
                    assert ref["put"][j, b] == ref["out"][j, b], at
                    assert forward[0][1] == pytest.approx(ref["out"][j, b], **close), at
                    assert get["send"] == pytest.approx((ref["put"][j, b], ref["sent"][j, b]), **close), at
                if "receive" in get:
                    assert get["receive"][1] == forward[0][0] and get["receive"][0] < forward[0][0], at
            stage = sim.stages[j]
            blocked = sum(ref["put"][j, b] - ref["step"][j, b] for b in range(steps) if (j, b) in ref["deferred"])
            barrier = sum(ref["step"][j, b] - ref["done"][j, b] for b in range(steps))
            assert (stage.blocked, stage.barrier) == pytest.approx((blocked, barrier), **close), case
            assert (stage.compute + stage.allreduce + stage.send + stage.blocked + stage.barrier
                    + stage.idle) == pytest.approx(sim.makespan, **close)
        assert sim.makespan == pytest.approx(max(ref["end"].values()), **close)
        assert sim.warmup == pytest.approx(ref["end"][n - 1, 0], **close)


# ---- output and errors ----------------------------------------------------------------------------------

def test_results_print_and_serialise(mlp_plan):
    sim = simulate(mlp_plan, steps=8)
    d = json.loads(json.dumps(sim.to_dict()))
    assert "timeline" not in d and len(d["stages"]) == 3 and d["steps"] == 8 and d["queue_depth"] == 2
    assert d["step_time"] == sim.step_time and d["stages"][1]["blocked"] == sim.stages[1].blocked
    lines = sim.table().splitlines()
    assert lines[0].split() == ["stage", "replicas", "busy", "ms", "send", "ms", "blocked", "ms", "barrier", "ms",
                                "idle", "ms", "util", "%", "head", "%"]
    assert len(lines) == 2 + 3 + 1 and "samples/s" in lines[-1] and "8 steps" in lines[-1]
    assert lines[-1].endswith("  decoupled")
    assert simulate(mlp_plan, steps=8, decoupled=False).table().endswith("  barrier before each step")
    assert str(sim) == sim.table()
    assert sim.timeline.source == "simulated" and sim.timeline.meta["steps"] == 8
    zero = synthetic_plan(mlp_plan, [dict(compute=0.0, out=0), dict(compute=0.0)])
    free = simulate(zero, steps=3)
    assert free.throughput == float("inf") and free.to_dict()["throughput"] is None
    assert [s.utilisation for s in free.stages] == [0.0, 0.0]


@pytest.mark.parametrize("options, error, message", [
    (dict(steps=0), ValueError, "steps must be an int >= 1, got 0 (the number of batches to simulate, e.g. steps=64)"),
    (dict(steps=2.5), TypeError, "steps must be an int >= 1, got 2.5 (the number of batches to simulate, e.g. "
                                 "steps=64)"),
    (dict(queue_depth=0), ValueError, "queue_depth must be an int >= 1, got 0 (batches per queue; the runtimes' "
                                      "default is 2)"),
    (dict(queue_depth=True), TypeError, "queue_depth must be an int >= 1, got True (batches per queue; the "
                                        "runtimes' default is 2)"),
    (dict(link_bandwidth=0), ValueError, "link_bandwidth must be a positive finite number of bytes per second, got "
                                         "0 (e.g. 25e9, or None for the plan's 2.5e+10)"),
    (dict(link_bandwidth=float("inf")), ValueError, "link_bandwidth must be a positive finite number of bytes per "
                                                    "second, got inf (e.g. 25e9, or None for the plan's 2.5e+10)"),
    (dict(cores=0), ValueError, "cores must be an int >= 1 or None, got 0 (the CPU cores the cpu stages share, "
                                "e.g. cores=os.cpu_count(); None gives every stage a processor of its own)"),
    (dict(cores=1.5), TypeError, "cores must be an int >= 1 or None, got 1.5 (the CPU cores the cpu stages share, "
                                 "e.g. cores=os.cpu_count(); None gives every stage a processor of its own)"),
    (dict(cores=True), TypeError, "cores must be an int >= 1 or None, got True (the CPU cores the cpu stages "
                                  "share, e.g. cores=os.cpu_count(); None gives every stage a processor of its own)"),
    (dict(link_bandwidth="fast"), TypeError, "link_bandwidth must be a positive finite number of bytes per second, "
                                             "got 'fast' (e.g. 25e9, or None for the plan's 2.5e+10)"),
])
def test_bad_arguments_say_what_was_wrong_and_the_way_out(mlp_plan, options, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        simulate(mlp_plan, **options)


def test_only_a_plan_is_simulated(mlp_plan):
    with pytest.raises(TypeError, match=re.escape(
            "simulate() takes a Plan, got dict (make one with ppll_compile.plan(model, gpus, example_inputs=...) "
            "or Plan.load(path))")):
        simulate(mlp_plan.to_dict())

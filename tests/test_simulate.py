"""The plan-time schedule simulator: hand-computed schedules, steady state, replicas, bandwidth, queue blocking,
and agreement with an independent event-driven simulation on random plans."""

import contextlib
import copy
import heapq
import itertools
import json
import random
import re
import warnings
from collections import deque

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.plan import Plan
from ppll_compile.simulate import Simulation, simulate
from tests.models import conv_student, conv_teacher

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

CONV_X = torch.randn(8, 3, 16, 16)


@pytest.fixture(scope="module")
def mlp_plan() -> Plan:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    with _quiet():
        return ppll_compile.plan(model, 3, example_inputs=(torch.randn(4, 8),))


@pytest.fixture(scope="module")
def replicated_plan() -> Plan:
    """PPLL, stage 0 on two replicas: its all-reduce covers the backbone and the aux head's gradients."""
    with _quiet():
        return ppll_compile.plan(conv_student(), example_inputs=(CONV_X,), split_points=["5"], replicas=(2, 1))


@pytest.fixture(scope="module")
def pipebd_plan() -> Plan:
    with _quiet():
        return ppll_compile.plan(conv_student(), teacher=conv_teacher(), example_inputs=(CONV_X,),
                                 split_points=["5"], replicas=(2, 1))


@contextlib.contextmanager
def _quiet():
    """Plan without the CPU-fallback warnings (module fixtures run outside ``one_thread_quietly``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _synthetic(base: Plan, specs: list[dict], bandwidth: float = 1.0) -> Plan:
    """A validated plan of ``len(specs)`` stages with exactly the given work (bandwidth 1: bytes are seconds).

    Each spec: ``compute`` (forward + backward seconds), ``fwd``/``bwd`` FLOPs (the split), ``grad`` bytes
    (all-reduced over ``replicas``), ``out`` boundary bytes (every stage but the last).
    """
    d = base.to_dict()
    middle, last = d["stages"][0], d["stages"][-1]
    n = len(specs)
    stages = []
    for i, spec in enumerate(specs):
        s = copy.deepcopy(last if i == n - 1 else middle)
        r = spec.get("replicas", 1)
        sync = 2 * (r - 1) / r * spec.get("grad", 0) / bandwidth
        send = 0.0 if i == n - 1 else spec.get("out", 0) / bandwidth / r
        s.update(index=i, nodes=[f"n{i}"], first_node=f"n{i}", last_node=f"n{i}", replicas=r, aux_flops=0,
                 flops_fwd=spec.get("fwd", 0), flops_bwd=spec.get("bwd", 0), grad_bytes=spec.get("grad", 0),
                 compute_cost=spec["compute"] + sync, comm_cost=send, cost=spec["compute"] + sync + send)
        s["head"].update(param_count=0, flops_fwd=0, flops_bwd=0)
        if i < n - 1:
            s["boundary"] = [{"name": f"n{i}", "shape": [1], "dtype": "float32", "bytes": spec.get("out", 0)}]
        stages.append(s)
    d.update(stages=stages, legal_cuts=[f"n{i}" for i in range(n - 1)], multi_tensor_cuts=[],
             device_speeds=[1.0] * n, memory_limit=None, link_bandwidth=bandwidth)
    return Plan.from_dict(d)


def _lane(sim: Simulation, stage: int, replica: int = 0) -> list[tuple]:
    return sorted(((e.batch, e.kind, e.start, e.end) for e in sim.timeline.events
                   if e.stage == stage and e.replica == replica), key=lambda t: (t[0], t[2], t[3]))


def _spans(sim: Simulation, stage: int, kind: str) -> list[float]:
    return [end - start for _, k, start, end in _lane(sim, stage) if k == kind]


# ---- hand-computed schedules ----------------------------------------------------------------------------

def test_two_stage_schedule_event_by_event(mlp_plan):
    # stage 0: forward 1, backward 1, send 1 (cost 3); stage 1: forward 3, backward 3 (cost 6); one-batch queue
    plan = _synthetic(mlp_plan, [dict(compute=2.0, fwd=1, bwd=1, out=1), dict(compute=6.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=4, queue_depth=1)
    assert _lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "backward", 1, 2), (0, "send", 2, 3),
        (1, "forward", 3, 4), (1, "backward", 4, 5), (1, "send", 5, 6),     # room: stage 1 took batch 0 at 3
        (2, "forward", 6, 7), (2, "backward", 7, 8), (2, "send", 8, 10),    # waits for stage 1 to take batch 1 at 9
        (3, "forward", 10, 11), (3, "backward", 11, 12), (3, "send", 12, 16),  # ... batch 2 at 15
    ]
    assert _lane(sim, 1) == [
        (0, "receive", 0, 3), (0, "forward", 3, 6), (0, "backward", 6, 9),
        (1, "forward", 9, 12), (1, "backward", 12, 15),
        (2, "forward", 15, 18), (2, "backward", 18, 21),
        (3, "forward", 21, 24), (3, "backward", 24, 27),
    ]
    assert (sim.makespan, sim.warmup, sim.step_time) == (27, 9, 6)
    s0, s1 = sim.stages
    assert (s0.compute, s0.allreduce, s0.send, s0.blocked, s0.idle) == (8, 0, 4, 4, 11)
    assert (s1.compute, s1.allreduce, s1.send, s1.blocked, s1.idle) == (24, 0, 0, 0, 3)
    assert s1.utilisation == 24 / 27 and s0.utilisation == 8 / 27
    assert sim.throughput == mlp_plan.batch_size / 6 and sim.predicted == mlp_plan.batch_size / 6


def test_three_stage_schedule_with_a_replicated_stage_event_by_event(mlp_plan):
    # stage 1 on two replicas: forward 1, backward 2 (FLOPs 1:2), all-reduce 2*(1/2)*1 = 1, send 2/2 = 1
    plan = _synthetic(mlp_plan, [dict(compute=2.0, fwd=1, bwd=1, out=2),
                                 dict(compute=3.0, fwd=1, bwd=2, grad=1, out=2, replicas=2),
                                 dict(compute=2.0, fwd=5, bwd=5)])
    sim = simulate(plan, steps=3, queue_depth=1)
    assert [s.cost for s in sim.stages] == [s.cost for s in plan.stages] == [4, 5, 2]
    assert sim.timeline.lanes == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert _lane(sim, 0) == [
        (0, "forward", 0, 1), (0, "backward", 1, 2), (0, "send", 2, 4),
        (1, "forward", 4, 5), (1, "backward", 5, 6), (1, "send", 6, 8),
        (2, "forward", 8, 9), (2, "backward", 9, 10), (2, "send", 10, 12),
    ]
    assert _lane(sim, 1) == _lane(sim, 1, replica=1) == [
        (0, "receive", 0, 4), (0, "forward", 4, 5), (0, "backward", 5, 7), (0, "allreduce", 7, 8), (0, "send", 8, 9),
        (1, "forward", 9, 10), (1, "backward", 10, 12), (1, "allreduce", 12, 13), (1, "send", 13, 14),
        (2, "forward", 14, 15), (2, "backward", 15, 17), (2, "allreduce", 17, 18), (2, "send", 18, 19),
    ]
    assert _lane(sim, 2) == [
        (0, "receive", 0, 9), (0, "forward", 9, 10), (0, "backward", 10, 11),
        (1, "receive", 11, 14), (1, "forward", 14, 15), (1, "backward", 15, 16),
        (2, "receive", 16, 19), (2, "forward", 19, 20), (2, "backward", 20, 21),
    ]
    assert (sim.makespan, sim.warmup, sim.step_time) == (21, 11, 5)
    assert [(s.blocked, s.idle) for s in sim.stages] == [(0, 9), (0, 6), (0, 15)]
    assert sim.stages[1].allreduce == 3 and sim.stages[1].utilisation == 12 / 21


@pytest.mark.parametrize("depth, blocked", [(1, [0, 0, 1, 2, 2, 2]), (2, [0, 0, 0, 0, 1, 2]), (6, [0] * 6)])
def test_a_fast_stage_before_a_slow_one_blocks_on_a_full_queue(mlp_plan, depth, blocked):
    # stage 0: compute 1 (no FLOPs counted: all forward), send 1; stage 1: compute 4
    plan = _synthetic(mlp_plan, [dict(compute=1.0, out=1), dict(compute=4.0)])
    sim = simulate(plan, steps=6, queue_depth=depth)
    assert [d - 1 for d in _spans(sim, 0, "send")] == blocked
    assert sim.stages[0].blocked == sum(blocked)
    assert _spans(sim, 0, "backward") == [0] * 6 and _spans(sim, 0, "forward") == [1] * 6
    assert sim.step_time == 4 and sim.makespan == 2 + 6 * 4


# ---- steady state ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("computes", [[1.0, 3.0, 2.0], [3.0, 1.0, 2.0], [1.0, 2.0, 3.0], [2.5, 2.5, 1.0]])
@pytest.mark.parametrize("depth", [1, 2])
def test_the_steady_state_step_is_the_bottleneck_stage(mlp_plan, computes, depth):
    plan = _synthetic(mlp_plan, [dict(compute=c, fwd=1, bwd=2, out=1) for c in computes])
    sim = simulate(plan, queue_depth=depth)
    assert sim.step_time == pytest.approx(plan.bottleneck_cost, rel=1e-12)
    assert sim.throughput == pytest.approx(plan.batch_size / plan.bottleneck_cost, rel=1e-12) == sim.predicted


@pytest.mark.parametrize("name", ["mlp_plan", "replicated_plan", "pipebd_plan"])
def test_real_plans_run_at_their_predicted_rate(name, request):
    plan = request.getfixturevalue(name)
    sim = simulate(plan)
    assert [s.cost for s in sim.stages] == pytest.approx([s.cost for s in plan.stages], rel=1e-12)
    assert sim.step_time == pytest.approx(plan.bottleneck_cost, rel=1e-9)
    assert sim.throughput == pytest.approx(sim.predicted, rel=1e-9)
    assert sim.batch_size == plan.batch_size and sim.link_bandwidth == plan.link_bandwidth
    barrier = simulate(plan, decoupled=False)
    assert barrier.step_time == pytest.approx(sum(s.cost for s in plan.stages), rel=1e-9)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_barrier_after_every_batch_costs_the_sum_of_the_stages(mlp_plan, depth):
    plan = _synthetic(mlp_plan, [dict(compute=1.0, out=1), dict(compute=4.0, out=2), dict(compute=0.5)])
    sim = simulate(plan, steps=10, queue_depth=depth, decoupled=False)
    assert sim.step_time == 8.5 and sim.makespan == 85 and sim.warmup == 8.5
    assert [s.blocked for s in sim.stages] == [0, 0, 0]
    assert [s.idle for s in sim.stages] == [10 * 6.5, 10 * 2.5, 10 * 8]
    assert all(e.batch == 0 for e in sim.timeline.events if e.start < 8.5 and e.kind != "receive")


def test_the_bottleneck_stage_is_busy_almost_always_over_many_steps(mlp_plan):
    plan = _synthetic(mlp_plan, [dict(compute=1.0, out=1), dict(compute=1.5, out=1), dict(compute=3.0)])
    utilisation = [simulate(plan, steps=n).stages[2].utilisation for n in (4, 40, 400, 4000)]
    assert utilisation == sorted(utilisation) and utilisation[-1] > 0.999
    assert [s.utilisation for s in simulate(plan, steps=4000).stages] == pytest.approx([1 / 3, 1 / 2, 1], rel=1e-3)
    middle = _synthetic(mlp_plan, [dict(compute=1.0, out=1), dict(compute=3.0, out=1), dict(compute=2.0)])
    bottleneck = simulate(middle, steps=4000).stages[1]
    assert bottleneck.utilisation == pytest.approx(3 / 4, rel=1e-3)  # the send keeps it busy the rest of the time
    assert bottleneck.blocked == 0 and bottleneck.idle / 4000 == pytest.approx(0, abs=1e-2)


def test_one_step_is_its_own_step_time(mlp_plan):
    sim = simulate(mlp_plan, steps=1)
    assert sim.step_time == sim.makespan == sim.warmup == pytest.approx(sum(s.cost for s in mlp_plan.stages))


# ---- replicas, FLOP shares, bandwidth -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["replicated_plan", "pipebd_plan"])
def test_a_replicated_stage_has_identical_lanes_and_all_reduces_its_gradients(name, request):
    plan = request.getfixturevalue(name)
    sim = simulate(plan, steps=5)
    first = plan.stages[0]
    assert sim.timeline.lanes == [(0, 0), (0, 1), (1, 0)]
    assert _lane(sim, 0, 0) == _lane(sim, 0, 1)
    head_grads = first.head.param_count * 4 if plan.mode == "ppll" else 0
    assert plan.mode == "pipebd" or head_grads > 0
    sync = 2 * (2 - 1) / 2 * (first.grad_bytes + head_grads) / plan.link_bandwidth
    assert _spans(sim, 0, "allreduce") == pytest.approx([sync] * 5, rel=1e-12) and sync > 0
    assert sim.stages[0].allreduce == pytest.approx(5 * sync, rel=1e-12)
    assert not _spans(sim, 1, "allreduce") and sim.stages[1].allreduce == 0
    compute = first.compute_cost - sync
    fwd = first.flops_fwd + (first.head.flops_fwd if plan.mode == "ppll" else first.aux_flops)
    total = fwd + first.flops_bwd + (first.head.flops_bwd if plan.mode == "ppll" else 0)
    assert _spans(sim, 0, "forward")[0] == pytest.approx(compute * fwd / total, rel=1e-12)
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

def _reference(work: list[tuple[float, float]], steps: int, depth: int, decoupled: bool) -> dict:
    """Start, compute-done and end times of every (stage, batch) from a heap of timed events.

    ``work[j] = (compute + all-reduce, send)``. State changes at one instant are applied until none is left,
    so the order of simultaneous events does not matter.
    """
    n = len(work)
    heap: list = []
    order = itertools.count()
    inbox = [deque() for _ in range(n)]
    taken = [0] * n
    idle = [True] * n
    waiting: list = [None] * n
    start, done, end = {}, {}, {}

    def schedule(t, kind, j, b):
        heapq.heappush(heap, (t, next(order), kind, j, b))

    def progress(t):
        changed = True
        while changed:
            changed = False
            for j in range(n):
                ready = inbox[j][0] if inbox[j] else None
                if j == 0 and taken[0] < steps:
                    b = taken[0]
                    ready = b if decoupled or b == 0 or all((k, b - 1) in end for k in range(n)) else None
                if idle[j] and ready is not None:
                    if j > 0:
                        inbox[j].popleft()
                    idle[j], taken[j], start[j, ready] = False, taken[j] + 1, t
                    schedule(t + work[j][0], "done", j, ready)
                    changed = True
                b = waiting[j]
                if b is not None and (j == n - 1 or b < depth or taken[j + 1] > b - depth):
                    waiting[j] = None
                    if j == n - 1:
                        end[j, b], idle[j] = t, True
                    else:
                        schedule(t + work[j][1], "sent", j, b)
                    changed = True

    progress(0.0)
    while heap:
        t, _, kind, j, b = heapq.heappop(heap)
        if kind == "done":
            done[j, b], waiting[j] = t, b
        else:
            end[j, b], idle[j] = t, True
            inbox[j + 1].append(b)
        progress(t)
    return {"start": start, "done": done, "end": end}


def _random_case(rng: random.Random, base: Plan) -> tuple[Plan, dict, list[tuple[float, float]]]:
    n = rng.randint(1, 6)
    bandwidth = rng.uniform(100.0, 2000.0)
    specs = [dict(compute=rng.choice([0.0, rng.uniform(0.0, 3.0)]), fwd=rng.randint(0, 5), bwd=rng.randint(0, 5),
                  grad=rng.randint(0, 2000), out=rng.randint(0, 3000), replicas=rng.randint(1, 4)) for _ in range(n)]
    plan = _synthetic(base, specs, bandwidth)
    options = dict(steps=rng.randint(1, 12), queue_depth=rng.randint(1, 3), decoupled=rng.random() < 0.7,
                   link_bandwidth=rng.choice([None, rng.uniform(100.0, 2000.0)]))
    bw = options["link_bandwidth"] or bandwidth
    work = [(s["compute"] + 2 * (s["replicas"] - 1) / s["replicas"] * s["grad"] / bw,
             0.0 if j == n - 1 else s["out"] / bw / s["replicas"]) for j, s in enumerate(specs)]
    return plan, options, work


def test_an_independent_event_driven_simulation_agrees_on_random_plans(mlp_plan):
    rng = random.Random(12345)
    close = dict(rel=1e-12, abs=1e-12)
    for case in range(50):
        plan, options, work = _random_case(rng, mlp_plan)
        sim = simulate(plan, **options)
        ref = _reference(work, options["steps"], options["queue_depth"], options["decoupled"])
        n = plan.num_stages
        assert sim.timeline.lanes == [(j, r) for j, s in enumerate(plan.stages) for r in range(s.replicas)]
        for j, s in enumerate(plan.stages):
            lanes = [[(b, k, t0, t1) for b, k, t0, t1 in _lane(sim, j, r)] for r in range(s.replicas)]
            assert all(lane == lanes[0] for lane in lanes), case
            spans = {(b, k): (t0, t1) for b, k, t0, t1 in lanes[0]}
            for b in range(options["steps"]):
                got_start = spans[b, "forward"][0]
                got_done = spans[b, "allreduce" if s.replicas > 1 else "backward"][1]
                got_end = spans[b, "send"][1] if j < n - 1 else got_done
                expected = (ref["start"][j, b], ref["done"][j, b], ref["end"][j, b])
                assert (got_start, got_done, got_end) == pytest.approx(expected, **close), (case, j, b)
                if (b, "receive") in spans:
                    assert spans[b, "receive"][1] == got_start and spans[b, "receive"][0] < got_start
            steps = options["steps"]
            blocked = sum(ref["end"][j, b] - ref["done"][j, b] for b in range(steps)) - steps * (
                0.0 if j == n - 1 else work[j][1])
            assert sim.stages[j].blocked == pytest.approx(blocked, **close), case
            assert (sim.stages[j].compute + sim.stages[j].allreduce + sim.stages[j].send + sim.stages[j].blocked
                    + sim.stages[j].idle) == pytest.approx(sim.makespan, **close)
        assert sim.makespan == pytest.approx(max(ref["end"].values()), **close)
        assert sim.warmup == pytest.approx(ref["end"][n - 1, 0], **close)


# ---- output and errors ----------------------------------------------------------------------------------

def test_results_print_and_serialise(mlp_plan):
    sim = simulate(mlp_plan, steps=8)
    d = json.loads(json.dumps(sim.to_dict()))
    assert "timeline" not in d and len(d["stages"]) == 3 and d["steps"] == 8 and d["queue_depth"] == 2
    assert d["step_time"] == sim.step_time and d["stages"][1]["blocked"] == sim.stages[1].blocked
    lines = sim.table().splitlines()
    assert lines[0].split() == ["stage", "replicas", "busy", "ms", "send", "ms", "blocked", "ms", "idle", "ms",
                                "util", "%"]
    assert len(lines) == 2 + 3 + 1 and "samples/s" in lines[-1] and "8 steps" in lines[-1]
    assert str(sim) == sim.table()
    assert sim.timeline.source == "simulated" and sim.timeline.meta["steps"] == 8
    zero = _synthetic(mlp_plan, [dict(compute=0.0, out=0), dict(compute=0.0)])
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

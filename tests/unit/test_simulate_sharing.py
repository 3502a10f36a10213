"""The simulator on shared processors (``simulate(plan, cores=N)``): stages on the CPU share its cores, stages on
one accelerator share it; hand-computed traces, the steady state of a saturated machine, what is reported, and
a check of every simulated timeline on random plans against the rules it must obey."""

import random

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
def base() -> Plan:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with quiet():
        return ppll_compile.plan(model, 2, example_inputs=(torch.randn(4, 8),))


@pytest.fixture(scope="module")
def pipebd_base() -> Plan:
    with quiet():
        return ppll_compile.plan(conv_student(), teacher=conv_teacher(), example_inputs=(CONV_X,),
                                 split_points=["5"])


def _placed(plan: Plan, devices: list[str]) -> Plan:
    """``plan`` with stage ``j`` on ``devices[j]``."""
    d = plan.to_dict()
    for s, device in zip(d["stages"], devices):
        s["device"] = device
    return Plan.from_dict(d)


def _plan(base: Plan, specs: list[dict], devices: list[str] | None = None, bandwidth: float = 1.0) -> Plan:
    return _placed(synthetic_plan(base, specs, bandwidth), devices or ["cpu"] * len(specs))


def _timed(sim: Simulation, stage: int) -> list[tuple]:
    """The lane of ``stage`` without its spans of no time."""
    return [span for span in lane(sim, stage) if span[3] > span[2]]


# ---- hand-computed traces -------------------------------------------------------------------------------

def test_two_identical_stages_on_one_core_run_at_half_speed_while_both_are_busy(base):
    # each stage: forward 1, backward 1 (cost 2), sends of no time. Alone each part takes 1; while both stages
    # compute, each takes 2. Stage 0 runs batch 0's forward alone (0..1); from then on both are busy until
    # stage 0 ends at 11, and stage 1 finishes its last backward alone (11..12): 12 s for 12 s of work.
    plan = _plan(base, [dict(compute=2.0, fwd=1, bwd=1, out=0), dict(compute=2.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=3, cores=1)
    assert _timed(sim, 0) == [(0, "forward", 0, 1), (0, "backward", 1, 3), (1, "forward", 3, 5),
                              (1, "backward", 5, 7), (2, "forward", 7, 9), (2, "backward", 9, 11)]
    assert _timed(sim, 1) == [(0, "receive", 0, 1), (0, "forward", 1, 3), (0, "backward", 3, 5),
                              (1, "forward", 5, 7), (1, "backward", 7, 9), (2, "forward", 9, 11),
                              (2, "backward", 11, 12)]
    assert (sim.makespan, sim.warmup, sim.step_time) == (12, 5, 4)  # batch 2 (9..12) ends in the drain
    assert [(s.compute, s.idle, s.utilisation) for s in sim.stages] == [(11, 1, 11 / 12), (11, 1, 11 / 12)]
    assert [s.speed for s in sim.stages] == [6 / 11, 6 / 11]
    assert [s.cost for s in sim.stages] == [2, 2]  # the work, as on a processor of its own
    assert sim.cores == 1 and sim.shared == "2 stages share 1 CPU core: each busy stage runs at 1/busy speed"
    alone = simulate(plan, steps=3)  # every stage its own processor: stage 1 ends at 1 + 3 x 2
    assert alone.makespan == 7 and alone.shared == "" and alone.cores is None


def test_a_span_speeds_up_when_another_stage_stops(base):
    # three stages, all forward (no FLOPs counted), sends of no time: stage 0 and 1 work 1, stage 2 works 2;
    # two cores. 0..1 stage 0 alone; 1..2 stages 0 and 1 (full speed); at 2 all three are busy: 2/3 speed, so
    # stages 0 and 1 end their batch at 3.5, when stage 2 has done 1 of its 2; then stages 1 and 2 at full
    # speed: both end at 4.5; then stage 2 alone. Without sharing the makespan is 8.
    plan = _plan(base, [dict(compute=1.0, out=0), dict(compute=1.0, out=0), dict(compute=2.0)])
    sim = simulate(plan, steps=3, cores=2)
    assert _timed(sim, 0) == [(0, "forward", 0, 1), (1, "forward", 1, 2), (2, "forward", 2, 3.5)]
    assert _timed(sim, 1) == [(0, "receive", 0, 1), (0, "forward", 1, 2), (1, "forward", 2, 3.5),
                              (2, "forward", 3.5, 4.5)]
    assert _timed(sim, 2) == [(0, "receive", 0, 2), (0, "forward", 2, 4.5), (1, "forward", 4.5, 6.5),
                              (2, "forward", 6.5, 8.5)]
    assert sim.makespan == 8.5 and simulate(plan, steps=3).makespan == 8
    assert sim.shared == "3 stages share 2 CPU cores: each busy stage runs at 2/busy speed while more than 2 are busy"


def test_transfers_take_a_cpu_core_but_not_an_accelerator(base):
    # stage 0: forward 1 (no FLOPs), send 1; stage 1: forward 2. Stage 0's second forward (2..) runs beside stage
    # 1's first: half speed, ends at 4 with stage 1 half done. Then stage 0 sends batch 1 beside stage 1's rest:
    # on one CPU core the send computes too, both at half speed until 6, then batch 1 on stage 1 until 8; on one
    # GPU the send leaves the device to stage 1, both end at 5, stage 1 ends at 7. On two devices: 6, as alone.
    specs = [dict(compute=1.0, out=1), dict(compute=2.0)]
    cpu = simulate(_plan(base, specs), steps=2, cores=1)
    gpu = simulate(_plan(base, specs, ["cuda:0", "cuda"]), steps=2, cores=1)  # "cuda" is cuda:0
    assert _timed(cpu, 0) == [(0, "forward", 0, 1), (0, "send", 1, 2), (1, "forward", 2, 4), (1, "send", 4, 6)]
    assert _timed(cpu, 1) == [(0, "receive", 0, 2), (0, "forward", 2, 6), (1, "forward", 6, 8)]
    assert _timed(gpu, 0) == [(0, "forward", 0, 1), (0, "send", 1, 2), (1, "forward", 2, 4), (1, "send", 4, 5)]
    assert _timed(gpu, 1) == [(0, "receive", 0, 2), (0, "forward", 2, 5), (1, "forward", 5, 7)]
    assert gpu.shared == "2 stages share cuda:0: each busy stage runs at 1/busy speed"
    assert cpu.stages[0].send == 3 and gpu.stages[0].send == 2
    apart = simulate(_plan(base, specs, ["cuda:0", "cuda:1"]), steps=2, cores=1)
    assert apart.makespan == 6 and apart.shared == "" and apart.timeline.events == simulate(
        _plan(base, specs, ["cuda:0", "cuda:1"]), steps=2).timeline.events


def test_the_replicas_of_a_cpu_stage_are_threads_that_share_the_cores(base):
    # one stage on two replicas, compute 1 per batch: on one core the two replicas run at half speed
    plan = _plan(base, [dict(compute=1.0, replicas=2)])
    sim = simulate(plan, steps=3, cores=1)
    assert sim.makespan == 6 and [s.speed for s in sim.stages] == [0.5]
    assert sim.shared == "stage 0 (2 threads with its replicas) shares 1 CPU core: each busy thread runs at 1/busy " \
                         "speed"
    assert _timed(sim, 0) == [(b, "forward", 2 * b, 2 * b + 2) for b in range(3)]
    assert simulate(plan, steps=3, cores=2).makespan == 3
    # on an accelerator only the first replica is on the stage's device (the plan names no other): nothing shared
    assert simulate(_placed(plan, ["cuda:0"]), steps=3, cores=1).makespan == 3


def test_the_barrier_and_a_full_queue_wait_without_a_core(base):
    # stage 0: forward 1 (no FLOPs), send 0; stage 1: forward 3, one core, one-batch queue, barrier. Batch 0:
    # stage 0 alone 0..1, stage 1 alone 1..4 (stage 0 waits at the barrier, taking no core); batch 1 likewise
    plan = _plan(base, [dict(compute=1.0, out=0), dict(compute=3.0)])
    sim = simulate(plan, steps=2, queue_depth=1, cores=1, decoupled=False)
    assert sim.makespan == 8 and [s.barrier for s in sim.stages] == [6, 0]
    assert _timed(sim, 1) == [(0, "receive", 0, 1), (0, "forward", 1, 4), (1, "receive", 4, 5), (1, "forward", 5, 8)]
    # decoupled: stages 0 and 1 work 1, stage 2 works 4, sends of no time, two cores, one-batch queues. From 2
    # to 5 three stages are busy (2/3 speed); at 5 stage 1's output of batch 2 finds no room (stage 2 has not
    # taken batch 1): the send waits, taking no core, and stage 2 runs alone at full speed until 7
    fast = _plan(base, [dict(compute=1.0, out=0), dict(compute=1.0, out=0), dict(compute=4.0)])
    sim = simulate(fast, steps=4, queue_depth=1, cores=2)
    assert _timed(sim, 0) == [(0, "forward", 0, 1), (1, "forward", 1, 2), (2, "forward", 2, 3.5),
                              (3, "forward", 3.5, 5)]
    assert _timed(sim, 1) == [(0, "receive", 0, 1), (0, "forward", 1, 2), (1, "forward", 2, 3.5),
                              (2, "forward", 3.5, 5), (2, "send", 5, 7),     # blocked until stage 2 takes batch 1
                              (3, "forward", 7, 8), (3, "send", 8, 11)]      # ... and batch 2
    assert _timed(sim, 2) == [(0, "receive", 0, 2), (0, "forward", 2, 7), (1, "forward", 7, 11),
                              (2, "forward", 11, 15), (3, "forward", 15, 19)]
    assert [s.blocked for s in sim.stages] == [0, 5, 0] and sim.makespan == 19


# ---- the steady state of a saturated machine ------------------------------------------------------------

@pytest.mark.parametrize("cores", [1, 2, 3, 4])
def test_equal_stages_on_fewer_cores_reach_cores_over_total_work(base, cores):
    # 4 stages of 2 s each: 8 s of work per batch. With fewer cores than stages every core is busy at the steady
    # state: a batch every 8 / cores s, never faster than the slowest stage (2 s)
    plan = _plan(base, [dict(compute=2.0, fwd=1, bwd=1, out=0)] * 3 + [dict(compute=2.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=200, cores=cores)
    assert sim.step_time == pytest.approx(max(2.0, 8.0 / cores), rel=1e-9)
    assert sim.throughput == pytest.approx(plan.batch_size * min(cores / 8.0, 1 / 2.0), rel=1e-9)
    assert (sim.shared != "") == (cores < 4)
    assert [s.speed for s in sim.stages] == pytest.approx([min(1.0, cores / 4)] * 4, rel=1e-2)


def test_nothing_shared_is_the_equations_exactly(base, pipebd_base):
    # as many cores as threads, or every stage on its own device: the same result as without cores, bit for bit
    plan = _plan(base, [dict(compute=1.5, fwd=1, bwd=2, out=1), dict(compute=3.0, fwd=2, bwd=1, out=2, replicas=2),
                        dict(compute=2.0, fwd=1, bwd=1, step=0.5)], bandwidth=2.0)
    for cores, devices in ((4, ["cpu"] * 3), (1, ["cuda:0", "cuda:1", "cpu"])):
        placed = _placed(plan, devices)
        sim, alone = simulate(placed, steps=9, cores=cores), simulate(placed, steps=9)
        assert sim.timeline.events == alone.timeline.events and sim.shared == "" and sim.cores == cores
        assert sim.stages == alone.stages and sim.table() == alone.table()
        assert (sim.makespan, sim.step_time) == (alone.makespan, alone.step_time)
    real = _placed(pipebd_base, ["cpu", "cpu"])
    assert simulate(real, cores=2).timeline.events == simulate(real).timeline.events


def test_a_real_plan_on_too_few_cores_is_slower_by_at_most_the_oversubscription(base):
    plan = _placed(base, ["cpu", "cpu"])
    shared, alone = simulate(plan, cores=1), simulate(plan)
    work = sum(s.cost for s in plan.stages)
    assert shared.step_time == pytest.approx(work, rel=1e-6)  # one core: one batch per total work
    assert alone.step_time < shared.step_time <= 2 * alone.step_time


# ---- what is reported -----------------------------------------------------------------------------------

def test_the_table_and_results_say_what_was_shared(base):
    plan = _plan(base, [dict(compute=2.0, fwd=1, bwd=1, out=0)] * 3 + [dict(compute=2.0, fwd=1, bwd=1)])
    sim = simulate(plan, steps=8, cores=2)
    lines = sim.table().splitlines()
    assert lines[0].split()[-2:] == ["speed", "%"] and len(lines) == 2 + 4 + 2
    assert "samples/s" in lines[-2] and lines[-2].endswith("  decoupled")
    assert lines[-1] == "shared: 4 stages share 2 CPU cores: each busy stage runs at 2/busy speed while more than " \
                        "2 are busy"
    d = sim.to_dict()
    assert d["cores"] == 2 and d["shared"] == sim.shared and d["stages"][0]["speed"] == sim.stages[0].speed < 1
    assert sim.timeline.meta["cores"] == 2
    mixed = _plan(base, [dict(compute=1.0, out=0)] * 4 + [dict(compute=1.0)],
                  ["cuda:1", "cpu", "cuda:1", "cpu", "cpu"])
    assert simulate(mixed, cores=2).shared == (
        "stages 0 and 2 share cuda:1: each busy stage runs at 1/busy speed; stages 1, 3 and 4 share 2 CPU cores: "
        "each busy stage runs at 2/busy speed while more than 2 are busy")


# ---- every simulated timeline obeys the rules -----------------------------------------------------------

_CORE = ("forward", "backward", "step")


def _parts(plan: Plan, bandwidth: float) -> list[dict]:
    """Seconds of each part of one batch per stage, from the module docstring's rules."""
    parts = []
    for s in plan.stages:
        sync = 2 * (s.replicas - 1) / s.replicas * (s.grad_bytes + (4 * s.head.param_count if plan.mode == "ppll"
                                                                    and not s.is_last else 0)) / bandwidth
        compute = s.compute_cost - plan.allreduce_cost(s)
        rest = compute - s.step_cost
        if plan.mode == "ppll":
            first, fwd = s.flops_fwd, s.flops_fwd + s.head.flops_fwd
            total = fwd + s.flops_bwd + s.head.flops_bwd
        else:
            first, fwd = s.aux_flops, s.aux_flops + s.flops_fwd
            total = fwd + s.flops_bwd
        early, forward = (rest * first / total, rest * fwd / total) if total else (rest, rest)
        parts.append(dict(early=early, late=forward - early, backward=rest - forward, allreduce=sync,
                          step=s.step_cost, send=0.0 if s.is_last else s.boundary[0].bytes / bandwidth / s.replicas))
    return parts


def _check(sim: Simulation, plan: Plan, cores: int, depth: int, decoupled: bool, at: object) -> None:
    """Every rule of the model, read off the timeline: FIFO starts, early or deferred sends by the room in the
    queue, the barrier before the step, and every span's work done at the speed processor sharing gives it."""
    n, steps, tol = plan.num_stages, sim.steps, 1e-9 * max(1.0, sim.makespan)
    parts = _parts(plan, sim.link_bandwidth)
    lanes = [[(b, k, t0, t1) for b, k, t0, t1 in lane(sim, j)] for j in range(n)]
    spans = [{b: [(k, t0, t1) for c, k, t0, t1 in lanes[j] if c == b] for b in range(steps)} for j in range(n)]
    start = [[[t0 for k, t0, _ in spans[j][b] if k == "forward"][0] for b in range(steps)] for j in range(n)]
    sent = [[[t1 for k, _, t1 in spans[j][b] if k == "send"][-1] if j < n - 1 else None for b in range(steps)]
            for j in range(n)]
    done = [[[t1 for k, _, t1 in spans[j][b] if k == ("allreduce" if s.replicas > 1 else "backward")][0]
             for b in range(steps)] for j, s in enumerate(plan.stages)]
    pieces = []  # (stage, start, end, work, takes a processor)
    for j, s in enumerate(plan.stages):
        w, cpu = parts[j], s.device == "cpu"
        free = 0.0
        for b in range(steps):
            kinds = [k for k, _, _ in spans[j][b]]
            arrival = sent[j - 1][b] if j > 0 else 0.0
            assert start[j][b] == pytest.approx(max(arrival, free), abs=tol), (at, j, b)
            room = start[j + 1][b - depth] if j < n - 1 and b >= depth else 0.0
            forwards = [(t0, t1) for k, t0, t1 in spans[j][b] if k == "forward"]
            early = j < n - 1 and kinds.index("send") < kinds.index("backward")
            if early:
                assert room <= forwards[0][1] + tol, (at, j, b)
            elif j < n - 1:
                assert room >= forwards[0][1] - tol, (at, j, b)
            release = max(done[k][b] for k in range(n)) if not decoupled else done[j][b]
            stepped = release + 0.0
            for k, t0, t1 in spans[j][b]:
                work = {"forward": w["early"] if early and (t0, t1) == forwards[0] else
                        w["late"] if early else w["early"] + w["late"],
                        "backward": w["backward"], "allreduce": w["allreduce"], "step": w["step"],
                        "send": w["send"]}.get(k)
                if k == "step":
                    assert t0 == pytest.approx(release, abs=tol), (at, j, b)
                    stepped = t1
                if k == "send" and not early:
                    assert t0 == pytest.approx(stepped, abs=tol), (at, j, b)
                    t0 = max(t0, room)  # the transfer follows the wait for room
                if work is not None:
                    pieces.append((j, t0, t1, work, k in _CORE or (cpu and k in ("send", "allreduce"))))
            free = max(spans[j][b][-1][2], release)
    # processor sharing: between two consecutive span boundaries, a busy thread on P processors shared by B busy
    # threads runs at min(1, P / B); the integral of that speed over a span is its work
    groups = {j: (s.device.split(":")[0] if s.device == "cpu" else s.device if ":" in s.device else s.device + ":0")
              for j, s in enumerate(plan.stages)}
    threads = {j: s.replicas if groups[j] == "cpu" else 1 for j, s in enumerate(plan.stages)}
    done_work = [0.0] * len(pieces)
    cuts = sorted({t for _, t0, t1, _, _ in pieces for t in (t0, t1)})
    for a, z in zip(cuts, cuts[1:]):
        if z - a <= tol:
            continue
        live = [i for i, (_, t0, t1, _, _) in enumerate(pieces) if t0 <= a + tol and t1 >= z - tol]
        busy: dict[str, int] = {}
        for i in live:
            j, *_, uses = pieces[i]
            busy[groups[j]] = busy.get(groups[j], 0) + (threads[j] if uses else 0)
        for i in live:
            j, *_, uses = pieces[i]
            processors = cores if groups[j] == "cpu" else 1
            speed = min(1.0, processors / busy[groups[j]]) if uses else 1.0
            done_work[i] += speed * (z - a)
    for (j, t0, t1, work, _), got in zip(pieces, done_work):
        assert got == pytest.approx(work, rel=1e-7, abs=tol), (at, j, t0, t1)
    total = sum(s.compute + s.allreduce + s.send + s.blocked + s.barrier + s.idle for s in sim.stages)
    assert total == pytest.approx(n * sim.makespan, rel=1e-9), at
    assert all(0 < s.speed <= 1 for s in sim.stages), at


def test_random_shared_schedules_obey_every_rule(base, pipebd_base):
    rng = random.Random(2024)
    for case in range(60):
        n = rng.randint(1, 5)
        specs = [dict(compute=rng.choice([0.0, rng.uniform(0.1, 3.0)]), fwd=rng.randint(0, 5),
                      bwd=rng.randint(0, 5), head_fwd=rng.randint(0, 2), head_bwd=rng.randint(0, 2),
                      aux=rng.randint(0, 3), grad=rng.randint(0, 2000), out=rng.randint(0, 3000),
                      replicas=rng.randint(1, 3)) for _ in range(n)]
        for spec in specs:
            spec["step"] = rng.choice([0.0, spec["compute"] * rng.uniform(0, 0.5)])
        devices = [rng.choice(["cpu", "cpu", "cuda:0", "cuda:1"]) for _ in range(n)]
        plan = _plan(rng.choice([base, pipebd_base]), specs, devices, bandwidth=rng.uniform(300.0, 3000.0))
        cores, depth, decoupled = rng.randint(1, 3), rng.randint(1, 3), rng.random() < 0.6
        sim = simulate(plan, steps=rng.randint(1, 10), queue_depth=depth, decoupled=decoupled, cores=cores)
        _check(sim, plan, cores, depth, decoupled, case)

"""Hybrid (replicated-stage) partitioning: the exact solvers against brute force, hand-checked layouts, errors."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re

import pytest
from ppll_compile.partitioners import InfeasibleMemoryError, PartitionError, Problem, bottleneck, brute_force
from ppll_compile.partitioners.replicas import (
    Layout,
    ReplicaProblem,
    brute_force_replicated,
    layout_costs,
    solve_fixed_replicas,
    solve_replicated,
)
from tests.helpers import (
    replicas_check_valid,
    replicas_on_nodes,
    replicas_random_problem,
    replicas_same_as_brute_force,
    replicas_stage_memory,
)


@pytest.mark.parametrize("group", range(4))
def test_solver_matches_brute_force(group: int) -> None:
    solved = [replicas_same_as_brute_force(replicas_random_problem(seed), seed) for seed in range(100 * group,
                                                                                                  100 * group + 100)]
    assert 0 < sum(found is not None for found in solved) < 100  # both solved problems and refusals


def test_a_stage_start_saves_its_first_segments_input_gradient() -> None:
    problem = ReplicaProblem(compute=[4, 4, 4], start=[0, 3, 3], devices=2)
    assert layout_costs(problem, [1, 3], [1, 1]) == [4, 5]
    assert layout_costs(problem, [2, 3], [1, 1]) == [8, 1]
    assert solve_fixed_replicas(problem, [1, 1]).ends == (1, 3)


def test_random_problems_cover_the_interesting_cases() -> None:
    solved, infeasible = [], 0
    for seed in range(400):
        problem = replicas_random_problem(seed)
        try:
            solved.append((problem, solve_replicated(problem)))
        except InfeasibleMemoryError:
            infeasible += 1
    assert infeasible >= 20 and len(solved) >= 250
    assert sum(max(layout.replicas) > 1 for _, layout in solved) >= 50
    assert sum(len(layout.ends) > 1 for _, layout in solved) >= 50
    assert sum(layout.devices < problem.devices for problem, layout in solved) >= 50


def test_dominant_segment_is_replicated() -> None:
    # Syncing segment 2's gradients on r replicas costs 2 (r-1)/r * 0.75 s. By hand, on 4 devices:
    #   one stage, r=4: 8/4 + 1.5*0.75 = 3.125;  r=3: 8/3 + 1 = 3.67
    #   [0,1)|[1,3) on (1, 3): max(1, 7/3 + 1) = 3.33;  [0,2)|[2,3) on (1, 3): max(2, 6/3 + 1) = 3
    #   [0,2)|[2,3) on (2, 2): max(1, 3 + 0.75) = 3.75;  three stages on (1, 1, 2): max(1, 1, 3 + 0.75) = 3.75
    problem = ReplicaProblem(compute=[1, 1, 6], grad_bytes=[0, 0, 0.75], allreduce_bandwidth=1.0, devices=4)
    layout = solve_replicated(problem)
    assert (layout.ends, layout.replicas) == ((2, 3), (1, 3))
    assert layout.costs == pytest.approx((2.0, 3.0))
    # Without all-reduce cost a single stage on all four devices is as fast (8/4 = 2) and has fewer stages.
    free = solve_replicated(dataclasses.replace(problem, grad_bytes=None))
    assert (free.ends, free.replicas, free.costs) == ((3,), (4,), (2.0,))


def test_expensive_allreduce_disables_replication() -> None:
    # Replicating any stage costs at least 2 * 1/2 * 1e12 / 25e9 = 40 s, so every stage runs once; the best
    # plain split of [3, 1, 2, 2] is 3 | 1 2 | 2 (bottleneck 3), on 3 devices rather than 3 | 1 | 2 | 2 on 4.
    problem = ReplicaProblem(compute=[3, 1, 2, 2], grad_bytes=[1e12] * 4, devices=4)
    layout = solve_replicated(problem)
    assert (layout.ends, layout.replicas, layout.costs) == ((1, 3, 4), (1, 1, 1), (3.0, 3.0, 2.0))


def test_extra_devices_are_left_idle_when_they_do_not_help() -> None:
    layout = solve_replicated(ReplicaProblem(compute=[1], grad_bytes=[1e12], devices=4))
    assert (layout.ends, layout.replicas, layout.costs) == ((1,), (1,), (1.0,))
    layout = solve_replicated(ReplicaProblem(compute=[0, 0], devices=3))
    assert (layout.ends, layout.replicas, layout.costs) == ((2,), (1,), (0.0,))
    layout = solve_replicated(ReplicaProblem(compute=[1], devices=3, max_replicas=2))
    assert (layout.ends, layout.replicas, layout.costs) == ((1,), (2,), (0.5,))


def test_fixed_stage_count() -> None:
    problem = ReplicaProblem(compute=[1, 1, 6], devices=4, stages=2)
    layout = solve_replicated(problem)
    # 1 1 | 6 on (1, 3) costs max(2, 2) = 2, as fast as any layout can be (8 s of work on 4 devices).
    assert (layout.ends, layout.replicas, layout.costs) == ((2, 3), (1, 3), (2.0, 2.0))
    layout = solve_replicated(dataclasses.replace(problem, stages=3))
    assert (layout.ends, layout.replicas, layout.costs) == ((1, 2, 3), (1, 1, 2), (1.0, 1.0, 3.0))


@pytest.mark.parametrize("seed", range(40))
def test_no_replication_is_plain_min_max_partition(seed: int) -> None:
    rng = random.Random(seed)
    n, devices = rng.randint(1, 7), rng.randint(1, 6)
    compute, head, comm = ([rng.randint(0, 5) for _ in range(n)] for _ in range(3))
    memory, limit = [rng.randint(0, 3) for _ in range(n)], rng.choice([None, 3, 5])
    problem = ReplicaProblem(
        compute=compute, head=head, comm=comm, memory=memory, memory_limit=limit, devices=devices, max_replicas=1
    )
    plain = Problem(compute=compute, head=head, comm=comm, memory=memory, memory_limit=limit)
    best = []
    for k in range(1, min(n, devices) + 1):
        try:
            best.append((bottleneck(plain, brute_force(plain, k)), k))
        except InfeasibleMemoryError:
            pass
    if not best:
        with pytest.raises(InfeasibleMemoryError):
            solve_replicated(problem)
        return
    layout = solve_replicated(problem)
    assert set(layout.replicas) == {1}
    assert (layout.bottleneck, len(layout.ends)) == min(best)


def test_brute_force_enumerates_every_layout() -> None:
    # 3 segments on 3 devices: one stage on 1, 2 or 3 replicas (3 layouts), two stages at either of 2 split
    # points on (1, 1), (1, 2) or (2, 1) (6 layouts), three stages on (1, 1, 1) (1 layout): 10 in all.
    from ppll_compile.partitioners.replicas import _assignments

    assert [list(_assignments(k, 3 - k, 3)) for k in (1, 2, 3)] == \
        [[(1,), (2,), (3,)], [(1, 1), (1, 2), (2, 1)], [(1, 1, 1)]]
    layouts = [(cuts, r) for k in (1, 2, 3) for cuts in itertools.combinations((1, 2), k - 1)
               for r in itertools.product((1, 2, 3), repeat=k) if sum(r) <= 3]
    assert len(layouts) == 10
    for k, spare, cap in [(1, 2, 3), (2, 1, 3), (3, 0, 3), (4, 6, 2), (3, 2, 2), (2, 5, 4)]:
        every = [r for r in itertools.product(range(1, cap + 1), repeat=k) if sum(r) <= k + spare]
        assert list(_assignments(k, spare, cap)) == every, (k, spare, cap)
    assert len(list(_assignments(4, 6, 2))) == 2**4  # the replica cap binds before the device count


def test_midsize_layout_fits_its_cap_and_breaks_ties_as_documented() -> None:
    rng = random.Random(0)
    n = 48
    problem = ReplicaProblem(
        compute=[rng.uniform(0, 2) for _ in range(n)],
        head=[rng.uniform(0, 0.2) for _ in range(n)],
        grad_bytes=[rng.uniform(0, 1e9) for _ in range(n)],
        memory=[rng.uniform(0, 1e9) for _ in range(n)],
        memory_limit=2.5e9,
        devices=64,
    )
    layout = solve_replicated(problem)
    replicas_check_valid(problem, layout)
    free = solve_replicated(dataclasses.replace(problem, memory_limit=None))
    assert max(replicas_stage_memory(problem, free)) > problem.memory_limit  # the cap binds ...
    assert free.bottleneck < layout.bottleneck  # ... and costs speed
    # no better cuts for the chosen replicas; one device fewer is slower; one stage fewer is slower or uses more
    assert solve_fixed_replicas(problem, layout.replicas).bottleneck == layout.bottleneck
    assert solve_replicated(dataclasses.replace(problem, devices=layout.devices - 1)).bottleneck > layout.bottleneck
    fewer = solve_replicated(dataclasses.replace(problem, stages=len(layout.ends) - 1))
    assert (fewer.bottleneck, fewer.devices) > (layout.bottleneck, layout.devices)
    more = dataclasses.replace(problem, stages=16)
    fixed = solve_replicated(more)
    replicas_check_valid(more, fixed)
    assert (fixed.bottleneck, fixed.devices) >= (layout.bottleneck, layout.devices)


def test_infeasible_memory_reports_smallest_limit() -> None:
    problem = ReplicaProblem(compute=[1, 1, 1], memory=[4, 4, 4], memory_limit=5, devices=2)
    expected = (
        "no layout of 3 segments on 2 devices fits a memory limit of 5.0 B per device; "
        "the smallest limit that works is 8.0 B (raise memory_limit or use more devices)"
    )
    for solver in (solve_replicated, brute_force_replicated):
        with pytest.raises(InfeasibleMemoryError, match=re.escape(expected)) as caught:
            solver(problem)
        assert caught.value.min_limit == 8.0
    layout = solve_replicated(dataclasses.replace(problem, memory_limit=8))
    assert layout.ends in ((1, 3), (2, 3)) and layout.replicas == (1, 1)
    fixed = dataclasses.replace(problem, stages=1, devices=3)
    expected = (
        "no layout of 3 segments on 3 devices in 1 stages fits a memory limit of 5.0 B per device; "
        "the smallest limit that works is 12.0 B (raise memory_limit or use more stages)"
    )
    with pytest.raises(InfeasibleMemoryError, match=re.escape(expected)):
        solve_replicated(fixed)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"devices": 0}, "ReplicaProblem.devices is 0; expected a whole number of devices >= 1"),
        ({"devices": 2.0}, "ReplicaProblem.devices is 2.0; expected a whole number of devices >= 1"),
        (
            {"stages": 3, "devices": 2},
            "ReplicaProblem.stages is 3 but 3 segments on 2 devices allow 1 to 2 stages; "
            "set stages in that range (each stage needs a segment and a device), or None",
        ),
        (
            {"max_replicas": 0},
            "ReplicaProblem.max_replicas is 0; expected a whole number >= 1 (1 disables replication), "
            "or None for up to devices",
        ),
        (
            {"compute": [1, -1, 2]},
            "ReplicaProblem.compute[1] is -1.0; expected a non-negative finite number (fix its producer)",
        ),
        (
            {"grad_bytes": [1, 2]},
            "ReplicaProblem.grad_bytes has 2 entries but compute has 3; expected one entry per segment (or None)",
        ),
        (
            {"allreduce_bandwidth": 0},
            "ReplicaProblem.allreduce_bandwidth is 0; expected a positive number of bytes per second",
        ),
        (
            {"memory_limit": -1},
            "ReplicaProblem.memory_limit is -1; expected a non-negative number of bytes (use None for no cap)",
        ),
        (
            {"compute": []},
            "ReplicaProblem.compute is empty; expected one cost per segment (a model has at least one)",
        ),
    ],
)
def test_bad_problems_are_rejected(changes: dict, expected: str) -> None:
    with pytest.raises(PartitionError, match=re.escape(expected)):
        ReplicaProblem(**{"compute": [1, 2, 3], "devices": 4, **changes})


def test_layout_costs_validates_the_layout() -> None:
    problem = ReplicaProblem(compute=[1, 2, 3], grad_bytes=[2, 2, 2], allreduce_bandwidth=1.0, devices=4)
    # Stage [0, 1) on 1 replica: 1; stage [1, 3) on 3 replicas: 5/3 + 2 * 2/3 * 4 = 5/3 + 16/3 = 7.
    assert layout_costs(problem, (1, 3), (1, 3)) == pytest.approx([1.0, 7.0])
    cases = [
        ((1, 3), (2, 3), "replicas (2, 3) use 5 devices but the problem has 4; expected at most that many in total "
         "(use fewer replicas or more devices)"),
        ((1, 3), (1,), "1 replica counts for 2 stages; expected one replica count per stage"),
        ((1, 3), (0, 1), "replicas[0] is 0; expected a whole number from 1 to 4 (max_replicas, at most devices and "
         "the batch's examples)"),
        ((2, 1), (1, 1), "stage ends (2, 1) do not partition 3 segments"),
    ]
    for ends, replicas, expected in cases:
        with pytest.raises(PartitionError, match=re.escape(expected)):
            layout_costs(problem, ends, replicas)
    capped = dataclasses.replace(problem, max_replicas=2)
    with pytest.raises(PartitionError, match=re.escape("replicas[1] is 3; expected a whole number from 1 to 2")):
        layout_costs(capped, (1, 3), (1, 3))


@pytest.mark.parametrize("seed", range(120))
def test_fixed_replicas_match_brute_force(seed: int) -> None:
    problem = dataclasses.replace(replicas_random_problem(seed), stages=None, max_replicas=None)
    n = len(problem.compute)
    rng = random.Random(seed)
    k = rng.randint(1, min(n, problem.devices))
    replicas = [1] * k
    for _ in range(problem.devices - k):  # spread the spare devices at random, some left idle
        if rng.random() < 0.7:
            replicas[rng.randrange(k)] += 1
    best, min_memory = None, None
    for cuts in itertools.combinations(range(1, n), k - 1):
        ends = (*cuts, n)
        layout = Layout(ends=ends, replicas=tuple(replicas), costs=tuple(layout_costs(problem, ends, replicas)))
        worst = max(replicas_stage_memory(problem, layout))
        min_memory = worst if min_memory is None else min(min_memory, worst)
        if problem.memory_limit is None or worst <= problem.memory_limit:
            best = layout if best is None or layout.bottleneck < best.bottleneck else best
    if best is None:
        with pytest.raises(InfeasibleMemoryError) as info:
            solve_fixed_replicas(problem, replicas)
        assert info.value.min_limit == min_memory
        return
    layout = solve_fixed_replicas(problem, replicas)
    assert layout.bottleneck == best.bottleneck, f"seed {seed}"
    assert layout.replicas == tuple(replicas) and layout.ends[-1] == n
    assert list(layout.costs) == layout_costs(problem, layout.ends, layout.replicas)


def test_fixed_replicas_bad_counts() -> None:
    problem = ReplicaProblem(compute=[1, 2, 3], devices=3)
    with pytest.raises(PartitionError, match=re.escape("replicas (2, 2) use 4 devices but the problem has 3; use "
                                                       "fewer replicas or more devices")):
        solve_fixed_replicas(problem, [2, 2])
    with pytest.raises(PartitionError, match=re.escape("replicas (1, 0) must be 1 to 3 positive whole numbers")):
        solve_fixed_replicas(problem, [1, 0])


@pytest.mark.parametrize("seed", range(100))
def test_measured_split_compute_matches_brute_force(seed: int) -> None:
    problem = replicas_random_problem(seed)
    rng = random.Random(seed)
    rows = [[c / r * rng.choice([1.0, 1.5, 2.0]) for c in problem.compute] for r in range(2, rng.randint(2, 5))]
    problem = dataclasses.replace(problem, split_compute=rows)
    try:
        ref = brute_force_replicated(problem)
    except InfeasibleMemoryError:
        with pytest.raises(InfeasibleMemoryError):
            solve_replicated(problem)
        return
    layout = solve_replicated(problem)
    assert (layout.bottleneck, layout.devices, len(layout.ends)) == (ref.bottleneck, ref.devices, len(ref.ends))
    assert max(layout.replicas) <= len(rows) + 1
    replicas_check_valid(dataclasses.replace(problem, max_replicas=min(len(rows) + 1, problem.max_replicas or 99)),
                         layout)


def test_split_compute_that_does_not_shrink_keeps_one_replica() -> None:
    # halving the batch does not halve the time (small kernels): replication buys nothing
    problem = ReplicaProblem(compute=[4.0, 4.0], devices=4, split_compute=[[4.0, 4.0], [4.0, 4.0], [4.0, 4.0]])
    layout = solve_replicated(problem)
    assert layout.replicas == (1, 1) and layout.costs == (4.0, 4.0)
    faster = dataclasses.replace(problem, split_compute=[[2.5, 2.0], [4.0, 4.0], [4.0, 4.0]])
    assert solve_replicated(faster).replicas == (2, 2) and solve_replicated(faster).costs == (2.5, 2.0)


def test_whole_nodes_are_preferred_to_a_faster_layout() -> None:
    # one segment, 2 devices a node, 3 devices: 3 replicas are fastest (4/3) but leave a node part-used; 2 fill one
    problem = ReplicaProblem(compute=[4.0], devices=3, gpus_per_node=2)
    assert (solve_replicated(problem).replicas, solve_replicated(problem).bottleneck) == ((2,), 2.0)
    assert brute_force_replicated(problem).replicas == (2,)
    # no layout fills whole nodes when the batch allows one replica of one segment: the best of the others
    lone = dataclasses.replace(problem, batch=1)
    assert solve_replicated(lone).replicas == brute_force_replicated(lone).replicas == (1,)
    assert solve_replicated(dataclasses.replace(problem, gpus_per_node=None)).replicas == (3,)


@pytest.mark.parametrize("seed", range(120))
def test_fixed_replicas_on_nodes_match_brute_force(seed: int) -> None:
    problem = replicas_on_nodes(dataclasses.replace(replicas_random_problem(seed), stages=None, max_replicas=None),
                                seed)
    n = len(problem.compute)
    rng = random.Random(seed)
    k = rng.randint(1, min(n, problem.devices))
    replicas = [1] * k
    for _ in range(problem.devices - k):
        if rng.random() < 0.7:
            replicas[rng.randrange(k)] += 1
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        ends = (*cuts, n)
        layout = Layout(ends=ends, replicas=tuple(replicas), costs=tuple(layout_costs(problem, ends, replicas)))
        if problem.memory_limit is None or max(replicas_stage_memory(problem, layout)) <= problem.memory_limit:
            best = layout if best is None or layout.bottleneck < best.bottleneck else best
    if best is None:
        with pytest.raises(InfeasibleMemoryError):
            solve_fixed_replicas(problem, replicas)
        return
    layout = solve_fixed_replicas(problem, replicas)
    assert layout.bottleneck == best.bottleneck, f"seed {seed}"
    assert list(layout.costs) == layout_costs(problem, layout.ends, layout.replicas)

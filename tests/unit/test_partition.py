"""Tests of the partitioners package: the exact solver against brute force, the baselines, errors, the registry,
a valid partition of 10,000 segments under a memory cap no worse than the uniform one, and an import without torch."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
from ppll_compile.partitioners import (
    SOLVERS,
    InfeasibleMemoryError,
    PartitionError,
    Problem,
    Solver,
    bottleneck,
    brute_force,
    register,
    solve,
    stage_costs,
    stage_memory,
)

GiB = 2**30


def _values(rng: np.random.Generator, n: int) -> list[float]:
    """Random non-negative numbers of mixed magnitudes, some exact zeros and some small integers (to provoke ties)."""
    values = rng.random(n) * 10 ** rng.choice([-2.0, 0.0, 0.0, 0.0, 2.0], n)
    values[rng.random(n) < 0.2] = 0.0
    ints = rng.random(n) < 0.2
    values[ints] = rng.integers(1, 4, ints.sum())
    return values.tolist()


def _random_problem(seed: int) -> tuple[Problem, int]:
    """A small random problem, with heads, comm and speeds or not, and memory caps for two seeds in three."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    k = int(rng.integers(1, n + 1))
    memory, head_memory, limit = None, None, None
    if seed % 3:
        memory, head_memory = _values(rng, n), _values(rng, n)
        scale = sum(memory) / k + max(head_memory)
        limit = float(rng.uniform(0.3, 1.5) * scale) if seed % 2 else (rng.uniform(0.3, 1.5, k) * scale).tolist()
    problem = Problem(
        compute=_values(rng, n),
        head=_values(rng, n) if rng.random() < 0.5 else None,
        comm=_values(rng, n) if rng.random() < 0.5 else None,
        memory=memory,
        head_memory=head_memory,
        speeds=rng.uniform(0.25, 4.0, k).tolist() if seed % 4 else None,
        memory_limit=limit,
    )
    if seed % 5 == 1:  # what a stage saves by starting at a segment (no input gradient): up to that segment's cost
        problem = dataclasses.replace(problem, start=(rng.random(n) * np.asarray(problem.compute)).tolist())
    return problem, k


def _caps(problem: Problem, k: int) -> list[float]:
    """The memory cap of each of the ``k`` devices."""
    limit = problem.memory_limit
    return [math.inf] * k if limit is None else [float(limit)] * k if np.ndim(limit) == 0 else list(limit)


def _assert_valid(problem: Problem, k: int, ends: tuple[int, ...]) -> None:
    """``ends`` are ``k`` non-empty stages covering every segment, each within its device's memory cap."""
    n = len(problem.compute)
    assert len(ends) == k and ends[-1] == n and ends[0] >= 1
    assert all(a < b for a, b in zip(ends, ends[1:]))
    assert all(m <= cap for m, cap in zip(stage_memory(problem, ends), _caps(problem, k)))


def _with_limit(problem: Problem, limit: float) -> Problem:
    """``problem`` with one memory cap for every device."""
    return dataclasses.replace(problem, memory_limit=limit)


def _outcome(method: Solver, problem: Problem, k: int) -> tuple[tuple[int, ...] | None, float | None]:
    """The ends a solver returns, or ``None`` and the ``min_limit`` it reports when memory is infeasible."""
    try:
        return method(problem, k), None
    except InfeasibleMemoryError as error:
        return None, error.min_limit


@pytest.mark.parametrize("seed", range(300))
def test_exact_matches_brute_force(seed: int) -> None:
    problem, k = _random_problem(seed)
    exact, exact_min = _outcome(solve, problem, k)
    reference, reference_min = _outcome(brute_force, problem, k)
    assert (exact is None) == (reference is None)
    if reference is not None:
        _assert_valid(problem, k, exact)
        _assert_valid(problem, k, reference)
        assert math.isclose(bottleneck(problem, exact), bottleneck(problem, reference), rel_tol=1e-9, abs_tol=1e-12)
        return
    assert math.isclose(exact_min, reference_min, rel_tol=1e-9, abs_tol=1e-12)
    at_limit = _with_limit(problem, exact_min)
    for method in (solve, brute_force):
        _assert_valid(at_limit, k, method(at_limit, k))
        with pytest.raises(InfeasibleMemoryError):
            method(_with_limit(problem, float(np.nextafter(exact_min, -math.inf))), k)


def test_a_stage_start_saves_its_first_segments_input_gradient() -> None:
    problem = Problem(compute=[4, 4, 4], start=[0, 3, 3])
    assert stage_costs(problem, (1, 3)) == [4, 5]
    assert stage_costs(problem, (2, 3)) == [8, 1]
    assert solve(problem, 2) == (1, 3)  # without start, (1, 3) and (2, 3) tie at 8


def test_start_cannot_exceed_the_segment() -> None:
    with pytest.raises(PartitionError, match=r"^Problem\.start\[1\] is 5, more than compute\[1\] \(4\); a stage "
                                             r"cannot save more than its first segment costs$"):
        Problem(compute=[4, 4], start=[0, 5])


def test_exact_meets_memory_caps_by_slowing_down() -> None:
    problem = Problem(compute=[1, 1, 1, 1], memory=[3, 1, 1, 1], memory_limit=3)
    assert solve(problem, 2) == (1, 4)
    assert solve(Problem(compute=[1, 1, 1, 1]), 2) == (2, 4)


def test_stage_costs_and_memory_follow_the_cost_model() -> None:
    problem = Problem(
        compute=[1, 2, 3],
        head=[0.5, 0.25, 0],
        comm=[0.125, 0.25, 0],
        memory=[10, 20, 30],
        head_memory=[1, 2, 0],
        speeds=[1, 2],
    )
    assert stage_costs(problem, (1, 3)) == [1.625, 2.5]
    assert stage_memory(problem, (1, 3)) == [11, 50]
    assert bottleneck(problem, (2, 3)) == 3.5


def test_infeasible_memory_message() -> None:
    problem = Problem(compute=[1] * 16, memory=[0.4 * GiB] * 16, memory_limit=1.0 * GiB)
    expected = (
        "no partition into 4 stages fits a memory limit of 1.0 GiB per device; "
        "the smallest limit that works is 1.6 GiB (raise memory_limit or use more devices)"
    )
    with pytest.raises(InfeasibleMemoryError, match=re.escape(expected)) as caught:
        solve(problem, 4)
    assert math.isclose(caught.value.min_limit, 1.6 * GiB)


def test_infeasible_per_device_memory_message() -> None:
    problem = Problem(compute=[1] * 4, memory=[1.0 * GiB] * 4, memory_limit=[1.0 * GiB, 2.0 * GiB])
    expected = (
        "no partition into 2 stages fits the memory limits 1.0 GiB, 2.0 GiB per device; "
        "the smallest uniform limit that works is 2.0 GiB (raise memory_limit or use more devices)"
    )
    with pytest.raises(InfeasibleMemoryError, match=re.escape(expected)):
        solve(problem, 2)


def test_unknown_method_message() -> None:
    expected = "unknown partitioner 'foo'; known partitioners: exact, greedy, params, uniform"
    with pytest.raises(PartitionError, match=re.escape(expected)):
        solve(Problem(compute=[1, 2, 3]), 2, method="foo")


@pytest.mark.parametrize(
    ("k", "expected"),
    [
        (5, "cannot make 5 stages from 3 segments (at most 3 stages)"),
        (0, "cannot make 0 stages from 3 segments (at least 1 stage)"),
    ],
)
def test_stage_count_message(k: int, expected: str) -> None:
    for method in ("exact", "uniform"):
        with pytest.raises(PartitionError, match=re.escape(expected)):
            solve(Problem(compute=[1, 2, 3]), k, method=method)
    with pytest.raises(PartitionError, match=re.escape(expected)):
        brute_force(Problem(compute=[1, 2, 3]), k)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"compute": [1, -1]}, "Problem.compute[1] is -1.0; expected a non-negative finite number"),
        ({"compute": [1, 2], "comm": [0, math.nan]}, "Problem.comm[1] is nan; expected a non-negative finite"),
        ({"compute": [1, 2], "head": [0]}, "Problem.head has 1 entries but compute has 2; expected one entry"),
        ({"compute": [1], "speeds": [1, 0]}, "Problem.speeds[1] is 0.0; expected a positive finite relative speed"),
        ({"compute": [1], "memory_limit": -1}, "Problem.memory_limit is -1.0; expected a non-negative number"),
        ({"compute": []}, "Problem.compute is empty; expected one cost per segment"),
        ({"compute": [[1, 2]]}, "Problem.compute is list; expected a flat sequence of numbers"),
    ],
)
def test_bad_problem_names_field_and_index(fields: dict, expected: str) -> None:
    with pytest.raises(PartitionError, match=re.escape(expected)):
        Problem(**fields)


def test_per_device_values_must_match_stage_count() -> None:
    expected = "Problem.speeds has 2 entries but num_stages is 3; give one value per device (stage)"
    with pytest.raises(PartitionError, match=re.escape(expected)):
        solve(Problem(compute=[1, 2, 3], speeds=[1, 2]), 3)


def test_uniform_baseline() -> None:
    assert solve(Problem(compute=[1] * 10), 3, method="uniform") == (3, 7, 10)
    assert solve(Problem(compute=[1] * 4), 4, method="uniform") == (1, 2, 3, 4)


def test_greedy_baseline() -> None:
    # shares: 21/3 = 7 -> stop at 6 (adding 4 gives 10); 15/2 = 7.5 -> 4 + 5 = 9, leaving one segment for the last
    assert solve(Problem(compute=[1, 2, 3, 4, 5, 6]), 3, method="greedy") == (3, 5, 6)
    # ties keep filling: 1 + 1 is as far from the share 1.5 as 1 alone
    assert solve(Problem(compute=[1, 1, 1]), 2, method="greedy") == (2, 3)
    # the greedy ignores heads, so it is worse than exact here
    problem = Problem(compute=[2, 2, 2, 2], head=[0, 10, 0, 0])
    assert solve(problem, 2, method="greedy") == (2, 4)
    assert bottleneck(problem, solve(problem, 2)) < bottleneck(problem, (2, 4))


@pytest.mark.parametrize("seed", range(20))
def test_params_baseline_is_exact_over_params(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    k = int(rng.integers(1, n + 1))
    params = rng.integers(0, 1000, n).tolist()
    problem = Problem(compute=_values(rng, n), params=params, memory=[1] * n, memory_limit=0.5)
    ends = solve(problem, k, method="params")
    by_params = Problem(compute=params)
    assert bottleneck(by_params, ends) == bottleneck(by_params, brute_force(by_params, k))


def test_params_baseline_needs_params() -> None:
    with pytest.raises(PartitionError, match=re.escape("the params partitioner needs per-segment parameter counts")):
        solve(Problem(compute=[1, 2]), 2, method="params")


@pytest.mark.parametrize("seed", range(30))
def test_exact_never_worse_than_baselines(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 60))
    k = int(rng.integers(1, n + 1))
    problem = Problem(
        compute=_values(rng, n),
        head=_values(rng, n),
        comm=_values(rng, n),
        params=_values(rng, n),
        speeds=rng.uniform(0.5, 2.0, k).tolist(),
    )
    best = bottleneck(problem, solve(problem, k))
    for method in ("uniform", "greedy", "params"):
        ends = solve(problem, k, method=method)
        assert len(ends) == k
        assert best <= bottleneck(problem, ends)


def test_large_problem_sanity() -> None:
    rng = np.random.default_rng(7)
    n, k = 10_000, 64
    head, comm = rng.random(n) * 0.5, rng.random(n) * 0.2
    head[-1] = comm[-1] = 0.0
    fields = dict(
        compute=rng.random(n),
        head=head,
        comm=comm,
        memory=rng.random(n),
        head_memory=rng.random(n) * 0.3,
        speeds=rng.uniform(0.5, 2.0, k),
    )
    uniform = solve(Problem(**fields), k, method="uniform")
    problem = Problem(**fields, memory_limit=max(stage_memory(Problem(**fields), uniform)))
    ends = solve(problem, k)
    _assert_valid(problem, k, ends)
    assert bottleneck(problem, ends) <= bottleneck(problem, uniform)


def test_registry_dispatches_and_checks_answers() -> None:
    @register("test-last-segment")
    def last_segment(problem: Problem, num_stages: int) -> tuple[int, ...]:
        return (len(problem.compute),) if num_stages == 1 else (2, 1)

    try:
        assert solve(Problem(compute=[1, 2]), 1, method="test-last-segment") == (2,)
        with pytest.raises(PartitionError, match=re.escape("stage ends (2, 1) do not partition 2 segments")):
            solve(Problem(compute=[1, 2]), 2, method="test-last-segment")
        with pytest.raises(PartitionError, match=re.escape("partitioner 'test-last-segment' is already registered")):
            register("test-last-segment")(last_segment)
    finally:
        del SOLVERS["test-last-segment"]


def _on_nodes(problem: Problem, seed: int) -> Problem:
    """``problem`` with stage ``j`` on device ``j`` of nodes of 1, 2 or 3 devices whose link across is 5 to 50 times
    slower than the one inside (some boundaries sent inside a node for free, to provoke ties)."""
    rng = np.random.default_rng(1000 + seed)
    n = len(problem.compute)
    comm = problem.comm if problem.comm is not None else _values(rng, n)
    slower = float(rng.choice([5.0, 50.0]))
    return dataclasses.replace(problem, comm=comm, cross_comm=[c * slower + float(rng.integers(0, 2)) for c in comm],
                               gpus_per_node=int(rng.choice([1, 2, 3])))


@pytest.mark.parametrize("seed", range(300))
def test_exact_matches_brute_force_on_nodes(seed: int) -> None:
    problem, k = _random_problem(seed)
    problem = _on_nodes(problem, seed)
    exact, exact_min = _outcome(solve, problem, k)
    reference, reference_min = _outcome(brute_force, problem, k)
    assert (exact is None) == (reference is None)
    if reference is None:
        assert math.isclose(exact_min, reference_min, rel_tol=1e-9, abs_tol=1e-12)
        return
    _assert_valid(problem, k, exact)
    assert bottleneck(problem, exact) == bottleneck(problem, reference)


def test_nodes_change_the_optimum_on_random_problems() -> None:
    changed = 0
    for seed in range(300):
        problem, k = _random_problem(seed)
        on_nodes = _on_nodes(problem, seed)
        try:
            changed += bottleneck(on_nodes, solve(on_nodes, k)) > bottleneck(problem, solve(problem, k))
        except InfeasibleMemoryError:
            continue
    assert changed >= 30

"""Hybrid (replicated-stage) partitioning: the exact solvers against brute force, hand-checked layouts, errors."""

from __future__ import annotations

import dataclasses
import random

import pytest
from ppll_compile.partitioners import InfeasibleMemoryError
from ppll_compile.partitioners.replicas import solve_replicated
from tests.helpers import replicas_on_nodes, replicas_random_problem, replicas_same_as_brute_force


@pytest.mark.parametrize("group", range(4))
def test_solver_matches_brute_force_on_nodes(group: int) -> None:
    solved = [replicas_same_as_brute_force(replicas_on_nodes(replicas_random_problem(seed), seed), seed)
              for seed in range(100 * group, 100 * group + 100)]
    assert 0 < sum(found is not None for found in solved) < 100  # both solved problems and refusals


@pytest.mark.parametrize("group", range(3))
def test_solver_matches_brute_force_with_a_batch(group: int) -> None:
    """With ``batch``, no stage runs on more replicas than the batch has examples; still exact, on nodes or not."""
    capped = 0
    for seed in range(100 * group, 100 * group + 100):
        problem = replicas_random_problem(seed)
        problem = dataclasses.replace(replicas_on_nodes(problem, seed) if seed % 2 else problem,
                                      batch=random.Random(seed).choice([1, 2, 3]))
        found = replicas_same_as_brute_force(problem, seed)
        if found is None:
            continue
        layout, expected = found
        assert max(layout.replicas) <= problem.batch and max(expected.replicas) <= problem.batch
        free = solve_replicated(dataclasses.replace(problem, batch=None))
        capped += max(free.replicas) > problem.batch
    assert capped >= 5  # the cap binds in many


def test_random_problems_on_nodes_cover_the_interesting_cases() -> None:
    spanning = crossing = changed = 0
    for seed in range(400):
        problem = replicas_on_nodes(replicas_random_problem(seed), seed)
        try:
            layout = solve_replicated(problem)
        except InfeasibleMemoryError:
            continue
        g, first = problem.gpus_per_node, 0
        for r in layout.replicas:
            spanning += r > 1 and first // g != (first + r - 1) // g
            crossing += first + r < layout.devices and (first + r) % g == 0
            first += r
        plain = dataclasses.replace(problem, gpus_per_node=None)
        changed += (layout.bottleneck, layout.devices) != (solve_replicated(plain).bottleneck,
                                                           solve_replicated(plain).devices)
    assert spanning >= 20 and crossing >= 50 and changed >= 50

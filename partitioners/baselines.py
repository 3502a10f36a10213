"""Baseline partitioners from earlier pipeline systems, to compare the exact solver against.

They ignore heads, communication, device speeds and memory caps unless their docstring says otherwise.
"""

from __future__ import annotations

from . import PartitionError, Problem, register
from .exact import exact_partition


@register("uniform")
def uniform_partition(problem: Problem, num_stages: int) -> tuple[int, ...]:
    """Equal numbers of segments per stage, as InfoPro splits ResNets by layer count.

    ``ends[j] = round((j + 1) * n / k)`` with halves rounded up; ends are strictly increasing because
    ``n / k >= 1``.
    """
    n = len(problem.compute)
    return tuple(((j + 1) * 2 * n + num_stages) // (2 * num_stages) for j in range(num_stages))


@register("greedy")
def greedy_partition(problem: Problem, num_stages: int) -> tuple[int, ...]:
    """torchgpipe-style balance of backbone compute: fill each stage towards its fair share of what is left.

    A stage closes when adding the next segment would take it further from ``remaining / stages left``
    than stopping now, and always leaves at least one segment for each later stage.
    """
    compute = [float(c) for c in problem.compute]
    n = len(compute)
    remaining = sum(compute)
    ends: list[int] = []
    start = 0
    for j in range(num_stages - 1):
        share = remaining / (num_stages - j)
        end, total = start + 1, compute[start]
        while end < n - (num_stages - 1 - j) and abs(total + compute[end] - share) <= abs(total - share):
            total += compute[end]
            end += 1
        ends.append(end)
        remaining -= total
        start = end
    return (*ends, n)


@register("params")
def params_partition(problem: Problem, num_stages: int) -> tuple[int, ...]:
    """DeepSpeed ``partition_method="parameters"``: the exact min-max over per-segment parameter counts."""
    if problem.params is None:
        raise PartitionError(
            "the params partitioner needs per-segment parameter counts but Problem.params is None; "
            "set Problem.params or choose another partitioner"
        )
    return exact_partition(Problem(compute=problem.params), num_stages)

"""How many data-parallel replicas a batch can be split over: the one rule the planner and the runtime share.

A replicated stage trains each replica on its own rows of the batch (the runtime cuts a batch by rows,
``tensor_split``), so every replica needs at least one example: a stage runs on at most as many replicas as the
batch has examples. The replica partitioner caps every stage at :func:`most_replicas`, a plan file is refused when a
stage asks for more, and the runtime refuses a batch too small to split with :func:`split_refusal`'s words.
"""

from __future__ import annotations


def most_replicas(batch: int) -> int:
    """The most replicas a stage may run on when a training step feeds ``batch`` examples (one example each)."""
    return max(1, int(batch))


def split_refusal(batch: int, replicas: int) -> str | None:
    """Why a batch of ``batch`` examples cannot be split over ``replicas`` replicas, or ``None`` when it can."""
    if replicas <= most_replicas(batch):
        return None
    return f"a batch of {batch} example(s) cannot be split over {replicas} replicas"

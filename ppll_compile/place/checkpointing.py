"""Activation checkpointing (``checkpoint_activations=True``) priced: where the model's checkpointed segments begin,
what each stage keeps from its forward to its backward and recomputes, the costs the partitioner weighs and the
plan's notes on it."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence

from ..analysis.analyse import Analysis, Summary
from ..cost.roofline import DeviceFigures, seconds
from ..options import PlanOptions
from ..plans.plan import Plan, TensorSpec
from ..plans.units import format_bytes
from .costs import Costs


def checkpointed_activations(a: Analysis, costs: Costs, start: int, end: int, optimizer: str
                              ) -> tuple[tuple[int, ...], int, int]:
    """A stage over atomic segments ``start .. end - 1`` checkpointed segment by segment: from its first, and from
    each of the model's checkpointed segments (``costs.checkpoint_starts``) inside it. Returns the cuts where its
    segments end (indices into ``a.cuts``), the bytes it keeps from its forward to its backward (its segments'
    inputs, each value once) and its largest segment's activations (saved while backward recomputes it; the stage's
    input arrives detached)."""
    starts = [start, *(i for i in costs.checkpoint_starts or () if start < i < end)]
    kept = {t.name: t.bytes for i in starts for t in segment_inputs(a, i)}
    largest = max(a.summary(a.segment_nodes(b, e - 1), optimizer, detached=b == start).activation_bytes
                  for b, e in zip(starts, [*starts[1:], end]))
    return tuple(b - 1 for b in starts[1:]), sum(kept.values()), largest


def one_segment_note(j: int, inside: int, kept: int, activations: int, whole: Summary) -> str:
    """The note on stage ``j`` checkpointed as one segment (``inside``: the legal cuts inside it, none or none worth
    a segment): what that gives, and what not."""
    why = "has no legal cut inside it" if not inside else \
        f"holds one of the model's checkpointed segments (its {inside} legal cut(s) inside would keep more inputs " \
        f"than they save)"
    return (f"stage {j} {why}, so its block is checkpointed as one segment: from its forward to "
            f"its backward it keeps only its input ({format_bytes(kept)} instead of "
            f"{format_bytes(whole.activation_bytes)} of activations), so its activations do not overlap its head's, "
            f"but backward recomputes the whole block at once, so its peak is its input plus all its activations "
            f"({format_bytes(activations)}); more stages (gpus=) cut it finer, or drop checkpoint_activations=")


def checkpoint_note(plan: Plan, without: Sequence[int]) -> str:
    """The plan's note on activation checkpointing: per stage its segments, activation memory against ``without``
    (its activations kept from the forward) and the seconds of the forward its backward runs again."""
    per = "; ".join(f"stage {s.index}: {len(s.checkpoints) + 1} segment(s), activations "
                    f"{format_bytes(s.activation_bytes)} instead of {format_bytes(w)} (inputs kept "
                    f"{format_bytes(s.kept_bytes)}), +{s.recompute_cost * 1e3:.3g} ms a step"
                    for s, w in zip(plan.stages, without))
    return (f"activation checkpointing: every stage keeps only its segments' inputs from forward to backward and "
            f"recomputes each segment in backward (its activations: those inputs plus its largest segment's); {per}")


def segment_inputs(a: Analysis, i: int) -> tuple[TensorSpec, ...]:
    """The values segment ``i`` of ``a`` reads from before it: the model's inputs (segment 0), else what crosses the
    cut before it; what a checkpointed segment keeps from its forward to its backward."""
    return a.inputs if i == 0 else a.boundary(a.cuts[i - 1])


def checkpointed(costs: Costs, a: Analysis, seg: Sequence[Summary], opts: PlanOptions,
                 figures: DeviceFigures | None) -> Costs:
    """``costs`` of the atomic segments (their figures ``seg``, as parts of a larger stage) under activation
    checkpointing: one more forward each (over ``figures``, else ``opts.flops_per_second``), and the model's
    checkpointed segments (:func:`checkpoint_starts`) keeping their inputs instead of their activations. A stage's
    memory is priced from above: its first segment's input at most the largest input, its largest segment's
    activations at most the largest of the model's segments up to its end (the sum of their atomic parts')."""
    n = len(seg)
    recompute = [s.flops_fwd / opts.flops_per_second if figures is None else
                 seconds(a.forward_ops(a.segment_nodes(i, i)), figures) for i, s in enumerate(seg)]
    inputs = [sum(t.bytes for t in segment_inputs(a, i)) for i in range(n)]
    starts = checkpoint_starts([s.activation_bytes for s in seg], inputs)
    ends = [*starts[1:], n]
    held = [sum(s.activation_bytes for s in seg[b:e]) for b, e in zip(starts, ends)]
    largest = [max(held[:k + 1]) for k in range(len(starts)) for _ in range(starts[k], ends[k])]
    return dataclasses.replace(
        costs, compute=[t + r for t, r in zip(costs.compute, recompute)], recompute=recompute, checkpoint_starts=starts,
        memory=[s.memory - s.activation_bytes + (inputs[i] if i in starts else 0) for i, s in enumerate(seg)],
        head_memory=[h + m + max(inputs) for h, m in zip(costs.head_memory or [0] * n, largest)])


def checkpoint_starts(held: Sequence[int], read: Sequence[int], levels: int = 48) -> list[int]:
    """Where checkpointed segments begin (the first at 0) when atomic segment ``i`` saves ``held[i]`` bytes and reads
    ``read[i]`` from before it: the merge that keeps least, its segments' inputs plus its largest segment's
    activations (a merge's taken as the sum of its parts'). Every cap on that largest is tried (exact) up to
    ``levels`` atomic segments, else ``levels`` geometric steps from the largest atomic segment (every one alone: never
    more than checkpointing each) to the whole; per cap a sliding-window minimum chooses the starts."""
    n, prefix = len(held), [0, *itertools.accumulate(held)]
    low, high = max(held), prefix[-1]
    caps = {prefix[e] - prefix[b] for b in range(n) for e in range(b + 1, n + 1)} if n <= levels else \
        {low, high, *(int(low * (high / low) ** (k / levels)) for k in range(levels))} if low else set()
    best: tuple[int, list[int]] = (read[0] + high, [0])
    for cap in sorted(c for c in caps if c >= low):
        kept, came, first, window = [0] * (n + 1), [0] * (n + 1), 0, collections.deque()
        for j in range(1, n + 1):  # the cheapest start of a segment ending before unit j whose activations fit
            while window and kept[window[-1]] + read[window[-1]] >= kept[j - 1] + read[j - 1]:
                window.pop()
            window.append(j - 1)
            while prefix[j] - prefix[first] > cap:
                first += 1
            while window[0] < first:
                window.popleft()
            came[j], kept[j] = window[0], kept[window[0]] + read[window[0]]
        starts = [n]
        while starts[-1] > 0:
            starts.append(came[starts[-1]])
        starts = starts[:0:-1]
        largest = max(prefix[e] - prefix[b] for b, e in zip(starts, [*starts[1:], n]))
        best = min(best, (kept[n] + largest, starts))
    return best[1]


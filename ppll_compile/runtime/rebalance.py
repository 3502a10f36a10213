"""Online rebalancing: measure every stage's step time, move a cut one legal cut over when that makes the slowest stage
faster, and carry every moved parameter's optimizer state to the stage that trains it from then on.

The decision is numbers only (:func:`choose_move`): the trainer measures, a
:class:`~ppll_compile.pipeline.Replanner` prices a candidate layout (a plan through the front door), and
:func:`carry_state` moves optimizer state, learning rates, schedulers and counters from the runners a move
replaces to the runners that replace them.

How a move is estimated. Every stage ``j`` measured ``T_j`` seconds a step (the median over the observed steps) for
a predicted ``P_j`` (its ``compute_cost`` in the plan): its work runs at ``r_j = T_j / P_j`` measured seconds per
predicted second, so its measured time is spread over its segments and its head in proportion to their predicted
costs. Moving the cut after stage ``i`` shrinks one of the two stages by the atomic segment between the old and the
new cut; the candidate plan predicts the segment's cost (``D``: what stage ``i + 1``, whose head does not change,
gains or loses) and stage ``i``'s cost with its new head (``P'_i``). The segment keeps the rate of the stage that
measured it; everything else keeps its own stage's:

- cut moved left (stage ``i`` gives its last segment to ``i + 1``): ``T'_i = r_i P'_i``, ``T'_{i+1} = T_{i+1} + r_i D``;
- cut moved right (stage ``i + 1`` gives its first segment to ``i``): ``T'_{i+1} = T_{i+1} - r_{i+1} D``,
  ``T'_i = r_i (P'_i - D s_{i+1} / s_i) + r_{i+1} D s_{i+1} / s_i`` (``s``: the plan's device speeds).

Only a move that shrinks the slowest stage can make it faster, so the candidates are at most two; the better one is
taken when the estimated slowest stage after it is faster than the measured slowest by more than the threshold.
"""

from __future__ import annotations

import numbers
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..lower.stages import Lowered
from ..plans.plan import Plan
from .base import Runtime
from .registry import runtime_names
from .rng import stream_seed
from .runner import Runner

REBALANCE_STEPS = 20
"""Training steps measured before a rebalancing check (``rebalance_steps``)."""
REBALANCE_THRESHOLD = 0.1
"""How much faster (a fraction) the slowest stage must get for a cut to move (``rebalance_threshold``)."""
_HEAD_STREAM = 0x4EAD
"""Stands for the replica in :func:`~.rng.stream_seed` when seeding a new head: a stream no forward draws from."""


class Replanning(Protocol):
    """What plans and re-splits a compiled pipeline for a move (:class:`~ppll_compile.pipeline.Replanner`)."""

    def check(self) -> None:
        """Raise saying why the pipeline's cuts cannot move (if they cannot)."""

    def candidate(self, cuts: Sequence[str]) -> Plan:
        """The plan with the cuts ``cuts``, costed afresh."""

    def recut(self, cuts: Sequence[str], *, seed: int | None, note: str | None = None) -> tuple[Plan, Lowered]:
        """Re-split the pipeline at ``cuts``: the new plan and modules."""


@dataclass(frozen=True, kw_only=True)
class Rebalance:
    """When and how eagerly a trainer with ``rebalance=True`` moves cuts."""

    steps: int = REBALANCE_STEPS
    """Training steps every stage is measured over before a check (again after every move)."""
    threshold: float = REBALANCE_THRESHOLD
    """A cut moves only when the estimated slowest stage gets faster than the measured one by more than this
    fraction; ``0`` moves on any estimated gain."""


@dataclass(frozen=True, kw_only=True)
class Move:
    """One move of cuts: when, from where to where, and the step times that led to it."""

    batch: int
    """The first batch trained with the new cuts (every batch before it went through every stage with the old)."""
    old_cuts: tuple[str, ...]
    """The plan's cuts before the move."""
    new_cuts: tuple[str, ...]
    """The plan's cuts after it."""
    times: tuple[float, ...] | None
    """Median measured seconds of every stage's step before the move (``None`` when asked for by
    :meth:`~.trainer.Trainer.replan`)."""
    estimated: tuple[float, ...] | None = None
    """Estimated seconds of every stage's step after the move (``None`` when asked for)."""

    def __iter__(self) -> Iterator[Any]:
        """``batch, old_cuts, new_cuts, times = move`` unpacks it."""
        return iter((self.batch, self.old_cuts, self.new_cuts, self.times))


def check_rebalance(rebalance: Any, steps: Any, threshold: Any, policy: Any, *, runtime: str, kind: type[Runtime],
                    plan: Plan, replanner: Replanning | None) -> Rebalance | None:
    """The rebalancing the trainer options ask for (``None``: none), each option checked alone and with the plan's
    kind, what the runtime ``runtime`` (of class ``kind``) can do and whether ``replanner`` can move the cuts."""
    if not isinstance(rebalance, bool):
        raise TypeError(f"rebalance must be True or False (measure the stages and move a cut when that makes the "
                        f"slowest one faster), got {rebalance!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"rebalance_steps must be an integer >= 1 (the training steps every stage is measured over "
                         f"before a cut may move), got {steps!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 <= threshold < 1:
        raise ValueError(f"rebalance_threshold must be a fraction in [0, 1) (how much faster the slowest stage must "
                         f"get for a cut to move: 0.1 is 10%), got {threshold!r}")
    if not rebalance:  # (rebalance_policy also serves moves asked for by Trainer.replan)
        given = [f"{name}={value!r}" for name, value, default in (
            ("rebalance_steps", steps, REBALANCE_STEPS), ("rebalance_threshold", threshold, REBALANCE_THRESHOLD))
            if value != default]
        if given:
            raise ValueError(f"{', '.join(given)} applies to rebalancing; pass rebalance=True too, or drop it")
        return None
    if plan.mode != "ppll":
        raise ValueError("rebalance=True moves the cuts of a ppll plan; a pipebd plan's stages are distillation "
                         "blocks: re-plan it with blocks=... (or more replicas=) instead")
    if kind.one_process_per_stage:
        raise ValueError(f"rebalance=True moves layers between stages of one process; under runtime={runtime!r} "
                         f"every stage is another process. Measure and rebalance with runtime='threads' on one "
                         f"machine, save the plan it ends with (trainer.plan.save('plan.yaml')), and compile with "
                         f"plan='plan.yaml' for torchrun")
    if not kind.can_move_cuts:
        movers = " and ".join(map(repr, runtime_names(plan.mode, lambda c: c.can_move_cuts)))
        raise ValueError(f"rebalance=True applies to the runtimes {movers}, not {runtime!r}")
    if replanner is None:
        raise ValueError("rebalance=True re-splits the compiled pipeline's model; build the trainer with "
                         "compiled.trainer(..., rebalance=True)")
    replanner.check()
    return Rebalance(steps=steps, threshold=float(threshold))


def median_seconds(samples: Sequence[float] | None) -> float | None:
    """The median of a stage's measured step times (robust to the first steps' warm-up); ``None`` without any."""
    return statistics.median(samples) if samples else None


def shrinking_moves(cuts: Sequence[int], legal: int, stage: int) -> list[tuple[int, int]]:
    """The moves of one cut to a neighbouring legal cut that take an atomic segment off ``stage``: (which cut, its new
    index among the ``legal`` cuts). ``cuts`` are the current cuts' indices among the legal cuts, in order."""
    moves = []
    if stage > 0 and cuts[stage - 1] + 1 < (cuts[stage] if stage < len(cuts) else legal):
        moves.append((stage - 1, cuts[stage - 1] + 1))  # the cut before it moves right
    if stage < len(cuts) and cuts[stage] - 1 > (cuts[stage - 1] if stage > 0 else -1):
        moves.append((stage, cuts[stage] - 1))  # the cut after it moves left
    return moves


def _rates(times: Sequence[float], predicted: Sequence[float]) -> list[float]:
    """Measured seconds per predicted second of every stage (the pipeline's overall rate where a stage predicted 0)."""
    total = sum(predicted)
    overall = sum(times) / total if total > 0 else 1.0
    return [t / p if p > 0 else overall for t, p in zip(times, predicted)]


def estimate_times(times: Sequence[float], before: Sequence[float], after: Sequence[float], cut: int, *, left: bool,
                   speeds: Sequence[float]) -> list[float]:
    """Every stage's estimated step seconds after the cut after stage ``cut`` moved one legal cut ``left`` (or right):
    ``times`` measured, ``before`` and ``after`` the stages' predicted seconds in the plan and in the candidate plan,
    ``speeds`` the devices' relative speeds (see the module's docstring)."""
    r = _rates(times, before)
    i, k = cut, cut + 1
    out = list(times)
    if left:
        d = max(0.0, after[k] - before[k])
        out[i] = r[i] * after[i]
        out[k] = times[k] + r[i] * d
    else:
        d = max(0.0, before[k] - after[k])
        here = d * speeds[k] / speeds[i]  # the segment's predicted seconds on stage i's device
        out[k] = max(0.0, times[k] - r[k] * d)
        out[i] = r[i] * max(0.0, after[i] - here) + r[k] * here
    return out


def choose_move(times: Sequence[float], plan: Plan, threshold: float,
                candidate: Callable[[tuple[str, ...]], Plan | None]) -> tuple[tuple[str, ...], list[float]] | None:
    """The cuts to move to and the estimated stage times after, or ``None`` when no move to a neighbouring legal cut
    makes the slowest stage faster by more than ``threshold``.

    ``candidate(cuts)`` is the plan with those cuts (``None`` when it cannot be made, say over the memory limit).
    """
    ordered = sorted(times)
    if len(times) < 2 or ordered[-1] == ordered[-2]:
        return None  # two stages share the slowest time: moving one cut cannot make both faster
    slowest = list(times).index(ordered[-1])
    index = {c: n for n, c in enumerate(plan.legal_cuts)}
    cuts = [index[c] for c in plan.cuts]
    before = [s.compute_cost for s in plan.stages]
    best: tuple[tuple[str, ...], list[float]] | None = None
    for which, to in shrinking_moves(cuts, len(plan.legal_cuts), slowest):
        moved = list(plan.cuts)
        moved[which] = plan.legal_cuts[to]
        other = candidate(tuple(moved))
        if other is None:
            continue
        after = [s.compute_cost for s in other.stages]
        est = estimate_times(times, before, after, which, left=to < cuts[which], speeds=plan.device_speeds)
        if best is None or max(est) < max(best[1]):
            best = (tuple(moved), est)
    if best is None or not max(best[1]) < (1.0 - threshold) * times[slowest]:
        return None
    return best


def head_seed(seed: int | None, batch: int) -> int | None:
    """The seed the heads at new cuts are built with when a move happens before ``batch``: the same in every runtime,
    so runs that make the same move agree; ``None`` (unseeded) with ``seed=None``."""
    return None if seed is None else stream_seed(seed, 0, batch, replica=_HEAD_STREAM) & ((1 << 63) - 1)


@dataclass(frozen=True)
class StateSnapshot:
    """The optimizer state of every parameter of some runners, and the device each parameter was on, taken before a
    move changes them; with the runners, for their learning rates, schedulers and counters."""

    runners: dict[int, Runner]
    """Stage index -> its runner before the move."""
    state: dict[int, tuple[torch.device, dict[str, Any]]]
    """``id(parameter)`` -> (its device then, its optimizer state)."""

    @classmethod
    def of(cls, runners: Sequence[Runner]) -> StateSnapshot:
        state = {id(p): (p.device, dict(o.state[p])) for r in runners for o in r.optimizers for p in o.state
                 if isinstance(p, Tensor)}
        return cls(runners={r.index: r for r in runners}, state=state)


def _moved(value: Any, was: torch.device, device: torch.device) -> Any:
    """A state value moved with its parameter: tensors on the parameter's old device go to its new one (a ``step``
    counter kept on the CPU stays there)."""
    if isinstance(value, Tensor) and value.device == was and was != device:
        return value.to(device)
    return value


def carry_state(snapshot: StateSnapshot, fresh: Sequence[Runner]) -> None:
    """Give the ``fresh`` runners (built by the optimizer and scheduler factories for a moved cut) the state of the
    runners they replace: every parameter's optimizer state (``optimizer.state[p]``, from whichever stage trained it,
    moved to its device), and from the runner of the same stage its optimizers' hyperparameters (a scheduled learning
    rate), its schedulers' state, its counters and its recorder."""
    for r in fresh:
        for o in r.optimizers:
            for group in o.param_groups:
                for p in group["params"]:
                    if id(p) in snapshot.state:
                        was, state = snapshot.state[id(p)]
                        o.state[p] = {k: _moved(v, was, p.device) for k, v in state.items()}
        old = snapshot.runners.get(r.index)
        if old is None:
            continue
        for o, before in zip(r.optimizers, old.optimizers):
            if len(o.param_groups) == len(before.param_groups):
                for group, was_group in zip(o.param_groups, before.param_groups):
                    group.update({k: v for k, v in was_group.items() if k != "params"})
        for s, before in zip(r.schedulers, old.schedulers):
            s.load_state_dict(before.state_dict())
        r.steps, r.reused, r.dropped, r.recorder = old.steps, old.reused, old.dropped, old.recorder
        r.updates = old.updates
        if r.scaler is not None and old.scaler is not None:
            r.scaler.load_state_dict(old.scaler.state_dict())


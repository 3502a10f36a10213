"""A trainer's cut mover: measures every stage over some batches, decides (:mod:`.rebalance`) and moves a cut between
two batches, or moves one when asked (``replan``, ``move_cut``).

A move drains the pipeline first (every batch fed goes through every stage with the old cuts, so FIFO runs stay the
sequential computation), re-splits the two stages beside the cut (the model's own parameter objects, each with its
optimizer state), builds the head at the new cut from the policy (``rebalance_policy``, else the plan's) with a
generator seeded by (``seed``, batch), and keeps every other head, stage and optimizer; the re-built stages keep
their learning rates, schedulers and counters. A sequential run that moves the
cut a threads run moved, before the same batch, is the same computation.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ..errors import CutError, PPLLError
from ..lower.stages import Lowered
from ..plans.plan import Plan
from .base import Runtime
from .config import TrainConfig
from .rebalance import Move, Rebalance, Replanning, StateSnapshot, carry_state, choose_move, head_seed, median_seconds
from .registry import runtime_names
from .runners import make_runners


class Rebalancer:
    """Moves the cuts of one trainer's pipeline: measured (``settings``, from ``rebalance=True``) or asked.

    It holds what moving needs (the runtime, how stages train, the replanner, the seed) and what moving did
    (:attr:`rebalances`, :attr:`stage_times`); the trainer passes its plan, modules and batch count, and takes the new
    plan and modules a move returns.
    """

    def __init__(self, runtime: Runtime, config: TrainConfig, *, name: str, plan: Plan, settings: Rebalance | None,
                 replanner: Replanning | None) -> None:
        self._runtime, self._config, self._name = runtime, config, name
        self._settings, self._replanner = settings, replanner
        self.rebalances: list[Move] = []
        """The cuts moved so far: batch, old and new cuts, measured times."""
        self.stage_times: tuple[float | None, ...] | None = None
        """Median measured seconds of every stage's step at the last check (``None`` before one)."""
        self._next_check: int | None = None
        self._visited: set[tuple[str, ...]] = {plan.cuts}
        if settings is not None:
            self._watch(settings.steps)

    @property
    def measuring(self) -> bool:
        """Whether a check is still to come (the stages are being measured)."""
        return self._next_check is not None

    def between_batches(self, plan: Plan, lowered: Lowered, batches: int) -> tuple[Plan, Lowered] | None:
        """Before batch ``batches``: the check, once its steps are measured (see :meth:`check`)."""
        if self._next_check is not None and batches >= self._next_check:
            return self.check(plan, lowered, batches)
        return None

    def check(self, plan: Plan, lowered: Lowered, batches: int) -> tuple[Plan, Lowered] | None:
        """Drain, estimate the best move of one cut from the measured stage times, and make it if it is worth it; the
        new plan and modules (``None``: nothing moved)."""
        assert self._settings is not None and self._replanner is not None
        replanner, settings = self._replanner, self._settings
        self._runtime.drain()
        measured = tuple(median_seconds(r.step_times) for r in self._runtime.runners)
        self.stage_times = measured
        times = tuple(t for t in measured if t is not None)
        if len(times) < len(measured):  # a stage trained on nothing yet ("latest" queues): measure again
            self._watch(batches + settings.steps)
            return None

        def candidate(cuts: tuple[str, ...]) -> Plan | None:
            if cuts in self._visited:
                return None
            try:
                return replanner.candidate(cuts)
            except (PPLLError, ValueError) as e:  # over the memory limit, or the head cannot be built
                warnings.warn(f"rebalancing does not consider cuts {list(cuts)}: {e}", stacklevel=2)
                return None

        choice = choose_move(times, plan, settings.threshold, candidate)
        if choice is None:
            self._watch(None)
            return None
        cuts, estimated = choice
        moved = self._move(plan, lowered, cuts, batches, times=times, estimated=tuple(estimated))
        self._watch(batches + settings.steps)
        return moved

    def replan(self, plan: Plan, lowered: Lowered, split_points: Sequence[str],
               batches: int) -> tuple[Plan, Lowered] | None:
        """Move the cuts to ``split_points`` before batch ``batches`` (see :meth:`~.trainer.Trainer.replan`); the new
        plan and modules (``None``: the cuts are where they were)."""
        cuts = self._checked_cuts(plan, split_points)
        return self._move(plan, lowered, cuts, batches, times=None, estimated=None) if cuts != plan.cuts else None

    def move_cut(self, plan: Plan, lowered: Lowered, stage: int, cut: str,
                 batches: int) -> tuple[Plan, Lowered] | None:
        """Move the cut after stage ``stage`` to the legal cut ``cut`` (see :meth:`replan`)."""
        last = plan.num_stages - 2
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= last:
            raise ValueError(f"stage must be the index of a stage followed by a cut, 0..{last} (the cut after stage i "
                             f"ends it), got {stage!r}")
        cuts = list(plan.cuts)
        cuts[stage] = cut
        return self.replan(plan, lowered, cuts, batches)

    def _checked_cuts(self, plan: Plan, split_points: Sequence[str]) -> tuple[str, ...]:
        """``split_points`` as the plan's cuts, checked (legal, one per cut, in graph order), if the cuts can move."""
        why = None
        kind = type(self._runtime)
        if plan.mode != "ppll":
            why = "a pipebd plan's stages are distillation blocks; re-plan it with blocks=... instead"
        elif self._config.accumulate > 1:
            why = (f"a moved cut would split an accumulation group (accumulate={self._config.accumulate}); train "
                   f"with accumulate=1 to move cuts, or compile again with split_points=[...]")
        elif not kind.can_move_cuts:
            movers = " or ".join(map(repr, runtime_names("ppll", lambda c: c.can_move_cuts)))
            where = "every stage is another process" if kind.one_process_per_stage else "cuts stay where they are"
            why = f"under runtime={self._name!r} {where}; move cuts under {movers}, or compile again with " \
                  f"split_points=[...]"
        elif self._replanner is None:
            why = "it was not built by a compiled pipeline; use compiled.trainer(...)"
        if why is not None:
            raise PPLLError(f"this trainer cannot move cuts: {why}")
        assert self._replanner is not None
        self._replanner.check()
        if isinstance(split_points, str) or not isinstance(split_points, Sequence):
            raise TypeError(f"split_points must be a list of cut names, one per cut, got {split_points!r}")
        legal = plan.legal_cuts
        if len(split_points) != len(plan.cuts):
            raise ValueError(f"split_points lists {len(split_points)} cut(s), but the plan has {plan.num_stages} "
                             f"stages, so {len(plan.cuts)} cut(s) {list(plan.cuts)}; a move keeps the "
                             f"number of stages (compile again for another number)")
        for c in split_points:
            if c not in legal:
                raise CutError(f"{c!r} is not a legal cut of the plan; its legal cuts, in graph order: "
                               f"{', '.join(map(repr, legal))}")
        at = [legal.index(c) for c in split_points]
        if any(b <= a for a, b in zip(at, at[1:])):
            raise CutError(f"split_points {list(split_points)} are not in graph order, or name a cut twice; the legal "
                           f"cuts, in order: {', '.join(map(repr, legal))}")
        return tuple(split_points)

    def _watch(self, until: int | None) -> None:
        """Measure every stage's steps until batch ``until`` (``None``: stop measuring)."""
        self._next_check = until
        for r in self._runtime.runners:
            r.step_times = [] if until is not None else None

    def _move(self, plan: Plan, lowered: Lowered, cuts: tuple[str, ...], batches: int, *,
              times: tuple[float, ...] | None, estimated: tuple[float, ...] | None) -> tuple[Plan, Lowered]:
        """Drain, re-split at ``cuts``, give the re-built stages the state of the ones they replace, go on."""
        assert self._replanner is not None
        rt = self._runtime
        rt.drain()
        runners = list(rt.runners)
        snapshot = StateSnapshot.of(runners)
        moved = ", ".join(f"the cut after {a!r} to {b!r}" for a, b in zip(plan.cuts, cuts) if a != b)
        how = "measured" if times is not None else "asked"
        new_plan, new = self._replanner.recut(cuts, seed=head_seed(self._config.seed, batches),
                                              note=f"rebalanced before batch {batches} ({how}): moved {moved}")
        changed = [j for j in range(new_plan.num_stages)
                   if new.modules[j] is not lowered.modules[j] or new.heads[j] is not lowered.heads[j]]
        fresh = make_runners(new_plan, new, self._config, changed, [torch.device(new_plan.devices[j]) for j in changed])
        carry_state(snapshot, fresh)
        for j, r in zip(changed, fresh):
            r.step_times = runners[j].step_times
            runners[j] = r
        needs = [bool(getattr(h, "needs_input", False)) for h in new.heads]
        for j, r in enumerate(runners):
            r.plan, r.carry_raw = new_plan.stages[j], any(needs[j + 1:])
        rt.replace_runners(runners)
        self._visited.add(cuts)
        self.rebalances.append(Move(batch=batches, old_cuts=plan.cuts, new_cuts=cuts, times=times,
                                    estimated=estimated))
        return new_plan, new

"""Tied parameters across cuts (a parameter used on both sides of one): the cuts and stages a ``ppll`` plan is asked
for under ``tied=``, the parameters its chosen cuts untie, and whether lowering unties them."""

from __future__ import annotations

import bisect
import dataclasses
import warnings
from collections.abc import Sequence

from ..analysis.analyse import Analysis
from ..analysis.cut_heads import FindBlocks
from ..analysis.usable import drop_blockless_cuts, drop_unusable_cuts
from ..errors import CutError, user_stacklevel
from ..heads.policy import Policy
from ..options import PlanOptions, SavedPlan
from ..plans.plan import Plan
from .partition import StageRequest, stage_request


def usable_cuts(a: Analysis, policy: Policy, opts: PlanOptions, saved: SavedPlan | None, name: str,
                find: FindBlocks) -> tuple[Analysis, StageRequest, str | None]:
    """``a`` with only the cuts a ``ppll`` plan of model ``name`` can use, the stages asked for, and why tied
    parameters are untied automatically (``None``: they are not).

    A cut with a parameter used on both sides of it is dropped (``tied='error'``) or kept (``tied='untie'``);
    ``tied='auto'`` drops such cuts when the stages asked for (their number, or the cuts given by hand) can do
    without them, and keeps them otherwise. Under ``tied='error'``, a request that only such cuts would satisfy is
    refused leading with ``tied='untie'``."""

    def usable(tied: str) -> tuple[Analysis, StageRequest]:
        kept = drop_blockless_cuts(drop_unusable_cuts(a, policy, tied, name), policy, find)
        return kept, stage_request(kept, opts, saved)

    if opts.tied == "untie":
        return (*usable("untie"), None)
    try:
        return (*usable("error"), None)
    except CutError as e:
        refused = e
    try:
        loose, request = usable("untie")
    except CutError as e:
        raise (refused if opts.tied == "error" else e) from None
    manual = request.manual is not None
    if opts.tied == "error":
        if manual:  # the cut given by hand names the parameter and tied='untie' first
            raise refused
        strict = loose.drop_shared_cuts()
        k, total = len(strict.cuts), len(loose.cuts)
        shared = loose.shared_across([c for c in loose.cuts if c not in strict.cuts])
        raise CutError(f"cannot cut {name} into {request.stages} stages with tied='error': "
                       f"{_parameters(shared)} used on both sides of "
                       + (f"all {total} of its legal cut points" if k == 0 else
                          f"{total - k} of its {total} legal cut points, leaving {k}")
                       + "; pass tied='untie' (each later stage trains its own copy; the model keeps the first "
                         "stage's)" + (f", or plan at most {k + 1} stages (gpus={k + 1} or fewer)" if k else ""))
    why = ("the cuts given by hand (split_points or a saved plan) fall between {uses}" if manual else
           f"{name} has too few legal cuts for {request.stages} stages otherwise")
    return loose, request, why


def untie(a: Analysis, plan: Plan, why: str | None) -> Plan:
    """``plan`` with the parameters its stages use on both sides of a cut untied (``Plan.untied``) and its notes on
    them; where ``tied='auto'`` untied them (``why``, from :func:`usable_cuts`), that note is warned too."""
    untied = _untied(a, plan)
    if not untied:
        return plan
    plan = dataclasses.replace(plan, untied=tuple(name for names, _ in untied for name in names),
                               notes=(*plan.notes, *(note for _, note in untied)))
    if why is not None:
        note = _auto_untie_note(plan.untied, why)
        warnings.warn(note, UserWarning, stacklevel=user_stacklevel())
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    return plan


def lowers_untied(opts: PlanOptions, plan: Plan) -> bool:
    """Whether lowering gives each later stage its own copy of a tied parameter: under ``tied='untie'``, or where
    ``plan`` unties parameters."""
    return opts.tied == "untie" or bool(plan.untied)


def _parameters(names: Sequence[str]) -> str:
    """``parameter a is`` or ``parameters a, b are``."""
    return f"parameter {names[0]} is" if len(names) == 1 else f"parameters {', '.join(names)} are"


def _auto_untie_note(untied: Sequence[str], why: str) -> str:
    """The plan's note (and the warning) on the parameters ``tied='auto'`` untied, ``why`` naming ``{uses}``."""
    it, uses = ("it", "its uses") if len(untied) == 1 else ("them", "their uses")
    return (f"{_parameters(untied)} untied (tied='auto'): {why.format(uses=uses)}, so each later stage that uses "
            f"{it} trains its own copy and the model keeps the first stage's; pass tied='error' to refuse, or "
            f"tied='untie' to untie without this warning")


def _untied(a: Analysis, plan: Plan) -> list[tuple[list[str], str]]:
    """The parameters stages use on both sides of a chosen cut (``tied='untie'``), by the stages that use them:
    per tensor, its names joined by `` = ``; and the plan's note on them."""
    order = {n.name: i for i, n in enumerate(a.nodes)}
    ends = [order[c] for c in plan.cuts]
    by_stages: dict[tuple[int, int], list[str]] = {}
    for lo, hi, names in a.shared_parameters():
        first, last = bisect.bisect_left(ends, lo), bisect.bisect_left(ends, hi)
        if first != last:
            by_stages.setdefault((first, last), []).append(" = ".join(names))
    return [(names, (f"tied parameter(s) {', '.join(names)} used by stages {first} to {last}: untied, each stage "
                     f"trains its own copy; the model keeps stage {first}'s"))
            for (first, last), names in sorted(by_stages.items())]

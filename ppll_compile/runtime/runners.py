"""The runners of a plan's stages, chosen by the plan's kind: PPLL stages or Pipe-BD stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..capture.meta import check_materialized
from ..lower.stages import Lowered
from ..plans.plan import Plan
from .config import TrainConfig
from .pipebd import DistillRunner
from .ppll import StageRunner
from .runner import Runner


def make_runners(plan: Plan, lowered: Lowered, config: TrainConfig, indices: Sequence[int],
                 devices: Sequence[torch.device], groups: Sequence[Any] | None = None) -> list[Runner]:
    """Runners for the stages ``indices`` of ``plan`` on ``devices``, in replica ``groups`` (one per index)."""
    groups = groups or [None] * len(indices)
    if plan.mode == "pipebd":
        return [DistillRunner(stage=plan.stages[i], teacher=[lowered.teacher[k] for k in plan.stages[i].blocks],
                              student=[lowered.modules[k] for k in plan.stages[i].blocks],
                              losses=[lowered.losses[k] for k in plan.stages[i].blocks], device=d, config=config,
                              group=g)
                for i, d, g in zip(indices, devices, groups)]
    for i in indices:
        for k in plan.stages[i].blocks or (i,):
            check_materialized(i, lowered.modules[k], lowered.heads[k])
    needs = [bool(getattr(h, "needs_input", False)) for h in lowered.heads]
    return [StageRunner(stage=lowered.modules[i], head=lowered.heads[i], plan=plan.stages[i], device=d,
                        config=config, carry_raw=any(needs[i + 1:]), group=g)
            for i, d, g in zip(indices, devices, groups)]

"""Cuts that keep the batch first: a cut whose tensor folds the batch into another dimension (``(batch x patches,
...)`` inside a TNT block) is dropped at plan time with a note, and refused when no other cut is left."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import CutError, PlanError
from ppll_compile.analysis.batch_cuts import FOLDED


pytestmark = pytest.mark.usefixtures("quietly")  # no CPU-fallback warnings of compile


class Folding(nn.Module):
    """(B, 16) features, regrouped as (4B, 4) for two inner layers (the batch folded), then back to (B, 16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.inner1, self.inner2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        p = torch.relu(self.inner1(h.reshape(-1, 4)))
        p = torch.relu(self.inner2(p))
        h = torch.relu(self.b(p.reshape(-1, 16)))
        return self.c(h)


FOLDED_NOTE = (f"5 of 10 legal cuts dropped: {FOLDED} ((8, 4) at batch 2, (12, 4) at batch 3)")


def test_cuts_that_fold_the_batch_are_dropped_and_the_plan_trains():
    model, x = Folding(), torch.randn(2, 16)
    c = ppll_compile.compile(model, 3, example_inputs=(x,))
    assert FOLDED_NOTE in c.plan.notes
    boundaries = [s.boundary[0].shape for s in c.plan.stages[:-1]]
    assert all(shape[0] == 2 for shape in boundaries)
    with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="sequential") as trainer:
        losses = trainer.step(x, torch.tensor([0, 2]))
        trainer.finish()
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(ls)).all() for ls in losses)
    with pytest.raises(CutError, match=re.escape("cannot cut after 'inner1': its tensor's first dimension is not "
                                                 "the batch ((8, 4) at batch 2, (12, 4) at batch 3)")):
        ppll_compile.plan(model, example_inputs=(x,), split_points=["inner1"])


class AllFolded(nn.Module):
    """Every cut folds the batch: the layers run on (4B, 4) rows, the output is reshaped back to (B, 12)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        p = torch.relu(self.l1(x.reshape(-1, 4)))
        p = torch.relu(self.l2(p))
        return self.l3(p).reshape(-1, 12)


def test_a_model_whose_every_cut_folds_the_batch_is_refused_with_the_ways_out():
    with pytest.raises(PlanError) as info:
        ppll_compile.plan(AllFolded(), 2, example_inputs=(torch.randn(2, 16),))
    assert str(info.value) == (
        "AllFolded cannot be split into 2 stages: 6 of its 6 legal cuts fold the batch into another dimension (the "
        "tensor after 'reshape' is (8, 4) at batch 2, (12, 4) at batch 3), and a "
        "stage's head would read that dimension as the batch; 0 cut(s) keep the batch first. Ways out: gpus=1 (one "
        "stage), or split_points=[...module names...] naming modules whose output keeps the batch first (the "
        "modules not holding them then stay opaque)")


class OneBatchSize(Folding):
    """Takes batches of exactly 2 rows (a reshape to a fixed size)."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h.reshape(2, 16))))


def test_a_graph_that_takes_one_batch_size_keeps_its_cuts_with_a_note():
    c = ppll_compile.plan(OneBatchSize(), 2, example_inputs=(torch.randn(2, 16),))
    assert c.num_stages == 2
    assert ("the cuts were checked for keeping the batch first at the planned batch size only: the graph does not "
            "run at batch size 3 (RuntimeError: shape '[2, 16]' is invalid for input of size 48)") in c.notes


class Gate(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


class ValueGated(Folding):
    """Reads a tensor's value in an opaque module: no fake run at all."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return self.c(torch.relu(self.b(self.gate(torch.relu(self.a(x))))))


def test_a_graph_that_does_not_run_on_fake_tensors_keeps_its_cuts_with_a_note():
    c = ppll_compile.plan(ValueGated(), 2, example_inputs=(torch.randn(2, 16),), leaf_modules=["gate"])
    assert c.num_stages == 2
    note = next(n for n in c.notes if n.startswith("the cuts were checked"))
    assert note.startswith("the cuts were checked for keeping the batch first at the planned batch size only: the "
                           "graph does not run on fake tensors (")

"""Facts a later step needs are plan fields, never prose read back from the notes: the front end that captured the
model (``tracer``) and the untied parameters (``untied``); plan files from before the fields still load; the
analysis every step reads is not changed once it is made."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import Plan, PlanError
from ppll_compile.analysis.analyse import analyse
from ppll_compile.options import PlanOptions
from tests.helpers import ShapeLoop

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def test_fields_round_trip_and_are_checked():
    torch.manual_seed(0)
    plan = ppll_compile.plan(ShapeLoop(), 2, example_inputs=(torch.randn(16, 12),), profile="flops",
                             devices=["cpu"] * 2)
    assert (plan.tracer, plan.untied) == ("export", ())
    untied = dataclasses.replace(plan, untied=("shared.weight", "a.w = b.w"))
    for text, read in ((untied.to_json(), Plan.from_json), (untied.to_yaml(), Plan.from_yaml)):
        assert read(text) == untied
    d = plan.to_dict()
    with pytest.raises(PlanError, match=r"^plan tracer 'jit' is not known; tracers: fx, export$"):
        Plan.from_dict({**d, "tracer": "jit"})


def test_a_plan_file_from_before_the_fields_reads_them_from_its_notes_once():
    torch.manual_seed(0)
    d = ppll_compile.plan(ShapeLoop(), 2, example_inputs=(torch.randn(16, 12),), profile="flops", tracer="export",
                          devices=["cpu"] * 2).to_dict()
    old = {k: v for k, v in d.items() if k not in ("tracer", "untied")}
    old["notes"] = ["captured with torch.export (symbolic tracing cannot take it: torch.fx cannot trace ShapeLoop)",
                    "tied parameter(s) shared.weight, shared.bias used by stages 0 to 1: untied, each stage trains "
                    "its own copy; the model keeps stage 0's",
                    "tied parameter(s) emb.weight = lm.weight used by stages 0 to 2: untied, each stage trains its own "
                    "copy; the model keeps stage 0's"]
    plan = Plan.from_json(json.dumps(old))
    assert plan.tracer == "export"
    assert plan.untied == ("shared.weight", "shared.bias", "emb.weight = lm.weight")
    assert plan.notes == tuple(old["notes"])
    plain = Plan.from_dict({**old, "notes": ["the stages run on the CPU"]})
    assert (plain.tracer, plain.untied) == ("fx", ())
    written = Plan.from_dict({**old, "tracer": "fx", "untied": []})  # a file that has the fields: they count
    assert (written.tracer, written.untied) == ("fx", ())


def test_the_analysis_is_not_changed_by_the_steps_that_drop_cuts():
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5), nn.Flatten())
    a = analyse(model, (torch.randn(4, 12),), None, PlanOptions(gpus=2))
    cuts, notes = list(a.cuts), a.notes
    b = a.drop_untrained_cuts()
    assert (a.cuts, a.notes, a.dropped) == (cuts, notes, {})
    assert len(b.cuts) < len(cuts) and b.notes == (*notes, b.notes[-1]) and set(b.dropped) == \
        {c.node for c in cuts} - {c.node for c in b.cuts}
    assert b.notes[-1].startswith(f"{len(cuts) - len(b.cuts)} of {len(cuts)} legal cuts dropped: a stage would have")
    assert b.drop_untrained_cuts() is b  # nothing more to drop
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.cuts = []  # type: ignore[misc]

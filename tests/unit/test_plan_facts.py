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

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


class Block(nn.Module):
    """A residual block: the legal cuts of :class:`ShapeLoop` lie between blocks."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.lin(x))


class ShapeLoop(nn.Module):
    """How many blocks run depends on the input's width: symbolic tracing cannot take it, ``torch.export`` can."""

    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(12, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.out = nn.Linear(d, 5)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for b in self.blocks[: x.shape[1] // 4]:
            x = b(x)
        return self.out(x)


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(n)]


def _compile(model: nn.Module, **options) -> ppll_compile.CompiledPipeline:
    return ppll_compile.compile(model, example_inputs=(torch.randn(16, 12),), profile="flops",
                                devices=["cpu"] * 3, **options)


def test_an_exported_model_moves_its_cuts_and_stays_exported(tmp_path):
    torch.manual_seed(0)
    model = ShapeLoop()
    compiled = _compile(model, split_points=["add", "add_2"])
    assert compiled.plan.tracer == "export"
    assert compiled.plan.notes[0].startswith("captured with torch.export (symbolic tracing cannot take it")
    data = _batches(3)
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05)) as trainer:
        trainer.step(*data[0])
        moved = trainer.move_cut(0, "add_1")  # planned again through torch.export
        trainer.step(*data[1])
        trainer.finish()
    assert (moved.cuts, moved.tracer) == (("add_1", "add_2"), "export")
    assert compiled.plan is moved and compiled.plan.tracer == "export"
    x = data[2][0]
    with torch.no_grad():
        assert torch.equal(compiled.eval()(x), model.eval()(x))  # the moved pipeline is still the model

    saved = moved.save(tmp_path / "plan.yaml")  # re-applying the saved plan captures the model the same way
    again = _compile(model, plan=saved)
    assert (again.plan.cuts, again.plan.tracer) == (("add_1", "add_2"), "export")
    assert Plan.load(saved).tracer == "export"


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

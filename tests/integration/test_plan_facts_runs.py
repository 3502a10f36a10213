"""Facts a later step needs are plan fields, never prose read back from the notes: the front end that captured the
model (``tracer``) and the untied parameters (``untied``); plan files from before the fields still load; the
analysis every step reads is not changed once it is made."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import Plan
from tests.helpers import ShapeLoop

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


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

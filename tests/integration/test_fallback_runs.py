"""``tracer='auto'``: whatever makes symbolic tracing fail, ``torch.export`` is tried next and the plan's notes say why;
a library's registered untraceable helpers are kept whole before that; a branch on ``self.training`` in ``forward``
itself is refused with the exact call that takes it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torchvision

import ppll_compile
from ppll_compile import TraceError
from ppll_compile.capture.frontends import LIBRARY_NOTE, capture
from ppll_compile.capture.trace import trace


WAYS_OUT = ("so one captured graph cannot behave like the model in both, whichever the tracer. Ways out: keep the "
            "train-mode branch in train and eval alike with `ppll_compile.compile(model, ..., bake_train_mode=True)` "
            "(ppll_compile.plan takes it too, ppll-plan --bake-train-mode), or move that branch into a submodule (it "
            "then stays opaque and switches with the mode)")


@pytest.mark.slow
def test_googlenet_is_refused_with_the_exact_call_and_that_call_trains(monkeypatch):
    torch.manual_seed(0)
    model = torchvision.models.googlenet(aux_logits=True, init_weights=False, num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    with pytest.raises(TraceError) as info:
        ppll_compile.compile(model, 2, example_inputs=(x,))
    assert str(info.value).startswith("GoogLeNet.forward computes differently in train and in eval mode (it branches "
                                      "on self.training around 'adaptive_avg_pool2d', ")
    assert str(info.value).endswith(WAYS_OUT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(model, 2, example_inputs=(x,), bake_train_mode=True, num_classes=10)
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="sequential") as trainer:
        losses = trainer.step(x, torch.tensor([1, 7]))
        trainer.finish()
    assert len(losses) == 2 and all(math.isfinite(v) for ls in losses for v in ls)


def _nest():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("nest_tiny", img_size=32, num_classes=10)


@pytest.mark.slow
def test_timm_nest_is_traced_with_the_helpers_timm_marks_untraceable_kept_whole():
    model, x = _nest(), torch.randn(2, 3, 32, 32)
    with pytest.raises(TraceError) as info:  # plain symbolic tracing
        trace(model, example_inputs=(x,))
    first = str(info.value).splitlines()[0]
    assert "grid_size = int(math.sqrt(T))" in first
    c = capture(model, (x,), {})
    assert c.tracer == "fx"
    assert c.notes == (f"{LIBRARY_NOTE} (plain symbolic tracing cannot take it: {first.split(';')[0]})",)
    assert any(n.op == "call_function" and n.target.__name__ == "deblockify" for n in c.gm.graph.nodes)
    c.gm.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(c.gm(x), model(x))
    c.gm.train(), model.train()  # drop path follows the mode: the same draws give the same output
    torch.manual_seed(1)
    a = c.gm(x)
    torch.manual_seed(1)
    assert torch.equal(a, model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the stages run on the CPU
        compiled = ppll_compile.compile(model, 2, example_inputs=(x,))
    assert compiled.plan.tracer == "fx" and compiled.plan.notes[0] == c.notes[0]
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="sequential") as trainer:
        losses = trainer.step(x, torch.tensor([1, 7]))
        trainer.finish()
    assert len(losses) == 2 and all(math.isfinite(v) for ls in losses for v in ls)

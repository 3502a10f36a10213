"""Tracing keeps train/eval behaviour switchable and fails with one teaching error."""

import re

import pytest
import torch
from models import DataDependent, DictOut, Residual, WithNoisy

from ppll_compile.capture.modes import TrainEval
from ppll_compile.capture.trace import trace
from ppll_compile.errors import TraceError


def test_functional_dropout_follows_the_mode():
    model = WithNoisy()
    gm = trace(model, example_inputs=(torch.randn(2, 4),))
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls][::2] == ["l1", "l2"]
    assert isinstance(gm.get_submodule(calls[1].target), TrainEval) and calls[1].name == "dropout"
    x = torch.randn(3, 4)
    gm.eval(), model.eval()
    torch.testing.assert_close(gm(x), model(x))  # eval: dropout off in both
    gm.train()
    torch.manual_seed(0)
    a = gm(x)
    torch.manual_seed(1)
    assert not torch.allclose(a, gm(x))  # train: dropout still on


def test_tracing_restores_the_models_mode():
    model = Residual().eval()
    trace(model, example_inputs=(torch.randn(1, 3, 8, 8),))
    assert not any(m.training for m in model.modules())


def test_leaf_modules_by_name_and_type():
    model = Residual()
    gm = trace(model, example_inputs=(torch.randn(1, 3, 8, 8),), leaf_modules=["a1", torch.nn.Linear])
    assert {n.target for n in gm.graph.nodes if n.op == "call_module"} >= {"a1", "fc"}
    with pytest.raises(TraceError, match=re.escape("leaf_modules names 'a3', which is not a submodule of "
                                                   "Residual; did you mean")):
        trace(model, example_inputs=(torch.randn(1, 3, 8, 8),), leaf_modules=["a3"])


def test_untraceable_model_names_module_line_and_ways_out():
    with pytest.raises(TraceError) as info:
        trace(DataDependent(), example_inputs=(torch.randn(2, 4),))
    msg = str(info.value)
    assert "in module 'gate'" in msg
    assert "models.py:" in msg and "`if x.sum() > 0:`" in msg
    assert "leaf_modules=['gate']" in msg and "split_points=" in msg


def test_split_points_make_untraceable_parts_opaque():
    model = DataDependent()
    gm = trace(model, example_inputs=(torch.randn(2, 4),), split_points=["pre", "gate"])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["pre", "gate", "post"]
    x = torch.randn(5, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_optional_kwarg_is_fixed_to_its_default():
    model = DictOut()
    gm = trace(model, example_inputs=(torch.randn(2, 4),))
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    x = torch.randn(2, 4)
    out = gm(x)
    torch.testing.assert_close(out["logits"], model(x)["logits"])


def test_missing_required_argument_is_named():
    from models import TwoInputs
    with pytest.raises(TraceError, match=re.escape("TwoInputs.forward needs argument 'b'")):
        trace(TwoInputs(), example_inputs=(torch.randn(2, 4),))

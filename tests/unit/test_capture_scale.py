"""Capture and costing that scale with depth: one export where the mode changes nothing, no symbolic trace tried on
models known to need ``torch.export``, a repeated decoder layer measured once, and operator timing within a budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ppll_compile.capture.export import ONCE_NOTE, mode_matters
from ppll_compile.capture.frontends import capture
from ppll_compile.cost import roofline
from ppll_compile.cost.oplog import OpLog
from ppll_compile.errors import TraceError
from ppll_compile.plans.file import EXPORT_NOTE


class _Pick(nn.Module):
    """Reads one of two buffers of the same shape by mode: the same operators run, on different values."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.ones(4))
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.a if self.training else self.b)


def _mlp(p: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(p), nn.ReLU(), nn.Linear(8, 4))


def test_the_mode_matters_where_it_changes_an_operator_or_a_value():
    x = {"input": torch.randn(2, 4)}
    assert not mode_matters(_mlp(0.0), x)  # dropout of probability 0 runs no operator in either mode
    assert mode_matters(_mlp(0.1), x)
    assert mode_matters(nn.Sequential(nn.BatchNorm1d(4)), x)
    assert mode_matters(_Pick(), {"x": torch.randn(2, 4)})  # same operators, other values
    assert not mode_matters(nn.Sequential(nn.Linear(4, 4)), x)
    with torch.device("meta"):  # a model built without weights: its inputs are taken to the meta device
        assert not mode_matters(_mlp(0.0), x)


def _counting_exports(monkeypatch) -> list[bool]:
    calls: list[bool] = []
    real = torch.export.export

    def counted(model, *args, **kwargs):
        calls.append(model.training)
        return real(model, *args, **kwargs)
    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def test_export_captures_one_mode_where_the_mode_changes_nothing(monkeypatch):
    calls = _counting_exports(monkeypatch)
    model, x = _mlp(0.0), torch.randn(3, 4)
    once = capture(model, (x,), {}, tracer="export")
    assert calls == [True] and once.notes == (EXPORT_NOTE, ONCE_NOTE)
    for training in (True, False):
        model.train(training)
        once.gm.train(training)
        assert torch.equal(once.gm(x)[0], model(x))

    calls.clear()
    model = _mlp(0.5)
    twice = capture(model, (x,), {}, tracer="export")
    assert calls == [True, False] and twice.notes == (EXPORT_NOTE,)
    model.eval()
    twice.gm.eval()
    assert torch.equal(twice.gm(x)[0], model(x))
    calls.clear()
    with pytest.raises(TraceError, match=r"^_Pick computes differently in train and in eval mode"):
        capture(_Pick(), (x,), {}, tracer="export")  # both modes captured, so the difference is seen
    assert calls == [True, False]


def test_operator_timing_prices_a_call_over_the_budget_by_the_roofline(monkeypatch):
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with OpLog() as log:
        a @ b
    call = log.ops[0].call
    allocated = []
    real = roofline._rebuild

    def rebuild(value, device, generator):
        made = real(value, device, generator)
        if device.type != "meta" and value is call[1]:
            allocated.append(value)  # one set of arguments made
        return made
    monkeypatch.setattr(roofline, "_rebuild", rebuild)
    assert list(roofline.measure_calls([call], torch.device("cpu"))) == [repr(call)]
    need = (64 * 32 + 32 * 16 + 64 * 16) * 4  # both arguments and the output
    allocated.clear()
    monkeypatch.setattr(roofline, "TIMING_BUDGET", need - 1)
    assert roofline.measure_calls([call], torch.device("cpu")) == {}
    assert allocated == []  # sized on the meta device, nothing made
    monkeypatch.setattr(roofline, "TIMING_BUDGET", need)
    assert list(roofline.measure_calls([call], torch.device("cpu"))) == [repr(call)]
    assert len(allocated) == 1  # no room for rotating copies
    allocated.clear()
    monkeypatch.setattr(roofline, "TIMING_BUDGET", need + 3 * (64 * 32 + 32 * 16) * 4)
    roofline.measure_calls([call], torch.device("cpu"))
    assert len(allocated) == 4  # room for three copies

"""``tracer='auto'``: whatever makes symbolic tracing fail, ``torch.export`` is tried next and the plan's notes say why;
a library's registered untraceable helpers are kept whole before that; a branch on ``self.training`` in ``forward``
itself is refused with the exact call that takes it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import fx, nn
from ppll_compile import TraceError
from ppll_compile.capture.frontends import capture
from ppll_compile.plans.file import EXPORT_NOTE


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 3)


class RaisesFxError(_Base):
    """Refuses symbolic tracing itself, with torch.fx's own TraceError."""

    def forward(self, x):
        h = self.a(x)
        if isinstance(h, fx.Proxy):
            raise fx.proxy.TraceError("this block cannot be traced symbolically")
        return self.b(h)


class SqrtGrid(_Base):
    """Reads a shape through ``int(math.sqrt(...))``: torch.fx wraps math.sqrt, and int() of a Proxy fails."""

    def forward(self, x):
        h = self.a(x)
        side = int(math.sqrt(h.shape[1]))
        return self.b(h.reshape(h.shape[0], side, side).flatten(1))


class BuiltinLen(_Base):
    """Calls a Python builtin (len) on a traced value."""

    def forward(self, x):
        h = self.a(x)
        return self.b(h) * (len(h) > 0)


def _fx_first_line(model: nn.Module, x: torch.Tensor) -> str:
    with pytest.raises(TraceError) as info:
        capture(model, (x,), {}, tracer="fx")
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize(("cls", "cause"), [(RaisesFxError, "TraceError: this block cannot be traced symbolically"),
                                            (SqrtGrid, "TypeError: int() argument must be"),
                                            (BuiltinLen, "'len' is not supported in symbolic tracing")])
def test_auto_takes_torch_export_after_any_tracing_failure_and_says_why(cls, cause):
    model, x = cls().eval(), torch.randn(4, 16)
    first = _fx_first_line(model, x)
    assert cause in first and f"torch.fx cannot trace {cls.__name__}: in {cls.__name__}.forward at " in first
    c = capture(model, (x,), {})
    assert c.tracer == "export"
    assert c.notes[0] == f"{EXPORT_NOTE} (symbolic tracing cannot take it: {first.split(';')[0]})"
    with torch.no_grad():
        assert torch.equal(c.gm(x)[0] if isinstance(c.gm(x), (tuple, list)) else c.gm(x), model(x))


def test_an_error_that_is_not_a_trace_error_also_falls_back(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("tracer broke")
    monkeypatch.setattr("ppll_compile.capture.frontends.trace", boom)
    c = capture(RaisesFxError(), (torch.randn(4, 16),), {})
    assert c.tracer == "export"
    assert c.notes[0] == (f"{EXPORT_NOTE} (symbolic tracing cannot take it: torch.fx cannot trace RaisesFxError: "
                          f"RuntimeError: tracer broke)")
    with pytest.raises(TraceError, match="^torch.fx cannot trace RaisesFxError: RuntimeError: tracer broke$"):
        capture(RaisesFxError(), (torch.randn(4, 16),), {}, tracer="fx")


class ValueBranch(_Base):
    """Branches on a tensor's value: neither front end takes it."""

    def forward(self, x):
        h = self.a(x)
        return self.b(h if h.sum() > 0 else -h)


def test_when_both_front_ends_fail_the_error_gives_both_causes_and_their_ways_out():
    x = torch.randn(4, 16)
    with pytest.raises(TraceError) as fx_only:
        capture(ValueBranch(), (x,), {}, tracer="fx")
    with pytest.raises(TraceError) as both:
        capture(ValueBranch(), (x,), {})
    text = str(both.value)
    fx_part, export_part = text.split("\nThe other front end, torch.export, cannot capture it either: ")
    assert fx_part == str(fx_only.value) and "Ways out: " in fx_part
    assert export_part.startswith("torch.export cannot capture ValueBranch: ")


class RootBranch(_Base):
    def forward(self, x):
        h = self.a(x)
        if self.training:
            h = h * 2
        return self.b(h)


WAYS_OUT = ("so one captured graph cannot behave like the model in both, whichever the tracer. Ways out: keep the "
            "train-mode branch in train and eval alike with `ppll_compile.compile(model, ..., bake_train_mode=True)` "
            "(ppll_compile.plan takes it too, ppll-plan --bake-train-mode), or move that branch into a submodule (it "
            "then stays opaque and switches with the mode)")


def test_a_branch_on_training_in_forward_names_the_exact_call_and_skips_torch_export(monkeypatch):
    def no_export(*args, **kwargs):
        raise AssertionError("torch.export was tried")
    monkeypatch.setattr("ppll_compile.capture.frontends.export", no_export)
    with pytest.raises(TraceError) as info:
        capture(RootBranch(), (torch.randn(4, 16),), {})
    assert str(info.value) == ("RootBranch.forward computes differently in train and in eval mode (it branches on "
                               f"self.training around 'mul'), {WAYS_OUT}")

"""Capture and costing that scale with depth: one export where the mode changes nothing, no symbolic trace tried on
models known to need ``torch.export``, a repeated decoder layer measured once, and operator timing within a budget."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from ppll_compile.capture.export import ONCE_NOTE, mode_matters
from ppll_compile.capture.frontends import capture
from ppll_compile.cost import nodes as cost
from ppll_compile.cost import roofline
from ppll_compile.cost.nodes import META_KEY, measure_graph
from ppll_compile.cost.oplog import OpLog
from ppll_compile.errors import TraceError
from ppll_compile.plans.file import EXPORT_NOTE

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


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


def _llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                        bos_token_id=0, eos_token_id=0))


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


@needs_transformers
def test_a_hugging_face_model_goes_straight_to_torch_export(monkeypatch):
    from transformers import PretrainedConfig, PreTrainedModel

    def no_trace(*args, **kwargs):
        raise AssertionError("symbolic tracing was tried")
    monkeypatch.setattr("ppll_compile.capture.frontends.trace", no_trace)
    ids = torch.randint(0, 128, (2, 8))
    c = capture(_llama(1), (), {"input_ids": ids})
    assert c.tracer == "export"
    assert c.notes[0] == (f"{EXPORT_NOTE} (symbolic tracing cannot take it: LlamaForCausalLM.forward takes *args or "
                          f"**kwargs, which torch.fx cannot trace)")

    class Plain(PreTrainedModel):  # a forward fx could trace: not tried either
        config_class = PretrainedConfig

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)
    c = capture(Plain(PretrainedConfig()), (torch.randn(2, 4),), {})
    assert c.tracer == "export"
    assert c.notes[0] == (f"{EXPORT_NOTE} (symbolic tracing cannot take it: Plain is a transformers PreTrainedModel, "
                          f"whose forward torch.fx does not take)")


def _measured(layers: int, monkeypatch, reuse: bool = True) -> tuple[int, dict]:
    """How many nodes of an exported Llama are measured by running them, and every node's cost."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    c = capture(_llama(layers), (), {"input_ids": ids})
    runs = []
    real = cost.flop_counter
    monkeypatch.setattr(cost, "flop_counter", lambda: runs.append(1) or real())
    measure_graph(c.gm, c.inputs, reuse=reuse)
    monkeypatch.setattr(cost, "flop_counter", real)
    return len(runs), {n.name: n.meta[META_KEY] for n in c.gm.graph.nodes if n.op != "output"}


@pytest.mark.slow
@needs_transformers
def test_repeated_decoder_layers_of_an_exported_llama_are_measured_once(monkeypatch):
    two, costs = _measured(2, monkeypatch)
    six, _ = _measured(6, monkeypatch)
    fresh_runs, fresh = _measured(2, monkeypatch, reuse=False)
    assert six == two < fresh_runs  # layers after the first replay its measurement
    assert costs == fresh


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

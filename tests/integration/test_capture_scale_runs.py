"""Capture and costing that scale with depth: one export where the mode changes nothing, no symbolic trace tried on
models known to need ``torch.export``, a repeated decoder layer measured once, and operator timing within a budget."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn
from ppll_compile.capture.frontends import capture
from ppll_compile.cost import nodes as cost
from ppll_compile.cost.nodes import META_KEY, measure_graph
from ppll_compile.plans.file import EXPORT_NOTE

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def _llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                        bos_token_id=0, eos_token_id=0))


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

"""``compile_stages``: its values read and refused with the way out, and a machine torch.compile cannot serve refused
before any stage trains (nothing here compiles a graph)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.errors import PPLLError
from ppll_compile.runtime.compiled import compile_options, reason


def pipeline() -> ppll_compile.CompiledPipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(model, example_inputs=(torch.randn(4, 8),), policy="dgl", split_points=["2"])


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def test_true_is_inductor_drawing_random_numbers_as_eager_does():
    assert compile_options(True) == {"options": {"fallback_random": True}}
    assert compile_options(False) is None
    assert compile_options({"options": {"fallback_random": False}}) == {"options": {"fallback_random": False}}
    assert compile_options({"backend": "aot_eager", "dynamic": False}) == {"backend": "aot_eager", "dynamic": False}


@pytest.mark.parametrize(("value", "message"), [
    ("yes", (r"compile_stages must be True \(every stage's forward under torch.compile\), False \(eager\) or a dict "
             r"of torch.compile keywords \(backend, mode, options, dynamic, fullgraph\), e.g. "
             r"compile_stages=\{'mode': 'max-autotune'\}; got 'yes'")),
    (1, r"compile_stages must be True .*; got 1"),
    ({"fullgraf": True}, (r"compile_stages got the key\(s\) 'fullgraf', which it does not pass to torch.compile; "
                          r"use only backend, mode, options, dynamic, fullgraph")),
    ({"options": "fast"}, (r"compile_stages\['options'\] must be a dict of inductor settings, e.g. "
                           r"\{'fallback_random': True\}; got 'fast'")),
])
def test_a_value_compile_stages_cannot_take_is_refused_with_the_way_out(value, message):
    with pytest.raises(PPLLError, match=message):
        compile_options(value)


def test_inductor_on_a_cpu_without_a_cxx_compiler_is_refused_before_any_stage_trains(monkeypatch):
    pipe = pipeline()
    start = [p.detach().clone() for p in pipe.model.parameters()]
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    with pytest.raises(PPLLError, match=r"compile_stages is on and stage 0 runs on the CPU, where torch.compile's "
                                        r"inductor backend builds C\+\+ kernels, but the C\+\+ compiler "
                                        r"'no-such-c\+\+-compiler' \(\$CXX\) is not on PATH; install one \(e.g. "
                                        r"apt-get install g\+\+\) or point CXX at one, pass "
                                        r"compile_stages=\{'backend': 'aot_eager'\} \(compiled graphs without built "
                                        r"kernels\), or compile_stages=False \(eager\)"):
        pipe.trainer(optimizer=sgd, compile_stages=True)
    assert all(torch.equal(a, b) for a, b in zip(pipe.model.parameters(), start))
    with pipe.trainer(optimizer=sgd, compile_stages=False) as trainer:  # the way out trains eagerly
        assert [r.compiler for r in trainer.runners] == [None, None]


def test_the_reason_is_torch_compiles_message_without_its_debugging_advice():
    error = RuntimeError("backend='inductor' raised:\nInvalidCxxCompiler: No working C++ compiler found\n\n"
                         "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
    assert reason(error) == ("RuntimeError: backend='inductor' raised: InvalidCxxCompiler: No working C++ compiler "
                             "found")

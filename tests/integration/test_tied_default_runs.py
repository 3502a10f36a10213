"""Tied parameters under the default ``tied='auto'``: cuts between a parameter's uses are dropped when enough others
are left; otherwise the parameter is untied, with a plan note and a warning that name it and say how to refuse.
``tied='error'`` refuses leading with ``tied='untie'``; ``tied`` takes only its three values.

GPT-2 and BLOOM (their input embedding is their output projection) are built from tiny configs with random
weights: no download.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

import ppll_compile
from ppll_compile import CutError
from tests.helpers import compile_on_cpu_with_warnings

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")


# ---- real models with tied input and output embeddings ------------------------------------------------------------

def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
GPT2_TIED = "lm_head.weight = transformer.wte.weight"


@pytest.mark.slow
@needs_transformers
@pytest.mark.parametrize("stages", [2, 4])
def test_gpt2_compiles_with_the_defaults_and_equals_the_model(stages):
    model = _gpt2()
    compiled, caught = compile_on_cpu_with_warnings(model, stages, example_inputs=(IDS,))
    note = (f"parameter {GPT2_TIED} is untied (tied='auto'): GPT2LMHeadModel has too few legal cuts for {stages} "
            f"stages otherwise, so each later stage that uses it trains its own copy and the model keeps the first "
            f"stage's; pass tied='error' to refuse, or tied='untie' to untie without this warning")
    assert caught == [note]
    assert compiled.plan.notes[-2:] == (
        f"tied parameter(s) {GPT2_TIED} used by stages 0 to {stages - 1}: untied, each stage trains its own copy; "
        f"the model keeps stage 0's", note)
    assert compiled.plan.untied == (GPT2_TIED,)
    assert len(compiled.stages) == stages
    held = [s for s in compiled.stages if any(p is model.transformer.wte.weight for p in s.parameters())]
    assert held == [compiled.stages[0]]
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0)


@pytest.mark.slow
@needs_transformers
def test_gpt2_untie_warning_points_at_the_users_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ppll_compile.compile(_gpt2(), 2, example_inputs=(IDS,), devices=["cpu", "cpu"])
    untie = [w for w in caught if "untied (tied='auto')" in str(w.message)]
    assert [(w.filename, w.lineno) for w in untie] == [(os.path.abspath(__file__), untie[0].lineno)]
    assert "ppll_compile.compile(_gpt2()" in open(__file__).read().splitlines()[untie[0].lineno - 1]


@pytest.mark.slow
@needs_transformers
def test_gpt2_under_tied_error_is_refused_leading_with_the_fix():
    with pytest.raises(CutError) as e:
        ppll_compile.plan(_gpt2(), 2, example_inputs=(IDS,), devices=["cpu", "cpu"], tied="error")
    assert str(e.value) == (
        f"cannot cut GPT2LMHeadModel into 2 stages with tied='error': parameter {GPT2_TIED} is used on both sides "
        f"of all 8 of its legal cut points; pass tied='untie' (each later stage trains its own copy; the model "
        f"keeps the first stage's)")


@pytest.mark.slow
@needs_transformers
def test_bloom_compiles_with_the_defaults_and_equals_the_model():
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=2))
    compiled, caught = compile_on_cpu_with_warnings(model, 2, example_inputs=(IDS,))
    tied = "lm_head.weight = transformer.word_embeddings.weight"
    assert caught == [f"parameter {tied} is untied (tied='auto'): BloomForCausalLM has too few legal cuts for 2 "
                      f"stages otherwise, so each later stage that uses it trains its own copy and the model keeps the "
                      f"first stage's; pass tied='error' to refuse, or tied='untie' to untie without this warning"]
    assert compiled.plan.untied == (tied,)
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0)

"""Tied parameters under the default ``tied='auto'``: cuts between a parameter's uses are dropped when enough others
are left; otherwise the parameter is untied, with a plan note and a warning that name it and say how to refuse.
``tied='error'`` refuses leading with ``tied='untie'``; ``tied`` takes only its three values.

GPT-2 and BLOOM (their input embedding is their output projection) are built from tiny configs with random
weights: no download.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import CutError

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")


class SharedEarly(nn.Module):
    """``shared`` is called before and after ``b``, then ``depth`` more layers: the cuts between the two calls can
    be dropped and a few stages still planned. With ``d=256, depth=0`` the balanced two-stage cut falls between the
    two calls when they are not dropped."""

    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.a = nn.Linear(8, d)
        self.shared = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.tail = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = torch.relu(self.a(x))
        x = torch.relu(self.shared(x))
        x = torch.relu(self.b(x))
        x = torch.relu(self.shared(x))
        return self.head(self.tail(x))


X = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))


def _compile(model: nn.Module, gpus: int | None, **options):
    """``compile`` on CPU devices; the warnings it gives."""
    devices = ["cpu"] * gpus if gpus else ["cpu"] * (len(options.get("split_points", ())) + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = ppll_compile.compile(model, gpus, devices=devices, **options)
    return compiled, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _stage_parameter_ids(compiled) -> list[int]:
    return [id(p) for s in compiled.stages for p in s.parameters()]


# ---- the option ---------------------------------------------------------------------------------------------

def test_tied_defaults_to_auto_and_takes_only_its_three_values():
    assert ppll_compile.PlanOptions().tied == "auto"
    with pytest.raises(ValueError) as e:
        ppll_compile.plan(SharedEarly(), 2, example_inputs=(X,), tied="yes")
    assert str(e.value) == "tied must be one of 'auto', 'error', 'untie', got 'yes'"


# ---- tied cuts that can simply be dropped -------------------------------------------------------------------------

@pytest.mark.parametrize("width,depth,dropped", [(16, 4, "4 of 16"), (256, 0, "4 of 8")])
def test_auto_drops_the_cuts_between_uses_when_enough_others_are_left(width, depth, dropped):
    torch.manual_seed(0)
    model = SharedEarly(width, depth)
    compiled, caught = _compile(model, 2, example_inputs=(X,), policy="dgl")
    assert caught == []  # no untie warning
    assert compiled.plan.untied == ()
    assert not any("untied" in n for n in compiled.plan.notes)
    assert (f"{dropped} legal cuts dropped: parameters used on both sides (parameter shared.weight is used on both "
            f"sides of it; pass tied='untie' to give each later stage its own copy)") in compiled.plan.notes
    ids = _stage_parameter_ids(compiled)
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each of the model's own, exactly once
    compiled.eval()
    with torch.no_grad():
        assert torch.equal(compiled(X), model.eval()(X))


# ---- too few cuts without the tied ones ---------------------------------------------------------------------------

AUTO_NOTE = ("parameters shared.weight, shared.bias are untied (tied='auto'): SharedEarly has too few legal cuts for "
             "14 stages otherwise, so each later stage that uses them trains its own copy and the model keeps the "
             "first stage's; pass tied='error' to refuse, or tied='untie' to untie without this warning")


def test_auto_unties_when_the_stages_need_the_tied_cuts_with_a_note_and_a_warning():
    torch.manual_seed(0)
    model = SharedEarly()
    compiled, caught = _compile(model, 14, example_inputs=(X,), policy="dgl")
    assert caught == [AUTO_NOTE]
    assert compiled.plan.notes[-1] == AUTO_NOTE
    assert compiled.plan.untied == ("shared.weight", "shared.bias")
    assert len(compiled.stages) == 14
    owners = [i for i, s in enumerate(compiled.stages) if any(p is model.shared.weight for p in s.parameters())]
    assert len(owners) == 1  # the model keeps the first stage's; the later stage trains a copy
    compiled.eval()
    with torch.no_grad():
        assert torch.equal(compiled(X), model.eval()(X))


def test_error_refuses_leading_with_tied_untie():
    with pytest.raises(CutError) as e:
        ppll_compile.plan(SharedEarly(), 14, example_inputs=(X,), devices=["cpu"] * 14, policy="dgl", tied="error")
    assert str(e.value) == (
        "cannot cut SharedEarly into 14 stages with tied='error': parameters shared.weight, shared.bias are used on "
        "both sides of 4 of its 16 legal cut points, leaving 12; pass tied='untie' (each later stage trains its own "
        "copy; the model keeps the first stage's), or plan at most 13 stages (gpus=13 or fewer)")


def test_a_cut_given_by_hand_between_two_uses_is_untied_by_default_and_refused_under_error():
    torch.manual_seed(0)
    model = SharedEarly()
    compiled, caught = _compile(model, None, example_inputs=(X,), policy="dgl", split_points=["b"])
    note = ("parameters shared.weight, shared.bias are untied (tied='auto'): the cuts given by hand (split_points "
            "or a saved plan) fall between their uses, so each later stage that uses them trains its own copy and "
            "the model keeps the first stage's; pass tied='error' to refuse, or tied='untie' to untie without this "
            "warning")
    assert caught == [note] and compiled.plan.notes[-1] == note
    with pytest.raises(CutError) as e:
        ppll_compile.plan(SharedEarly(), example_inputs=(X,), policy="dgl", split_points=["b"], tied="error")
    assert str(e.value).startswith("cannot cut after 'b': parameter shared.weight is used on both sides of it; pass "
                                   "tied='untie' to give each later stage its own copy; nearest usable cuts: ")


def test_too_many_stages_even_untied_says_how_many_fit():
    with pytest.raises(CutError) as e:
        ppll_compile.plan(SharedEarly(), 20, example_inputs=(X,), devices=["cpu"] * 20, policy="dgl")
    assert str(e.value) == "plan at most 17 stages (gpus=17 or fewer): the model has 16 legal cut point(s); got gpus=20"


def test_a_model_without_a_cut_says_it_runs_as_one_stage():
    with pytest.raises(CutError) as e:
        ppll_compile.plan(nn.Sequential(nn.Linear(8, 4)), 2, example_inputs=(X,), devices=["cpu"] * 2, policy="dgl")
    assert str(e.value) == "the model has no legal cut point, so it runs as one stage only; got gpus=2"


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
    compiled, caught = _compile(model, stages, example_inputs=(IDS,))
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
    compiled, caught = _compile(model, 2, example_inputs=(IDS,))
    tied = "lm_head.weight = transformer.word_embeddings.weight"
    assert caught == [f"parameter {tied} is untied (tied='auto'): BloomForCausalLM has too few legal cuts for 2 "
                      f"stages otherwise, so each later stage that uses it trains its own copy and the model keeps the "
                      f"first stage's; pass tied='error' to refuse, or tied='untie' to untie without this warning"]
    assert compiled.plan.untied == (tied,)
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0)

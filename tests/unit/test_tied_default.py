"""Tied parameters under the default ``tied='auto'``: cuts between a parameter's uses are dropped when enough others
are left; otherwise the parameter is untied, with a plan note and a warning that name it and say how to refuse.
``tied='error'`` refuses leading with ``tied='untie'``; ``tied`` takes only its three values.

GPT-2 and BLOOM (their input embedding is their output projection) are built from tiny configs with random
weights: no download.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import CutError
from tests.helpers import compile_on_cpu_with_warnings


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
    compiled, caught = compile_on_cpu_with_warnings(model, 2, example_inputs=(X,), policy="dgl")
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
    compiled, caught = compile_on_cpu_with_warnings(model, 14, example_inputs=(X,), policy="dgl")
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
    compiled, caught = compile_on_cpu_with_warnings(model, None, example_inputs=(X,), policy="dgl", split_points=["b"])
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


# ---- the warning points at the user's line ------------------------------------------------------------------------

def _untie_warnings(call) -> list[tuple[str, int]]:
    """``call()``'s tied='auto' warnings as (file, line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [(w.filename, w.lineno) for w in caught if "untied (tied='auto')" in str(w.message)]


def test_the_untie_warning_points_at_the_users_call_of_plan_and_compile():
    here = os.path.abspath(__file__)
    line = inspect.currentframe().f_lineno
    planned = _untie_warnings(lambda: ppll_compile.plan(SharedEarly(), example_inputs=(X,), policy="dgl",
                                                        split_points=["b"], devices=["cpu"] * 2))
    compiled = _untie_warnings(lambda: ppll_compile.compile(SharedEarly(), example_inputs=(X,), policy="dgl",
                                                            split_points=["b"], devices=["cpu"] * 2))
    assert planned == [(here, line + 1)] and compiled == [(here, line + 3)]

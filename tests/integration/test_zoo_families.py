"""The zoo sweep held to its lists: small random-weight models of many timm families and Hugging Face types compile at
2 stages, equal the model in eval mode and train the same under the threads runtime as under the sequential one;
exactly the models of ``REFUSED`` are refused (with their reason) and exactly those of ``NOT_BUILT`` do not build.

The catalogue and the checks are ``benchmarks/zoo_sweep.py``, the lists ``benchmarks/zoo_lists.py``. The test runs
the representative subset ``TESTED`` (18 timm families, 25 Hugging Face types, refused and unbuilt ones among them;
every family and type would take far longer than the suite allows): ``python -m benchmarks.zoo_sweep`` runs them all
and prints the lists it finds and where they disagree with the ones here.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.zoo import call
from benchmarks.zoo_sweep import NOT_BUILT, REFUSED, SWEEP, TESTED, built, check, sweep_batches
from ppll_compile.heads.losses import model_loss

pytestmark = [pytest.mark.usefixtures("one_thread_quietly"), pytest.mark.slow]  # real models

MISSING = {lib for lib in ("timm", "transformers") if importlib.util.find_spec(lib) is None}
CASES = [pytest.param(name, id=name, marks=pytest.mark.skipif(SWEEP[name].library in MISSING,
                                                              reason=f"{SWEEP[name].library} is not installed"))
         for name in TESTED if name in SWEEP]


def test_the_lists_name_models_of_the_sweep_once():
    assert set(REFUSED) <= set(SWEEP) and set(NOT_BUILT) <= set(SWEEP)
    assert set(REFUSED) & set(NOT_BUILT) == set()
    assert set(TESTED) <= set(SWEEP) or MISSING


@pytest.mark.parametrize("name", CASES)
def test_a_model_passes_or_fails_as_its_list_says(name):
    entry = SWEEP[name]
    if name in NOT_BUILT:
        with pytest.raises(Exception, match=re.escape(NOT_BUILT[name])):
            built(entry)
        return
    model = built(entry)
    if name in REFUSED:
        with pytest.raises(Exception, match=re.escape(REFUSED[name])):
            check(entry, model)
        return
    reference = end_to_end_still(model, sweep_batches(entry))
    before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    figures = check(entry, model)  # raises when the compiled model's eval output or its trained parameters differ
    assert figures["stages"] == 2
    # the sequential run trained the model's own parameters: every one that end-to-end training moves moved
    still = [k for k, p in model.named_parameters() if k in before and torch.equal(p, before[k])]
    assert [k for k in still if k not in reference and k not in STILL.get(name, ())] == [], \
        "parameters end-to-end training trains, the pipeline not"


NOISE = 1e-6
"""A change of a parameter's values below this (largest absolute change) is rounding, not training."""
STILL: dict[str, tuple[str, ...]] = {
    # the cut falls right after the last block's residual add, and the auxiliary head begins with a bias-free conv
    # and a batch norm, which take out any per-channel constant: the per-channel biases feeding the add get no
    # gradient from the stage's loss (a fact of the values, not of the graph)
    "timm:regnet": ("s4.b1.conv3.bn.bias", "s4.b1.downsample.bn.bias"),
}
"""Per model, the trainable parameters that end-to-end training moves but the pipeline's losses cannot, and why."""


def end_to_end_still(model: nn.Module, data: list[tuple[Any, torch.Tensor]]) -> set[str]:
    """The trainable parameters that end-to-end training of a copy of ``model`` (the last stage's default loss, SGD
    lr 0.05 as the checks train, one step per batch of ``data``) moves by no more than :data:`NOISE`: those with no
    gradient (a module the forward never calls, a softmax over one key, a bias a batch norm takes out again) or one
    too small to register on the weight (behind a layer scale that starts near zero)."""
    twin = copy.deepcopy(model).train()
    before = {k: p.detach().clone() for k, p in twin.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.05)
    for x, y in data:
        opt.zero_grad()
        model_loss(call(twin, x), y).backward()
        opt.step()
    return {k for k, p in twin.named_parameters() if k in before and float((p - before[k]).abs().max()) <= NOISE}

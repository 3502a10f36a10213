"""Real models from timm and Hugging Face transformers, unmodified: they compile, equal the model in eval mode with its
own parameters, train the same under the threads runtime as under the sequential one, and distil (Pipe-BD).

The catalogue (small random-weight configs, no download) and its helpers are ``benchmarks/zoo.py``, which also
tabulates these checks (``python -m benchmarks --only zoo``).
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from torch import nn

import ppll_compile
from benchmarks.zoo import (
    PAIRS,
    ZOO,
    all_equal,
    batches,
    build,
    call,
    changed,
    compile_entry,
    compile_pair,
    logits,
    parameter_sharing,
    train,
    train_pair,
    train_sizes,
)

pytestmark = [pytest.mark.usefixtures("one_thread_quietly"), pytest.mark.slow]  # real models

MISSING = {lib for lib in ("timm", "transformers") if importlib.util.find_spec(lib) is None}

def _marks(library: str) -> list:
    """Skip without ``library``."""
    return [pytest.mark.skipif(library in MISSING, reason=f"{library} is not installed")]


EVAL_CASES = [pytest.param(name, k, id=f"{name}-{k}stages", marks=_marks(entry.library))
              for name, entry in ZOO.items() for k in (2, 4)]
TRAIN_CASES = [pytest.param(name, id=name, marks=_marks(entry.library))
               for name, entry in ZOO.items()]
TRAIN_STAGES = 4


@pytest.mark.parametrize("name,stages", EVAL_CASES)
def test_eval_output_is_the_models_with_its_own_parameters(name, stages):
    entry = ZOO[name]
    model = build(entry)
    x = batches(entry, [4], seed=0)[0][0]
    compiled = compile_entry(entry, model, stages, x)
    assert len(compiled.stages) == stages == compiled.plan.num_stages
    compiled.eval()  # the model too
    assert not model.training
    with torch.no_grad():
        expected, got = call(model, x), call(compiled, x)
    assert type(got) is type(expected)
    torch.testing.assert_close(logits(got), logits(expected), rtol=1e-5, atol=1e-6)

    # the stages hold the model's own parameter objects, each exactly once; tied="untie" adds copies of the owner
    sharing = parameter_sharing(compiled, model)
    assert sharing["missing"] == [] and sharing["repeated"] == []
    if entry.untied:
        assert sharing["copies"] and all(owner is not None for *_, owner in sharing["copies"]), sharing["copies"]
    else:
        assert sharing["copies"] == []


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_threads_train_as_sequential_with_dropout_on(name):
    entry = ZOO[name]
    model = build(entry, drop=True)
    data = batches(entry, train_sizes())  # 4, 4, then a smaller last batch
    ref = train(entry, model, TRAIN_STAGES, "sequential", data)
    ours = train(entry, model, TRAIN_STAGES, "threads", data)
    assert len(ours.parameters) == len(ref.parameters)
    for i, (p, q) in enumerate(zip(ours.parameters, ref.parameters)):
        assert torch.equal(p, q), f"parameter {i} differs by {float((p - q).abs().max())}"
    assert ours.draws_random == ref.draws_random and any(ref.draws_random), "no stage drew random numbers"
    assert changed(ref.model, model) > 0 and changed(ours.model, model) == changed(ref.model, model)


@pytest.mark.skipif("transformers" in MISSING, reason="transformers is not installed")
def test_a_tied_embedding_is_refused_under_tied_error_naming_the_parameter():
    entry = ZOO["gpt2"]
    x = batches(entry, [4], seed=0)[0][0]
    with pytest.raises(ppll_compile.CutError, match=re.escape("transformer.wte.weight")) as e:
        compile_entry(entry, build(entry), 2, x, tied="error")
    assert "tied='untie'" in str(e.value)


# ---- Pipe-BD ----------------------------------------------------------------------------------------------

PAIR_CASES = [pytest.param(name, id=name, marks=_marks(pair.library)) for name, pair in PAIRS.items()]
PAIR_TRAIN_CASES = [pytest.param(name, id=name, marks=_marks(pair.library))
                    for name, pair in PAIRS.items()]


@pytest.mark.parametrize("name", PAIR_CASES)
def test_pipebd_pair_compiles_into_blocks_sharing_the_students_parameters(name):
    compiled, student, teacher = compile_pair(PAIRS[name])
    plan = compiled.plan
    assert plan.mode == "pipebd" and plan.teacher == type(teacher).__name__ and plan.blocks
    if name.startswith("resnet"):
        assert len(plan.blocks) == 6 and plan.num_stages == 2  # stem, layer1..4 (with the pool), fc
    x = batches(PAIRS[name], [4])[0]
    compiled.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(call(compiled, x)), logits(call(student, x)), rtol=0, atol=0)
    ours = {id(p) for block in compiled.student_blocks for p in block.parameters()}
    assert ours == {id(p) for p in student.parameters()}
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


@pytest.mark.parametrize("name", PAIR_TRAIN_CASES)
def test_pipebd_pair_trains_the_same_under_threads_and_sequential(name):
    pair = PAIRS[name]
    torch.manual_seed(0)
    before = [p.detach().clone() for p in pair.student().parameters()]
    ref = train_pair(pair, "sequential")
    assert all_equal(train_pair(pair, "threads"), ref)
    assert not all_equal(ref, before)


# ---- found by the zoo ---------------------------------------------------------------------------------------

class _Block(nn.Module):
    """Branches on ``self.training`` (so it stays a leaf module) and calls a module shared with other blocks."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(self.shared(x))
        return x + (y * 1.0 if self.training else y)


class _SharedInLeaves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.b1, self.b2, self.b3 = _Block(self.shared), _Block(self.shared), _Block(self.shared)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b3(self.b2(self.b1(x))))


def test_a_module_shared_by_leaf_modules_keeps_its_real_parameters():
    torch.manual_seed(0)
    model = _SharedInLeaves()
    try:
        ppll_compile.compile(model, gpus=2, example_inputs=(torch.randn(4, 8),))
    finally:
        assert all(type(p) is nn.Parameter for p in model.parameters()), \
            {n: type(p).__name__ for n, p in model.named_parameters()}

"""Real models from timm and Hugging Face transformers, unmodified: they compile, equal the model in eval mode with its
own parameters, train the same under the threads runtime as under the sequential one, and distil (Pipe-BD).

The catalogue (small random-weight configs, no download) and its helpers are ``benchmarks/zoo.py``, which also
tabulates these checks (``python -m benchmarks --only zoo``).
"""

from __future__ import annotations

import copy
import importlib.util
import re
from typing import Any

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
from ppll_compile.heads.losses import model_loss

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
    reference = unchanged(model, end_to_end(model, data), NOISE)
    assert [k for k in unchanged(model, ref.model) if k not in reference] == [], \
        "parameters end-to-end training trains, the pipeline not"


NOISE = 1e-6
"""A change of a parameter's values below this (largest absolute change) is rounding, not training."""


def unchanged(model: nn.Module, trained: nn.Module, noise: float = 0.0) -> list[str]:
    """The trainable parameters of ``model`` that training moved by no more than ``noise`` in its copy ``trained``."""
    return [k for (k, p), q in zip(model.named_parameters(), trained.parameters())
            if p.requires_grad and float((p - q).abs().max()) <= noise]


def end_to_end(model: nn.Module, data: list[tuple[Any, torch.Tensor]]) -> nn.Module:
    """A copy of ``model`` trained end to end as the checks train (the last stage's default loss, SGD lr 0.05, a step
    per batch): what it leaves unchanged has no gradient (a softmax over one key, a bias a batch norm takes out
    again) or one too small for float32 to register (behind a layer scale that starts near zero)."""
    twin = copy.deepcopy(model).train()
    opt = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.05)
    for x, y in data:
        opt.zero_grad()
        model_loss(call(twin, x), y).backward()
        opt.step()
    return twin


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
    torch.manual_seed(0)  # the student as compile_pair builds it: after the teacher
    pair.teacher()
    student = pair.student()
    untrained = [k for (k, p), q in zip(student.named_parameters(), ref) if p.requires_grad and torch.equal(p, q)]
    assert set(untrained) <= set(STILL_STUDENT.get(name, ())), "student parameters no distillation step changed"


STILL_STUDENT: dict[str, tuple[str, ...]] = {
    # timm zero-initialises the last BN of every residual block: at init the teacher's layer1 (resnet18) and the
    # student's are both the identity, so that block's loss is exactly zero and its parameters never move; in layers
    # 2-4 the residual branch gets a zero gradient in the first step, and behind a BN weight still near zero in the
    # second, updates of its first BN weight (about 1) too small for float32
    "resnet18>resnet10t": ("layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.bn1.bias",
                           "layer1.0.conv2.weight", "layer1.0.bn2.weight", "layer1.0.bn2.bias",
                           *(f"layer{i}.0.bn1.weight" for i in (2, 3, 4))),
}
"""Per Pipe-BD pair, the student parameters that may keep their values after the distillation steps, and why."""


# ---- found by the zoo ---------------------------------------------------------------------------------------

@pytest.mark.skipif("timm" in MISSING, reason="timm is not installed")
def test_a_two_stream_model_at_two_stages_trains_every_parameter():
    # CrossViT's two branches cross every cut inside its multi-scale blocks, the one its head does not read carrying
    # parameters of the stage before the cut (at 48 px, 30 tensors at the cut after add_19 where the partitioner cut
    # before): those cuts are left out, and a training step changes every parameter
    import timm

    torch.manual_seed(0)
    model = timm.create_model("crossvit_tiny_240", pretrained=False, num_classes=10, img_size=48, img_scale=(1.0, 1.0))
    x, y = torch.randn(4, 3, 48, 48), torch.randint(0, 10, (4,))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    compiled = ppll_compile.compile(model, gpus=2, example_inputs=(x,))
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), runtime="sequential") as trainer:
        trainer.step(x, y)
    assert [k for k, p in model.named_parameters() if torch.equal(p, before[k])] == []
    assert compiled.plan.num_stages == 2
    assert any("the stage before them would not train every parameter it holds" in n for n in compiled.plan.notes)


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

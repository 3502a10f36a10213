"""Models built on the meta device: planned without their weights, materialised per stage, refused while on meta."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import meta_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from ppll_compile.errors import PPLLError  # noqa: E402
from tests.helpers import built_on_meta, quiet  # noqa: E402
from tests.models import Residual  # noqa: E402

X = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_model_shares_the_materialised_tensors_with_its_stages(tracer, one_thread_quietly):
    model = built_on_meta(Residual)
    compiled = ppll_compile.compile(model, gpus=2, example_inputs=(X,), policy="dgl", tracer=tracer)
    stage_tensors = {id(p) for s in compiled.stages for p in s.parameters()}
    assert {id(p) for p in model.parameters()} == stage_tensors
    assert not any(p.is_meta for p in model.parameters())
    # reset_parameters() drew the weights: a conv's bias bound is 1/sqrt(fan_in)
    assert 0 < model.stem.bias.abs().max() <= 27 ** -0.5
    assert compiled.plan.notes[-1] == ("the model was built on the meta device: every stage allocated on its own "
                                       "device and initialised by the model's own _init_weights/reset_parameters()")
    torch.testing.assert_close(compiled.eval()(X), model.eval()(X), rtol=0, atol=0)

class _TiedLM(nn.Module):
    """A token model whose output projection is its embedding table (no Hugging Face initialisation)."""

    def __init__(self, table: nn.Module | None = None) -> None:
        super().__init__()
        self.emb = table or nn.Embedding(32, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 32, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.b(torch.relu(self.a(nn.functional.embedding(ids, self.emb.weight))))))


class _Table(nn.Module):
    """An embedding table with no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(32, 16))


TOKENS = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))


def test_an_untied_copy_of_a_plain_meta_model_takes_its_modules_initialisation(one_thread_quietly):
    compiled = ppll_compile.compile(built_on_meta(_TiedLM), gpus=2, example_inputs=(TOKENS,), policy="lm")
    assert compiled.plan.untied == ("emb.weight = out.weight",)
    first = dict(compiled.stages[0].module.named_parameters())["emb.weight"]
    copy = dict(compiled.stages[1].module.named_parameters())["out.weight"]
    assert first is not copy and torch.equal(first, copy)
    assert 0.9 < float(copy.detach().std()) < 1.1  # nn.Embedding's N(0, 1), not what empty_like left
    alone = ppll_compile.compile(built_on_meta(_TiedLM), gpus=2, example_inputs=(TOKENS,), policy="lm",
                                 local_stages=[1])
    assert torch.equal(dict(alone.stages[1].module.named_parameters())["out.weight"], copy)


def test_a_tied_tensor_whose_module_has_no_initialisation_is_an_error(one_thread_quietly):
    with torch.device("meta"):
        model = _TiedLM(_Table())
    with pytest.raises(PPLLError) as e:
        ppll_compile.compile(model, gpus=2, example_inputs=(TOKENS,), policy="lm")
    assert str(e.value) == ("the meta-built model's tied tensor emb.weight has no initialisation to draw its untied "
                            "copies from (_Table has no reset_parameters()); give it values: compile(model, ..., "
                            "materialize=fn) with fn(stage_module, stage_index, device) filling the stage's tensors, "
                            "or compile(model, ..., state_dict=load) with load(stage_index, names) -> {name: tensor} "
                            "(or a whole state dict), or build the model off the meta device")


def test_a_stage_left_on_meta_is_refused_with_the_way_out(one_thread_quietly):
    model = built_on_meta(Residual)
    compiled = ppll_compile.compile(model, gpus=2, example_inputs=(X,), policy="dgl", local_stages=[1])
    normal = w.residual_pipeline(meta=False)
    stage0 = [f"block.{k}" for k, _ in (*normal.stages[0].named_parameters(), *normal.stages[0].named_buffers())] + \
             [f"head.{k}" for k, _ in (*normal.heads[0].named_parameters(), *normal.heads[0].named_buffers())]
    assert len([n for n in stage0 if n.startswith("block.")]) == 6 and len(stage0) > 6
    assert w.meta_tensors(compiled) == {0: stage0, 1: []}
    assert compiled.plan.notes[-1] == ("the model was built on the meta device: stage(s) 1 (this rank's; the others "
                                       "stay on meta) allocated on its own device and initialised by the model's own "
                                       "_init_weights/reset_parameters()")
    expected = ("stage 0 holds 6 tensor(s) on the meta device (module.stem.weight, module.stem.bias, "
                "module.a1.weight and 3 more), which have no values to run on; materialise stage 0 on this process: "
                "compile(model, ..., materialize=fn) with fn(stage_module, stage_index, device) filling the stage's "
                "tensors, or compile(model, ..., state_dict=load) with load(stage_index, names) -> {name: tensor} "
                "(or a whole state dict), or build the model off the meta device")
    with pytest.raises(PPLLError) as e:
        compiled.trainer(optimizer=w.sgd, runtime="sequential")
    assert str(e.value) == expected
    with pytest.raises(PPLLError) as e:
        compiled.eval()(X)
    assert str(e.value) == expected


def test_a_meta_batch_is_refused(one_thread_quietly):
    compiled = w.residual_pipeline(meta=True)
    expected = ("the batch holds a tensor on the meta device (shape (8, 3, 8, 8)), which has no values to train or "
                "evaluate on; feed real tensors (meta example inputs serve planning only)")
    with pytest.raises(PPLLError) as e:
        compiled.eval()(X.to("meta"))
    assert str(e.value) == expected
    with compiled.trainer(optimizer=w.sgd, runtime="sequential") as trainer, pytest.raises(PPLLError) as e:
        trainer.step(X.to("meta"), torch.zeros(8, dtype=torch.long))
    assert str(e.value) == expected


class _Positional(nn.Module):
    """A learned position table (no ``reset_parameters``) before a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(1, 8))
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.b(torch.relu(self.a(x + self.pos)))))


def test_a_tensor_no_module_initialises_is_an_error(one_thread_quietly):
    with pytest.raises(PPLLError) as e:
        ppll_compile.compile(built_on_meta(_Positional), gpus=2, example_inputs=(torch.randn(4, 8),), policy="dgl")
    assert str(e.value) == ("stage 0 of the meta-built model holds 1 tensor(s) that no module initialises (pos: their "
                            "module has no reset_parameters()); give them values: compile(model, ..., materialize=fn) "
                            "with "
                            "fn(stage_module, stage_index, device) filling the stage's tensors, or compile(model, "
                            "..., state_dict=load) with load(stage_index, names) -> {name: tensor} (or a whole state "
                            "dict), or build the model off the meta device")


def test_materialising_options_need_a_meta_model():
    with quiet(), pytest.raises(ValueError) as e:
        ppll_compile.compile(Residual(), gpus=2, example_inputs=(X,), state_dict={})
    assert str(e.value) == ("materialize=, state_dict= and local_stages= give values to a model built on the meta "
                            "device, but Residual holds no meta tensor; drop them (or build the model under "
                            "torch.device('meta'))")

"""Capture end to end: forward arguments with defaults, train/eval merging, wrapped and shared modules, the
torch.export front end, channels-last boundaries and token-level models, each checked against the model itself."""

from __future__ import annotations

import math
import re

import pytest
import timm
import torch
import torchvision
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

import ppll_compile
from ppll_compile import PolicyError, TraceError


pytestmark = pytest.mark.usefixtures("quietly")  # no CPU-fallback warnings of compile


def _vit(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10).eval()


def _ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


class Wrapper(nn.Module):
    """A plain wrapper around a third-party model."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_timm_vit_with_is_causal_default_compiles_and_equals_the_model():
    model, x = _vit(), torch.randn(2, 3, 32, 32)
    c = ppll_compile.compile(model, 2, example_inputs=(x,)).eval()
    assert len(c.stages) == 2
    with torch.no_grad():
        assert torch.equal(c(x), model(x))
        y = torch.randn(3, 3, 32, 32)
        assert torch.equal(c(y), model(y))
    with pytest.raises(TypeError, match=re.escape("was compiled with is_causal=False, a constant of the captured "
                                                  "graph, and is called with is_causal=True")):
        c(x, is_causal=True)


# ---- 3. a wrapped third-party model ----------------------------------------------------------------------

def test_wrapped_timm_model_is_traced_into():
    model, x = Wrapper(_vit()), torch.randn(2, 3, 32, 32)
    p = ppll_compile.plan(model, 4, example_inputs=(x,))
    assert len(p.stages) == 4
    c = ppll_compile.compile(model, example_inputs=(x,), split_points=["inner.blocks.0"]).eval()
    assert [s.last_module for s in c.plan.stages] == ["inner.blocks.0", "inner.head"]
    with torch.no_grad():
        assert torch.equal(c(x), model(x))


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=3, max_position_embeddings=64)
    return BertForSequenceClassification(config).eval()


def test_hugging_face_model_needs_export_and_auto_takes_it():
    from transformers.modeling_outputs import SequenceClassifierOutput

    model, ids = _bert(), _ids(4, 16)
    with pytest.raises(TraceError, match=re.escape("use tracer='export' (or 'auto')")):
        ppll_compile.compile(model, 2, example_kwargs={"input_ids": ids}, tracer="fx")
    c = ppll_compile.compile(model, 2, example_kwargs={"input_ids": ids})
    assert c.plan.notes[0].startswith("captured with torch.export")
    assert c.plan.num_classes == 3
    c.eval()
    with torch.no_grad():
        out, ref = c(input_ids=ids), model(input_ids=ids)
        assert isinstance(out, SequenceClassifierOutput)
        assert torch.equal(out.logits, ref.logits)
        other = _ids(3, 16, seed=1)  # another batch size
        assert torch.equal(c(other).logits, model(other).logits)


# ---- 6. channels-last boundaries ------------------------------------------------------------------------

@pytest.mark.slow
def test_swin_boundaries_are_channels_last_maps():
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, depths=(2, 2, 2, 2),
                              embed_dim=32, num_heads=(1, 2, 4, 8), num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    c = ppll_compile.compile(model, 4, example_inputs=(x,))
    assert len(c.plan.stages) == 4
    maps = [s for s in c.plan.stages[:-1] if len(s.boundary[0].shape) == 4]
    assert maps  # Swin's stages hand on N x H x W x C maps (or, after a patch merging, N x L x C sequences)
    for s in maps:
        assert s.boundary[0].layout == "channels_last" and s.head.kind == "channels_last", s.index
    legal = ppll_compile.plan(model, 2, example_inputs=(x,), split_points=["layers.0"])
    assert legal.stages[0].boundary[0].layout == "channels_last" and legal.stages[0].head.kind == "channels_last"
    assert any(re.search(r"^\d+ of \d+ legal cuts dropped: no head of policy 'auto' reads their tensors \(6-D", n)
               for n in c.plan.notes), c.plan.notes
    with torch.no_grad():
        assert torch.equal(c.eval()(x), model(x))


def test_resnet_boundary_is_a_plain_feature_map():
    p = ppll_compile.plan(torchvision.models.resnet18(num_classes=10), 2, example_inputs=(torch.randn(2, 3, 32, 32),))
    main = p.stages[0].boundary[0]
    assert len(main.shape) == 4 and main.shape[1] > main.shape[2] and main.layout == ""
    assert p.stages[0].head.kind == "feature_map"


# ---- 7. token-level models ------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_causal_lm_is_cut_between_its_decoder_layers_and_takes_other_lengths():
    torch.manual_seed(0)
    model, ids = _llama(), torch.randint(0, 128, (4, 16))
    c = ppll_compile.compile(model, example_kwargs={"input_ids": ids}, split_points=["model.layers.1"])
    boundary = c.plan.stages[0].boundary
    # the hidden state, with the rotary cos and sin and the causal mask (a bool tensor, not a scalar) beside it
    assert boundary[0].dtype == "float32" and len(boundary[0].shape) == 3
    assert [t.dtype for t in boundary[1:]].count("bool") == 1
    c.eval(), model.eval()
    with torch.no_grad():
        for x in (ids, ids[:3, :9], torch.randint(0, 128, (2, 40))):  # batch and length are free
            assert torch.equal(c(input_ids=x).logits, model(input_ids=x).logits)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


@pytest.mark.slow
def test_causal_lm_trains_on_per_token_labels_with_lm_heads(one_thread_quietly):
    model, ids = _llama(), _ids(2, 16)
    c = ppll_compile.compile(model, 2, example_kwargs={"input_ids": ids})
    assert c.plan.num_classes == 128
    assert [s.head.config["type"] for s in c.plan.stages[:-1]] == ["lm"]
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as trainer:
        stepped = trainer.step({"input_ids": ids}, labels)
        finished = trainer.finish()
    losses = [list(a) + list(b) for a, b in zip(stepped, finished)]
    assert [len(ls) for ls in losses] == [1, 1]
    assert all(math.isfinite(v) for ls in losses for v in ls)
    c.eval()
    with torch.no_grad():
        assert torch.equal(c(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_a_policy_without_per_token_heads_is_named():
    with pytest.raises(PolicyError, match=re.escape("per token")):
        ppll_compile.plan(_llama(), 2, example_kwargs={"input_ids": _ids(2, 16)}, policy="dgl")


@pytest.mark.slow  # torch.export of a teacher and a student BERT: about 8 s
def test_pipebd_blocks_end_between_transformer_layers_with_the_mask_beside_the_output(one_thread_quietly):
    # the block boundary after a BERT layer carries the hidden state and the attention mask; the student's next
    # block takes both from the teacher, and the stage sends both
    def bert(intermediate: int) -> nn.Module:
        torch.manual_seed(intermediate)
        return BertForSequenceClassification(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=4,
                                                        num_attention_heads=2, intermediate_size=intermediate,
                                                        num_labels=3, max_position_embeddings=64))

    ids, y = torch.randint(1, 128, (8, 16)), torch.randint(0, 3, (8,))
    results = []
    for runtime in ("sequential", "threads"):
        teacher, student = bert(128), bert(64)
        c = ppll_compile.compile(student, teacher=teacher, example_kwargs={"input_ids": ids}, replicas=False,
                                 blocks=[("bert.encoder.layer.1", "bert.encoder.layer.1")],
                                 split_points=["bert.encoder.layer.1"])
        boundary = c.plan.stages[0].boundary
        assert len(boundary) > 1 and boundary[0].shape == (8, 16, 32)
        assert any(len(v.shape) == 4 for v in boundary[1:])  # the extended attention mask
        with c.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime=runtime) as trainer:
            for _ in range(2):
                trainer.step(ids, y)
            trainer.finish()
        results.append([p.detach().clone() for p in student.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))

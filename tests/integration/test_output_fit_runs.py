"""A model output that no default loss fits is named at plan time with the way out: features instead of scores
(``num_classes == 0``), a ``num_classes=`` other than the output's classes, per-token heads that read other tokens
than the output has, and outputs of no shape the defaults take (a scalar, a dense map); the first training step on
targets that fit nothing names the shapes and the way out, and that way out trains."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from ppll_compile.errors import StageError
from tests.helpers import Tokens, compiled_with_warnings, plain_sgd, tokens_x

WAY_OUT = ("pass the trainer the loss of your task: compiled.trainer(..., loss=fn) with fn(output, target) -> scalar "
           "tensor for the last stage, and aux_loss=fn(scores, target) for the auxiliary heads")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_features_not_scores_are_named_with_the_way_out():
    torch.manual_seed(0)
    c, caught = compiled_with_warnings(Tokens(features=True), tokens_x())
    note = ("Tokens returns features, not scores: its num_classes is 0, and the default losses would read its output "
            "of shape (4, 8, 12) as per-token scores over 12 classes, with class labels of shape [4, 8]; to train it "
            "on class labels give it a classifier (for a timm model, num_classes=C where it has one, else e.g. a "
            "pooling and nn.Linear(12, C) after it), or " + WAY_OUT)
    assert caught == [note]
    assert c.plan.notes[-1] == note
    _, plain = compiled_with_warnings(Tokens(),
                                      tokens_x())  # the same output from a model that does not call it features
    assert plain == []


@pytest.mark.slow
def test_timm_gemma4_vision_encoder_is_named_as_features_and_its_way_out_trains():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("gemma4_vit_167m_enc", pretrained=False, img_size=96, depth=2)  # 36 patches, 4 tokens
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    c, caught = compiled_with_warnings(model, x)
    assert caught == [
        "Gemma4VitEncoder returns features, not scores: its num_classes is 0, and the default losses would read its "
        "output of shape (2, 4, 768) as per-token scores over 768 classes, with class labels of shape [2, 4]; to "
        "train it on class labels give it a classifier (for a timm model, num_classes=C where it has one, else e.g. "
        "a pooling and nn.Linear(768, C) after it), or " + WAY_OUT,
        "the auxiliary heads give per-token scores for the tokens at their cut (stage 0's: 36), but "
        "Gemma4VitEncoder's output has 4 tokens: by default a head scores each of the 4 labels from the mean of its "
        "tokens' scores (as on the encoder of a sequence-to-sequence model); for another rule pass "
        "compiled.trainer(..., aux_loss=fn) with fn(scores, target) -> scalar tensor, or cut where the output's "
        "tokens are"]
    y = torch.tensor([3, 1])
    with c.trainer(optimizer=plain_sgd) as trainer, pytest.raises(StageError, match=re.escape(
            "stage 0's auxiliary head gives scores of shape (2, 36, 768), and a target of shape (2,) and dtype "
            "torch.int64 fits no task loss")):
        trainer.step(x, y)

    def pooled(scores, target):  # the tokens' mean, scored as one example's class scores
        return F.cross_entropy(scores.mean(1), target)

    with torch.no_grad():
        h = c.stages[0](x)
        expected = [float(pooled(c.heads[0](h[0]), y)), float(pooled(c.stages[1](*h), y))]
    with c.trainer(optimizer=plain_sgd, loss=pooled, aux_loss=pooled) as trainer:
        assert trainer.step(x, y) == [[pytest.approx(expected[0], rel=1e-5)], [pytest.approx(expected[1], rel=1e-5)]]

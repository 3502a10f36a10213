"""A model output that no default loss fits is named at plan time with the way out: features instead of scores
(``num_classes == 0``), a ``num_classes=`` other than the output's classes, per-token heads that read other tokens
than the output has, and outputs of no shape the defaults take (a scalar, a dense map); the first training step on
targets that fit nothing names the shapes and the way out, and that way out trains."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ppll_compile.errors import StageError
from tests.models import DictOut, Residual
from tests.helpers import TOKENS_N, Tokens, compiled_with_warnings, plain_sgd, tokens_x

WAY_OUT = ("pass the trainer the loss of your task: compiled.trainer(..., loss=fn) with fn(output, target) -> scalar "
           "tensor for the last stage, and aux_loss=fn(scores, target) for the auxiliary heads")


class Pooled(nn.Module):
    """N x 8 x 6 in; pairs of tokens merged before ``l3``: N x 4 x 5 per-token scores out."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.l2(torch.relu(self.l1(x))))
        return self.l3(h.reshape(-1, 4, 32))


class Dense(nn.Module):
    """A dense map out (N x 4 x 8 x 8), not scores."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))


class Scalar(nn.Module):
    """Returns one number for the whole batch (as a model computing its own loss does)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).pow(2).mean()


pytestmark = pytest.mark.usefixtures("one_thread")


def test_num_classes_other_than_the_outputs_is_named():
    _, caught = compiled_with_warnings(Tokens(), tokens_x(), num_classes=7)
    assert caught == ["num_classes=7, but Tokens returns (4, 8, 12), per-token scores over 12 classes, with class "
                      "labels of shape [4, 8]: the auxiliary heads predict 7 classes, the model's output 12; pass "
                      "num_classes=12, or give the model an output of 7 classes"]
    _, same = compiled_with_warnings(Tokens(), tokens_x(), num_classes=12)
    assert same == []


def test_per_token_heads_that_read_other_tokens_than_the_output_are_named_and_aux_loss_trains_them():
    x = tokens_x()
    c, caught = compiled_with_warnings(Pooled(), x, split_points=["l1"])
    assert caught == ["the auxiliary heads give per-token scores for the tokens at their cut (stage 0's: 8), but "
                      "Pooled's output has 4 tokens: by default a head scores each of the 4 labels from the mean of "
                      "its tokens' scores (as on the encoder of a sequence-to-sequence model); for another rule pass "
                      "compiled.trainer(..., aux_loss=fn) with fn(scores, target) -> scalar tensor, or cut where the "
                      "output's tokens are"]
    y = torch.randint(0, 5, (TOKENS_N, 4), generator=torch.Generator().manual_seed(1))

    def mean_rule(scores, target):  # every label scored by the mean of the head's 8 tokens' scores
        return F.cross_entropy(scores.mean(1, keepdim=True).expand(-1, 4, -1).flatten(0, 1), target.flatten())

    def pairs(scores, target):  # a head's 8 tokens scored against the 4 labels of their pairs
        return F.cross_entropy(scores.flatten(0, 1), target.repeat_interleave(2, dim=1).flatten())

    for rule, options in ((mean_rule, {}), (pairs, {"aux_loss": pairs})):
        c, _ = compiled_with_warnings(Pooled(), x, split_points=["l1"])
        with torch.no_grad():
            h = c.stages[0](x)
            expected = [float(rule(c.heads[0](h[0]), y)), float(F.cross_entropy(c.stages[1](*h).flatten(0, 1),
                                                                               y.flatten()))]
        with c.trainer(optimizer=plain_sgd, **options) as trainer:
            assert trainer.step(x, y) == [[pytest.approx(expected[0], rel=1e-6)],
                                          [pytest.approx(expected[1], rel=1e-6)]]


def test_a_dense_map_fits_no_default_loss_the_first_step_says_so_and_loss_trains_it():
    x = torch.randn(TOKENS_N, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    c, caught = compiled_with_warnings(Dense(), x, num_classes=5)
    assert caught == ["Dense returns a 4-D tensor of shape (4, 4, 8, 8): no default loss fits it (the defaults take "
                      "N x C scores with class labels of shape [N], N x L x C per-token scores with labels of shape "
                      "[N, L], or one score per example with targets of shape [N]); " + WAY_OUT]
    y = torch.randint(0, 4, (TOKENS_N,), generator=torch.Generator().manual_seed(1))
    with c.trainer(optimizer=plain_sgd) as trainer, pytest.raises(StageError, match=re.escape(
            "stage 1, the last (the model's output), gives scores of shape (4, 4, 8, 8), and a target of shape (4,) "
            "and dtype torch.int64 fits no task loss")):
        trainer.step(x, y)

    def pooled(output, target):
        return F.cross_entropy(output.mean((2, 3)), target)

    c, _ = compiled_with_warnings(Dense(), x, num_classes=5)
    with torch.no_grad():
        expected = float(pooled(c.stages[1](*c.stages[0](x)), y))
    with c.trainer(optimizer=plain_sgd, loss=pooled) as trainer:
        assert trainer.step(x, y)[1] == [pytest.approx(expected, rel=1e-6)]


def test_a_scalar_output_fits_no_default_loss():
    _, caught = compiled_with_warnings(Scalar(), torch.randn(TOKENS_N, 6), num_classes=3)
    assert caught == ["Scalar returns a scalar of shape (): no default loss fits it (the defaults take N x C scores "
                      "with class labels of shape [N], N x L x C per-token scores with labels of shape [N, L], or "
                      "one score per example with targets of shape [N]); " + WAY_OUT]


class Named(nn.Module):
    """Returns a dict of tensors without ``logits``: the default loss finds no scores in it."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        return {"features": h, "out": self.l2(h)}


def test_a_dict_without_logits_fits_no_default_loss():
    x = torch.randn(TOKENS_N, 6)
    c, caught = compiled_with_warnings(Named(), x, num_classes=3)
    assert caught == ["Named returns a structured output in which the default loss finds no scores (it reads a "
                      "tensor, an output's 'logits', or the first tensor of a tuple or list): no default loss fits "
                      "it; " + WAY_OUT]
    with c.trainer(optimizer=plain_sgd) as trainer, pytest.raises(StageError, match=re.escape(
            "stage 1, the last (the model's output), gives immutable_dict scores (not a tensor), and a target of "
            "shape (4,) and dtype torch.int64 fits no task loss")):
        trainer.step(x, torch.tensor([0, 1, 2, 0]))


@pytest.mark.parametrize("model, x", [
    (Residual(), torch.randn(TOKENS_N, 3, 8, 8)),  # N x C scores
    (DictOut(), torch.randn(TOKENS_N, 4)),  # a dict whose logits are N x C scores
    (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)),
     torch.randn(TOKENS_N, 6)),  # one score per example (regression, binary labels)
], ids=["scores", "dict-logits", "one-score"])
def test_outputs_the_defaults_fit_get_no_note(model, x):
    classes = {"Sequential": {"num_classes": 1}, "DictOut": {"num_classes": 2}}.get(type(model).__name__, {})
    _, caught = compiled_with_warnings(model, x, **classes)
    assert caught == []

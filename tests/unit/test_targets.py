"""Targets read the way torch reads them: 0/1 labels of the scores' shape are multi-label (binary cross-entropy with
logits) whether they come as bool, integer or float (what ``BCEWithLogitsLoss`` takes); other float targets are
regression; the user's ``loss=`` takes every float target, which is how a regression stays one."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ppll_compile
from ppll_compile.heads.losses import model_loss, task_loss, task_of

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

N, LABELS = 16, 5


def _compiled(seed: int = 0) -> ppll_compile.CompiledPipeline:
    """A 2-stage MLP giving ``LABELS`` scores per example (one logit per label)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, LABELS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback note
        return ppll_compile.compile(model, example_inputs=(torch.randn(N, 8),), split_points=["1"], policy="dgl")


def _labels(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 8, generator=g), torch.randint(0, 2, (N, LABELS), generator=g)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.long, torch.float16])
def test_the_same_labels_give_the_same_bce_as_float_bool_or_long(dtype):
    x, y = _labels()
    compiled = _compiled()
    with torch.no_grad():
        h = compiled.stages[0](x)
        scores, output = compiled.heads[0](h[0]), compiled.stages[1](*h)
    expected = [nn.BCEWithLogitsLoss()(scores, y.float()), nn.BCEWithLogitsLoss()(output, y.float())]
    with compiled.trainer(optimizer=_sgd) as trainer:
        losses = trainer.step(x, y.to(dtype))
        result = trainer.evaluate([(x, y.to(dtype))])
    assert losses == [[pytest.approx(float(expected[0]), rel=1e-6)], [pytest.approx(float(expected[1]), rel=1e-6)]]
    assert result["accuracy"] is None and result["stage_accuracy"] == [None, None]


def test_float_labels_train_the_same_parameters_as_bool_labels():
    trained = []
    for dtype in (torch.bool, torch.float32):
        compiled = _compiled(seed=1)
        with compiled.trainer(optimizer=_sgd) as trainer:
            for seed in range(3):
                x, y = _labels(seed)
                trainer.step(x, y.to(dtype))
        trained.append([p.detach().clone() for m in (*compiled.stages, *compiled.heads) if m is not None
                        for p in m.parameters()])
    for a, b in zip(*trained):
        assert torch.equal(a, b)


def test_the_users_loss_keeps_a_regression_whose_targets_are_0_or_1_in_a_batch():
    x, y = _labels()
    compiled = _compiled()
    with torch.no_grad():
        h = compiled.stages[0](x)
        scores, output = compiled.heads[0](h[0]), compiled.stages[1](*h)
    with compiled.trainer(optimizer=_sgd, loss=F.mse_loss) as trainer:  # loss= takes every float target
        losses = trainer.step(x, y.float())
    assert losses == [[pytest.approx(float(F.mse_loss(scores, y.float())), rel=1e-6)],
                      [pytest.approx(float(F.mse_loss(output, y.float())), rel=1e-6)]]


def test_the_rule_on_float_targets():
    g = torch.Generator().manual_seed(0)
    scores, one = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
    labels = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert task_of(scores, labels) == task_of(scores, labels.bool()) == task_of(scores, labels.long()) == "multilabel"
    assert task_of(one, torch.tensor([0.0, 1.0, 1.0, 0.0])) == "multilabel"  # N binary labels for N x 1 scores
    torch.testing.assert_close(model_loss(scores, labels), F.binary_cross_entropy_with_logits(scores, labels))
    torch.testing.assert_close(task_loss(one, torch.tensor([0.0, 1.0, 1.0, 0.0])),
                               F.binary_cross_entropy_with_logits(one[:, 0], torch.tensor([0.0, 1.0, 1.0, 0.0])))
    # any other value makes float targets regression: soft labels, -0.5, 2, NaN
    for other in (0.5, -1.0, 2.0, float("nan")):
        target = labels.clone()
        target[2, 1] = other
        assert task_of(scores, target) == "regression"
    soft = torch.softmax(scores, 1)
    torch.testing.assert_close(task_loss(scores, soft), F.mse_loss(scores, soft))
    # the user's loss takes every float target (bool and integer labels stay multi-label)
    torch.testing.assert_close(task_loss(scores, labels, F.l1_loss), F.l1_loss(scores, labels))
    torch.testing.assert_close(task_loss(scores, labels.bool(), F.l1_loss),
                               F.binary_cross_entropy_with_logits(scores, labels))
    # values unknown (meta): not read as labels
    assert task_of(scores.to("meta"), labels.to("meta")) == "regression"

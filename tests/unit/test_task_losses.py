"""Local losses follow the task: every auxiliary head (and the last stage without ``loss=``) takes the loss the target
asks for (class labels: cross-entropy; float targets: regression; bool or integer targets of the scores' shape:
multi-label), ``aux_loss=`` overrides it, and a target that fits none is a clear error."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ppll_compile
from ppll_compile.errors import PPLLError, StageError
from ppll_compile.heads.build import build_head
from ppll_compile.heads.losses import IGNORE_INDEX, model_loss, task_loss, task_of
from ppll_compile.heads.policy import load_policy
from ppll_compile.plans.plan import TensorSpec
from tests.helpers import assert_same_parameters, compiled_residual, sgd
from tests.models import conv_student, conv_teacher

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

N = 16


def mlp(outputs: int = 1, seed: int = 0) -> nn.Sequential:
    """The issue's model: 6 Linear layers with ReLUs between them, ``outputs`` values per example."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(6):
        layers.append(nn.Linear(8 if i == 0 else 16, outputs if i == 5 else 16))
        if i < 5:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def compiled_mlp(outputs: int = 1, seed: int = 0, stages: int = 2) -> ppll_compile.CompiledPipeline:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback note
        return ppll_compile.compile(mlp(outputs, seed), stages, example_inputs=(torch.randn(N, 8),),
                                    split_points=["5", "7"][:stages - 1], policy="dgl")


def regression_data(n: int = 4, seed: int = 1, shape: tuple[int, ...] = (N, 1)) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(n):
        x = torch.randn(N, 8, generator=g)
        data.append((x, (x[:, :3].sum(1) + 0.5).reshape(shape)))
    return data


def by_hand(compiled: ppll_compile.CompiledPipeline, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 0's head scores and the model's output on ``x``, computed module by module."""
    with torch.no_grad():
        h = compiled.stages[0](x)
        return compiled.heads[0](h[0]), compiled.stages[1](*h)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


# ---- the regression ---------------------------------------------------------------------------------------

def test_a_regression_heads_loss_is_the_users_mse_of_the_targets_shape_and_it_learns():
    compiled = compiled_mlp()
    x, y = regression_data(1)[0]
    scores, output = by_hand(compiled, x)
    assert scores.shape == y.shape == (N, 1)
    first = [float(F.mse_loss(scores.reshape(y.shape), y)), float(F.mse_loss(output, y))]
    losses: list[float] = []
    with compiled.trainer(optimizer=adam, loss=F.mse_loss) as trainer:
        assert trainer.step(x, y) == [[pytest.approx(first[0], rel=1e-6)], [pytest.approx(first[1], rel=1e-6)]]
        for _ in range(40):
            losses.append(trainer.step(x, y)[0][0])
    assert first[0] > 0.5 and losses[-1] < 0.25 * first[0]  # stage 0 learns (cross-entropy over one output: 0.0)


def test_a_target_of_one_value_per_example_reshapes_the_scores_and_defaults_to_mse():
    compiled = compiled_mlp()
    x, y = regression_data(1, shape=(N,))[0]
    scores, output = by_hand(compiled, x)
    with compiled.trainer(optimizer=sgd) as trainer:  # no loss=: the task's (MSE) at both stages
        losses = trainer.step(x, y)
    assert losses[0][0] == pytest.approx(float(F.mse_loss(scores.reshape(N), y)), rel=1e-6)
    assert losses[1][0] == pytest.approx(float(F.mse_loss(output.reshape(N), y)), rel=1e-6)


def test_the_users_loss_scores_a_regression_heads_reshaped_output():
    compiled = compiled_mlp()
    x, y = regression_data(1, shape=(N,))[0]
    scores, output = by_hand(compiled, x)
    seen = []

    def l1(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(s.shape))
        return F.l1_loss(s.reshape(t.shape), t)

    with compiled.trainer(optimizer=sgd, loss=l1) as trainer:
        losses = trainer.step(x, y)
    assert seen == [(N,), (N, 1)]  # the head's scores reshaped to the target; the model's output as it is
    assert losses == [[pytest.approx(float(F.l1_loss(scores.reshape(N), y)), rel=1e-6)],
                      [pytest.approx(float(F.l1_loss(output.reshape(N), y)), rel=1e-6)]]


def test_multi_label_targets_take_binary_cross_entropy_with_logits():
    compiled = compiled_mlp(outputs=5)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 2, (N, 5), generator=g).bool()
    scores, output = by_hand(compiled, x)
    with compiled.trainer(optimizer=sgd) as trainer:
        losses = trainer.step(x, y)
    assert losses == [[pytest.approx(float(F.binary_cross_entropy_with_logits(scores, y.float())), rel=1e-6)],
                      [pytest.approx(float(F.binary_cross_entropy_with_logits(output, y.float())), rel=1e-6)]]


def test_threads_equal_sequential_on_the_regression():
    data = regression_data(5)
    results = []
    for runtime in ("sequential", "threads"):
        compiled = compiled_mlp()
        losses: list[list[float]] = [[], []]
        with compiled.trainer(optimizer=adam, loss=F.mse_loss, runtime=runtime) as trainer:
            for x, y in data:
                for i, ls in enumerate(trainer.step(x, y)):
                    losses[i] += ls
            for i, ls in enumerate(trainer.finish()):
                losses[i] += ls
        results.append((compiled, losses))
    (seq, seq_losses), (thr, thr_losses) = results
    assert thr_losses == seq_losses and len(seq_losses[0]) == 5
    assert seq_losses[0][-1] < seq_losses[0][0]  # stage 0 learns the regression
    assert_same_parameters(thr, seq)


# ---- a target that fits no loss -----------------------------------------------------------------------------------

RULES = ("fits no task loss (integer class labels of the scores' shape without its last dimension: cross-entropy; "
         "as many values per example as the scores: 0/1 labels (bool, integer or float) multi-label BCE, other "
         "float targets regression (loss= or MSE)); ")


def test_a_target_that_fits_no_head_loss_names_the_stage_and_aux_loss():
    compiled = compiled_residual()  # 5 classes
    with pytest.raises(StageError) as info, compiled.trainer(optimizer=sgd) as trainer:
        trainer.step(torch.randn(8, 3, 8, 8), torch.randn(8, 3))
    assert str(info.value).splitlines()[0] == (
        "stage 0 failed at batch 0: PPLLError: stage 0's auxiliary head gives scores of shape (8, 5), and a target of "
        "shape (8, 3) and dtype torch.float32 " + RULES + "give the heads a loss: compiled.trainer(..., aux_loss=fn) "
        "with fn(scores, target) -> scalar tensor (or aux_loss=[fn or None per auxiliary head])")


def test_a_target_that_fits_no_last_stage_loss_names_loss():
    compiled = compiled_residual()
    fn = lambda s, t: F.mse_loss(s[:, :3], t)  # noqa: E731 - the heads are served; the last stage is not
    with pytest.raises(StageError) as info, compiled.trainer(optimizer=sgd, aux_loss=fn) as trainer:
        trainer.step(torch.randn(8, 3, 8, 8), torch.randn(8, 3))
    assert str(info.value).splitlines()[0] == (
        "stage 1 failed at batch 0: PPLLError: stage 1, the last (the model's output), gives scores of shape (8, 5), "
        "and a target of shape (8, 3) and dtype torch.float32 " + RULES + "pass the last stage's loss: "
        "compiled.trainer(..., loss=fn) with fn(output, target) -> scalar tensor")


# ---- aux_loss= -----------------------------------------------------------------------------------------------------

def test_aux_loss_replaces_every_heads_loss_and_a_list_sets_it_per_head():
    x, y = regression_data(1, shape=(N,))[0]
    huber = lambda s, t: F.huber_loss(s.reshape(t.shape), t, delta=0.1)  # noqa: E731
    compiled = compiled_mlp(stages=3)
    with torch.no_grad():
        h0 = compiled.stages[0](x)
        h1 = compiled.stages[1](*h0)
        s0, s1 = compiled.heads[0](h0[0]), compiled.heads[1](h1[0])
    with compiled.trainer(optimizer=sgd, aux_loss=huber) as trainer:
        losses = trainer.step(x, y)
    assert losses[:2] == [[pytest.approx(float(huber(s0, y)), rel=1e-6)], [pytest.approx(float(huber(s1, y)), rel=1e-6)]]
    compiled = compiled_mlp(stages=3)
    with compiled.trainer(optimizer=sgd, aux_loss=[None, huber]) as trainer:
        losses = trainer.step(x, y)
    assert losses[:2] == [[pytest.approx(float(F.mse_loss(s0.reshape(N), y)), rel=1e-6)],
                          [pytest.approx(float(huber(s1, y)), rel=1e-6)]]


def test_a_wrong_aux_loss_is_refused_with_what_it_takes():
    compiled = compiled_mlp(stages=3)
    wanted = ("aux_loss must be None (the task's loss), a callable fn(scores, target) -> scalar tensor for every "
              "auxiliary head, or a list of 2 entries (one per auxiliary head: stages 0 to 1), each None or such a "
              "callable; ")
    with pytest.raises(PPLLError, match=re.escape(wanted + "got 1 entries")):
        compiled.trainer(optimizer=sgd, aux_loss=[F.mse_loss])
    with pytest.raises(PPLLError, match=re.escape(wanted + "entry 1 is 'mse', not callable")):
        compiled.trainer(optimizer=sgd, aux_loss=[None, "mse"])
    with pytest.raises(PPLLError, match=re.escape(wanted + "got 'mse'")):
        compiled.trainer(optimizer=sgd, aux_loss="mse")
    torch.manual_seed(0)
    distill = ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(torch.randn(8, 3, 16, 16),),
                                   gpus=2)
    with pytest.raises(PPLLError, match=re.escape("aux_loss= sets the local loss of a ppll plan's auxiliary heads, "
                                                  "but a pipebd plan trains on the distillation losses of its policy; "
                                                  "drop aux_loss=")):
        distill.trainer(optimizer=sgd, aux_loss=F.mse_loss)


def test_an_infopro_head_adds_its_reconstruction_to_aux_loss_weighted_by_classification_weight():
    torch.manual_seed(0)
    s = TensorSpec(name="h", shape=(4, 16, 8, 8), dtype="float32", bytes=4 * 4 * 16 * 64)
    weights = {"classification": "cross_entropy", "classification_weight": 0.3, "reconstruction_weight": 2.5}
    head = build_head({**load_policy("infopro").config_for(s), "loss": weights}, s, 6, (4, 3, 16, 16))
    h, x, y = torch.randn(4, 16, 8, 8), torch.randn(4, 3, 16, 16), torch.randn(4, 6)
    fn = lambda scores, t: (scores - t).abs().mean()  # noqa: E731
    expected = 0.3 * fn(head.net(h), y) + 2.5 * head.reconstruction_loss(h, x)
    torch.testing.assert_close(head.loss(h, y, x, loss=fn), expected)
    torch.testing.assert_close(head.loss(h, y, x), 0.3 * F.mse_loss(head.net(h), y) + 2.5 * head.reconstruction_loss(h, x))


# ---- the rule itself -----------------------------------------------------------------------------------------------

def test_the_task_rule():
    g = torch.Generator().manual_seed(0)
    scores, tokens = torch.randn(4, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    labels, per_token = torch.tensor([0, 4, IGNORE_INDEX, 2]), torch.randint(0, 5, (4, 3), generator=g)
    per_token[0, :2] = IGNORE_INDEX
    assert task_of(scores, labels) == "classes" and task_of(tokens, per_token) == "tokens"
    torch.testing.assert_close(task_loss(scores, labels), F.cross_entropy(scores[[0, 1, 3]], labels[[0, 1, 3]]))
    kept = per_token.flatten() != IGNORE_INDEX
    torch.testing.assert_close(task_loss(tokens, per_token),
                               F.cross_entropy(tokens.reshape(-1, 5)[kept], per_token.flatten()[kept]))
    # one score per example: integer 0/1 labels are binary (cross-entropy over one class would be 0)
    one, binary = torch.randn(4, 1, generator=g), torch.tensor([0, 1, 1, 0])
    assert task_of(one, binary) == "multilabel"
    torch.testing.assert_close(task_loss(one, binary), F.binary_cross_entropy_with_logits(one[:, 0], binary.float()))
    # float targets of the output's shape are regression now (soft labels take loss=/aux_loss=)
    soft = torch.softmax(torch.randn(4, 5, generator=g), 1)
    assert task_of(scores, soft) == "regression"
    torch.testing.assert_close(model_loss(scores, soft), F.mse_loss(scores, soft))
    torch.testing.assert_close(task_loss(scores, soft, F.l1_loss), F.l1_loss(scores, soft))
    with pytest.raises(PPLLError) as info:
        task_loss(scores, torch.randn(4, 3), where="stage 2's auxiliary head")
    assert str(info.value).startswith("stage 2's auxiliary head gives scores of shape (4, 5), and a target of shape "
                                      "(4, 3) and dtype torch.float32 " + RULES + "give the heads a loss")

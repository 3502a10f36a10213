"""``Trainer.evaluate`` reports what people measure: every stage's mean local loss and the final loss, accuracy where
the targets are classes, perplexity for per-token labels, the user's metrics; exact means (the whole data as one
batch) and the same numbers under every runtime."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import eval_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from ppll_compile.errors import PPLLError  # noqa: E402
from tests.helpers import compiled_residual, image_batches, sgd  # noqa: E402
from tests.models import conv_student, conv_teacher  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _whole(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def _mean_top1(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(1) == y).float().mean()


def test_a_classifiers_losses_and_accuracies_are_those_of_the_whole_data_as_one_batch():
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd) as trainer:
        for x, y in image_batches(3):
            trainer.step(x, y)
        test = image_batches(3, last=3, seed=1)  # batches of 8, 8 and 3
        result = trainer.evaluate(test, metrics={"top1": _mean_top1, "zero": lambda out, y: 0.0})
    assert compiled.stages[0].training  # evaluate restores train mode
    x, y = _whole(test)
    compiled.eval()
    with torch.no_grad():
        out = compiled(x)
        scores = compiled.heads[0](compiled.stages[0](x)[0])
    head_loss = compiled.heads[0].classification_weight * F.cross_entropy(scores, y)
    accuracy = int((out.argmax(1) == y).sum()) / len(y)
    assert result.keys() == {"loss", "stage_loss", "accuracy", "stage_accuracy", "perplexity", "samples", "top1",
                             "zero"}
    assert result["loss"] == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-5)
    assert result["stage_loss"] == [pytest.approx(float(head_loss), rel=1e-5), result["loss"]]
    assert result["accuracy"] == accuracy
    assert result["stage_accuracy"] == [int((scores.argmax(1) == y).sum()) / len(y), accuracy]
    assert result["perplexity"] is None and result["samples"] == 19
    assert result["top1"] == pytest.approx(accuracy, rel=1e-6) and result["zero"] == 0.0  # weighted by batch size


def test_a_language_models_loss_counts_every_labelled_token_once_and_gives_perplexity():
    trainer = w.lm_pipeline("sequential")
    with trainer:
        result = w.lm_program(trainer)
    compiled_modules = trainer.lowered
    ids, labels = _whole(w.token_batches(2, [4, 3, 2]))
    compiled_modules.train(False)
    with torch.no_grad():
        out = compiled_modules(ids)
        h = compiled_modules.modules[0](ids)
        scores = compiled_modules.heads[0](h[0])
    kept = labels != -100
    loss = F.cross_entropy(out.reshape(-1, w.VOCAB), labels.flatten(), ignore_index=-100)
    head = compiled_modules.heads[0].classification_weight * F.cross_entropy(
        scores.reshape(-1, w.VOCAB), labels.flatten(), ignore_index=-100)
    assert result["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert result["stage_loss"] == [pytest.approx(float(head), rel=1e-5), result["loss"]]
    assert result["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert result["accuracy"] == int(((out.argmax(-1) == labels) & kept).sum()) / int(kept.sum())
    assert result["stage_accuracy"][0] == int(((scores.argmax(-1) == labels) & kept).sum()) / int(kept.sum())
    assert result["samples"] == 9
    # a user metric is a mean over batches weighted by their sizes (not by their labelled tokens)
    per_batch = [(len(y), float(w.METRICS["token_accuracy"](out[a:a + len(y)], y)))
                 for a, (_, y) in zip([0, 4, 7], w.token_batches(2, [4, 3, 2]))]
    assert result["token_accuracy"] == pytest.approx(sum(n * v for n, v in per_batch) / 9, rel=1e-6)


def test_a_regressions_loss_is_the_users_loss_and_it_has_no_accuracy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    compiled = ppll_compile.compile(model, 2, example_inputs=(torch.randn(8, 8),), split_points=["1"], policy="dgl")
    g = torch.Generator().manual_seed(1)
    test = [(x, x[:, :2] * 2) for x in (torch.randn(n, 8, generator=g) for n in (8, 5))]
    with compiled.trainer(optimizer=sgd, loss=F.l1_loss) as trainer:
        result = trainer.evaluate(test)
    x, y = _whole(test)
    compiled.eval()
    with torch.no_grad():
        out = compiled(x)
        scores = compiled.heads[0](compiled.stages[0](x)[0])
    assert result == {"loss": pytest.approx(float(F.l1_loss(out, y)), rel=1e-5),
                      "stage_loss": [pytest.approx(float(F.l1_loss(scores, y)), rel=1e-5),
                                     pytest.approx(float(F.l1_loss(out, y)), rel=1e-5)],
                      "accuracy": None, "stage_accuracy": [None, None], "perplexity": None, "samples": 13}


def test_threads_give_the_same_numbers_as_sequential():
    results = []
    for runtime in ("sequential", "threads"):
        with w.lm_pipeline(runtime) as trainer:
            results.append(w.lm_program(trainer))
    assert results[0] == results[1]
    assert None not in results[0].values()


def test_metrics_that_do_not_fit_are_refused():
    compiled = compiled_residual()
    test = image_batches(1)
    with compiled.trainer(optimizer=sgd) as trainer:
        with pytest.raises(PPLLError, match=re.escape("metrics name 'loss' is not a free name: use a string other "
                                                      "than evaluate's own keys (loss, stage_loss, accuracy, "
                                                      "stage_accuracy, perplexity, samples)")):
            trainer.evaluate(test, metrics={"loss": _mean_top1})
        with pytest.raises(PPLLError, match=re.escape("metrics['top1'] is 1, not a callable fn(output, target) -> "
                                                      "float")):
            trainer.evaluate(test, metrics={"top1": 1})
        with pytest.raises(PPLLError, match=re.escape("metrics must be a dict {name: fn(output, target) -> float}, "
                                                      "got [<function")):
            trainer.evaluate(test, metrics=[_mean_top1])
        with pytest.raises(PPLLError, match=re.escape("a metric returned 'high'; evaluate(metrics={name: fn}) takes "
                                                      "fn(output, target) -> a float or a one-value tensor")):
            trainer.evaluate(test, metrics={"word": lambda out, y: "high"})
    torch.manual_seed(0)
    distill = ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(torch.randn(8, 3, 16, 16),),
                                   gpus=2)
    with distill.trainer(optimizer=sgd) as trainer:
        with pytest.raises(PPLLError, match=re.escape("evaluate(metrics=...) scores a ppll pipeline's output; a pipebd "
                                                      "plan evaluates its blocks' distillation losses: drop metrics=")):
            trainer.evaluate([torch.randn(4, 3, 16, 16)], metrics={"top1": _mean_top1})

"""Callbacks of ``fit`` and ``evaluate``: what every hook gets, the CSV logger read back by ``csv.DictReader``, early
stopping on evaluation results, and the errors of callbacks given wrong."""

from __future__ import annotations

import csv
import math
import re
import sys

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import PPLLError
from ppll_compile.runtime.callbacks import Callback, EarlyStopping
from ppll_compile.runtime.loggers import CSVLogger, TensorBoardLogger

_PIPELINE: list = []


def _compiled():
    """A small MLP in 2 stages, compiled once; every call puts its first weights back."""
    if not _PIPELINE:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        compiled = ppll_compile.compile(model, 2, example_inputs=(torch.randn(8, 6),), devices=["cpu", "cpu"],
                                        optimizer="momentum")
        _PIPELINE.extend([compiled, [p.detach().clone() for p in _params(compiled)]])
    compiled, first = _PIPELINE
    with torch.no_grad():
        for p, q in zip(_params(compiled), first, strict=True):
            p.copy_(q)
    return compiled


def _params(compiled) -> list[nn.Parameter]:
    return [p for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]


def _data(n: int = 4, last: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    sizes = [8] * (n - 1) + [last]
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in sizes]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Recorder(Callback):
    """Every hook's call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict | list]] = []

    def on_step_end(self, trainer, record):
        self.calls.append(("step", record))

    def on_epoch_end(self, trainer, record):
        self.calls.append(("epoch", record))

    def on_evaluate(self, trainer, results):
        self.calls.append(("evaluate", results))

    def on_fit_end(self, trainer, history):
        self.calls.append(("fit_end", history))


def test_every_hook_gets_the_losses_sizes_learning_rates_and_counters():
    data, val = _data(last=5), _data(n=2)
    seen = Recorder()
    with _compiled().trainer(optimizer=_sgd, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)) \
            as trainer:
        history = trainer.fit(data, epochs=2, progress=False, callbacks=seen, evaluate=val)
        assert [kind for kind, _ in seen.calls] == ["step"] * 4 + ["evaluate", "epoch"] + ["step"] * 4 + [
            "evaluate", "epoch", "fit_end"]
        steps = [r for kind, r in seen.calls if kind == "step"]
        assert [(r["epoch"], r["batch"], r["step"], r["samples"]) for r in steps] == [
            (1, 1, 1, 8), (1, 2, 2, 8), (1, 3, 3, 8), (1, 4, 4, 5), (2, 5, 5, 8), (2, 6, 6, 8), (2, 7, 7, 8),
            (2, 8, 8, 5)]
        assert [r["sizes"] for r in steps[:4]] == [[[8], [8]]] * 3 + [[[5], [5]]]
        assert all(r["loss"] == [ls[0] for ls in r["losses"]] for r in steps)
        assert [r["lr"] for r in steps[:3]] == [[0.05, 0.05], [0.025, 0.025], [0.025, 0.025]]
        # the epoch's loss is the mean of its steps' losses
        assert history[0]["loss"] == pytest.approx([sum(r["loss"][i] for r in steps[:4]) / 4 for i in range(2)])
        epochs = [r for kind, r in seen.calls if kind == "epoch"]
        assert [{k: v for k, v in r.items() if k not in ("kind", "batch", "step")} for r in epochs] == history
        assert [(r["kind"], r["batch"], r["step"]) for r in epochs] == [("epoch", 4, 4), ("epoch", 8, 8)]
        assert [r for kind, r in seen.calls if kind == "evaluate"] == [h["evaluate"] for h in history]
        assert seen.calls[-1] == ("fit_end", history)
        assert history[1]["evaluate"] == trainer.evaluate(val)
        trainer.evaluate(val, callbacks=[seen])
        assert seen.calls[-1] == ("evaluate", history[1]["evaluate"])


def test_the_csv_log_has_a_row_per_step_epoch_and_evaluation_equal_to_what_fit_returns(tmp_path):
    path = tmp_path / "logs" / "train.csv"
    data, val = _data(last=5), _data(n=2)
    steps = Recorder()
    with _compiled().trainer(optimizer=_sgd) as trainer:
        history = trainer.fit(data, epochs=2, progress=False, callbacks=[CSVLogger(path), steps], evaluate=val)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["kind"] for r in rows] == ["step"] * 4 + ["evaluate", "epoch"] + ["step"] * 4 + ["evaluate", "epoch"]
    for row, record in zip([r for r in rows if r["kind"] == "step"], [r for k, r in steps.calls if k == "step"],
                           strict=True):
        assert [int(row[k]) for k in ("epoch", "batch", "step", "samples")] == [record[k] for k in
                                                                               ("epoch", "batch", "step", "samples")]
        assert [float(row[f"loss_s{i}"]) for i in range(2)] == record["loss"]
        assert [float(row[f"lr_s{i}"]) for i in range(2)] == [0.05, 0.05]
    for row, record in zip([r for r in rows if r["kind"] == "epoch"], history):
        assert int(row["epoch"]) == record["epoch"] and int(row["samples"]) == record["samples"]
        assert [float(row[k]) for k in ("seconds", "samples_per_s")] == [record["seconds"], record["samples_per_s"]]
        assert [float(row[f"loss_s{i}"]) for i in range(2)] == record["loss"]
        assert row["accuracy"] == ""  # an evaluation's column, empty in an epoch's row
    for row, record in zip([r for r in rows if r["kind"] == "evaluate"], history):
        results = record["evaluate"]
        assert [float(row[k]) for k in ("loss", "accuracy")] == [results["loss"], results["accuracy"]]
        assert [float(row[f"stage_loss_s{i}"]) for i in range(2)] == results["stage_loss"]
        assert int(row["samples"]) == results["samples"] == 16 and row["perplexity"] == ""
        assert row["loss_s0"] == ""


def test_a_csv_logger_with_append_goes_on_after_the_rows_of_an_earlier_run(tmp_path):
    path = tmp_path / "train.csv"
    data = _data(n=2)
    with _compiled().trainer(optimizer=_sgd) as trainer:
        trainer.fit(data, epochs=1, progress=False, callbacks=[CSVLogger(path)])
        trainer.fit(data, epochs=2, progress=False, callbacks=[CSVLogger(path, append=True)])
        trainer.fit(data, epochs=3, progress=False, callbacks=[CSVLogger(path)])  # a new logger starts afresh
    with path.open(newline="") as f:
        assert [(r["kind"], r["epoch"]) for r in csv.DictReader(f)] == [("step", "3"), ("step", "3"), ("epoch", "3")]


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_early_stopping_ends_fit_after_patience_evaluations_without_improvement(runtime):
    scores = [0.5, 0.4, 0.45, 0.41, 0.39, 0.1]  # best at epoch 2; epochs 3 and 4 do not beat it by 0.005
    calls = []

    def score(output, target):  # the value of the evaluation in progress (two batches each)
        calls.append(1)
        return scores[(len(calls) - 1) // 2]

    stop = EarlyStopping("score", patience=2, min_delta=0.005)
    with _compiled().trainer(optimizer=_sgd, runtime=runtime) as trainer:
        history = trainer.fit(_data(), epochs=6, progress=False, callbacks=[stop], evaluate=_data(n=2),
                              metrics={"score": score})
        assert [r["epoch"] for r in history] == [1, 2, 3, 4]
        assert [r["evaluate"]["score"] for r in history] == scores[:4]
        assert (trainer.epoch, stop.best, stop.wait, stop.stopped_epoch) == (4, 0.4, 2, 4)
        assert trainer.fit(_data(), epochs=5, progress=False)[0]["epoch"] == 5  # a new fit starts again


def test_early_stopping_in_max_mode_and_its_errors():
    stop = EarlyStopping("accuracy", mode="max", patience=1)
    with _compiled().trainer(optimizer=_sgd) as trainer:
        stop.on_evaluate(trainer, {"accuracy": 0.5})
        stop.on_evaluate(trainer, {"accuracy": 0.6})
        assert not trainer.should_stop
        stop.on_evaluate(trainer, {"accuracy": 0.6})
        assert trainer.should_stop and stop.best == 0.6
        with pytest.raises(PPLLError, match=re.escape(
                "EarlyStopping(monitor='f1') found None in the evaluation's results, not a number; results with "
                "numbers: ['accuracy', 'loss']. Pass monitor= one of them (a metric of your own: fit(..., "
                "metrics={name: fn}))")):
            EarlyStopping("f1").on_evaluate(trainer, {"loss": 1.0, "accuracy": 0.5, "perplexity": None})
        with pytest.raises(PPLLError, match=re.escape(
                "fit(...) was given EarlyStopping, which needs an evaluation after every epoch, but no evaluate= "
                "loader; pass evaluate=val_loader (its (inputs, target) pairs)")):
            trainer.fit(_data(), progress=False, callbacks=[EarlyStopping()])
        assert trainer.batches == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"patience": 0}, "EarlyStopping(patience=...) is the number of evaluations in a row without improvement after "
                      "which fit stops, a whole number >= 1, got 0; pass e.g. patience=3"),
    ({"min_delta": -0.1}, "EarlyStopping(min_delta=...) is how much better than the best a result must be to count "
                          "as an improvement, a finite number >= 0, got -0.1; pass e.g. min_delta=0.001"),
    ({"min_delta": math.inf}, "a finite number >= 0, got inf"),
    ({"mode": "lower"}, "EarlyStopping(mode=...) is 'min' (lower loss is better) or 'max' (higher is better), got "
                        "'lower'"),
])
def test_early_stopping_refuses_bad_settings(options, message):
    with pytest.raises(PPLLError, match=re.escape(message)):
        EarlyStopping(**options)


def test_callbacks_given_wrong_are_refused_naming_the_way_out():
    with _compiled().trainer(optimizer=_sgd) as trainer:
        with pytest.raises(PPLLError, match=re.escape(
                "fit(callbacks=...) takes Callback objects (a list, or one): subclasses of ppll_compile.Callback such "
                "as CSVLogger('log.csv'), or objects with one of on_step_end, on_epoch_end, on_evaluate, "
                "on_fit_end; got 'log.csv'")):
            trainer.fit(_data(), progress=False, callbacks=["log.csv"])
        with pytest.raises(PPLLError, match=re.escape(
                "evaluate(callbacks=...) takes Callback objects (a list, or one): subclasses of ppll_compile.Callback "
                "such as CSVLogger('log.csv'), or objects with one of on_step_end, on_epoch_end, on_evaluate, "
                f"on_fit_end; got {EarlyStopping!r}; pass an instance, e.g. EarlyStopping(...)")):
            trainer.evaluate(_data(), callbacks=[EarlyStopping])


def test_a_csv_logger_refuses_a_directory(tmp_path):
    with pytest.raises(PPLLError, match=re.escape(
            f"CSVLogger({str(tmp_path)!r}) is a directory; give the path of a file, e.g. "
            f"CSVLogger({str(tmp_path / 'log.csv')!r})")):
        CSVLogger(tmp_path)


def test_the_tensorboard_logger_without_tensorboard_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were missing
    with pytest.raises(PPLLError, match=re.escape(
            "install it with pip install tensorboard (or pip install 'ppll-compile[tensorboard]'), or log with "
            "CSVLogger('log.csv')")):
        TensorBoardLogger("runs/x")

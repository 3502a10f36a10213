"""``fit``'s counts: ``epochs`` is the total from the start of training with and without ``checkpoint=``, a call that
trains nothing warns, ``max_steps`` stops by optimizer steps, a resumed fit says where, and bad values are refused."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import PPLLError

BATCHES = 5


_PIPELINE: list = []


def _compiled(other_weights: bool = False):
    """A small MLP in 2 stages, compiled once; every call puts its first weights back (``other_weights``: others)."""
    if not _PIPELINE:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        compiled = ppll_compile.compile(model, 2, example_inputs=(torch.randn(8, 6),), devices=["cpu", "cpu"],
                                        optimizer="momentum")
        _PIPELINE.extend([compiled, _state(compiled)])
    compiled, first = _PIPELINE
    with torch.no_grad():
        for p, q in zip(_params(compiled), first, strict=True):
            p.copy_(q + 1 if other_weights else q)
    return compiled


def _params(compiled) -> list[nn.Parameter]:
    return [p for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]


def _data(n: int = BATCHES, last: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    sizes = [8] * (n - 1) + [last]
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in sizes]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _state(compiled) -> list[torch.Tensor]:
    return [p.detach().clone() for p in _params(compiled)]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def _by_steps(batches: list, accumulate: int = 1, **options) -> list[torch.Tensor]:
    """The reference: ``step`` over ``batches`` (a list of epochs), ``finish`` at every epoch's end."""
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd, accumulate=accumulate, **options) as trainer:
        for epoch in batches:
            for x, y in epoch:
                trainer.step(x, y)
            trainer.finish()
    return _state(compiled)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_an_epoch_loop_trains_every_epoch_with_and_without_checkpoint(tmp_path, checkpoint):
    data = _data(n=3)
    compiled = _compiled()
    where = {"checkpoint": tmp_path / "ckpt"} if checkpoint else {}
    with compiled.trainer(optimizer=_sgd) as trainer:
        for e in range(3):
            history = trainer.fit(data, epochs=e + 1, progress=False, **where)
            assert [r["epoch"] for r in history] == [e + 1]
            assert trainer.epoch == e + 1
    _assert_same(_state(compiled), _by_steps([data] * 3))


def test_a_call_that_trains_nothing_warns_and_returns_nothing():
    data = _data(n=2)
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd) as trainer:
        trainer.fit(data, epochs=2, progress=False)
        before = _state(compiled)
        with pytest.warns(UserWarning) as warned:
            assert trainer.fit(data, epochs=1, progress=False) == []
        assert trainer.batches == 4
    _assert_same(_state(compiled), before)
    assert [str(w.message) for w in warned] == [
        "fit(epochs=1) trains nothing: this trainer has already trained 2 epoch(s); epochs counts the total from the "
        "start of training (with or without checkpoint=), so pass epochs=3 to train one more; in an epoch loop: for "
        "e in range(n): trainer.fit(loader, epochs=e + 1)"]
    assert warned[0].filename == __file__


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_max_steps_stops_inside_an_epoch_and_the_next_fit_goes_on_after_it(runtime):
    data = _data(last=5)
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd, runtime=runtime, accumulate=2) as trainer:
        first = trainer.fit(data, epochs=3, max_steps=5, progress=False)
        # epoch 1: 5 batches, 3 steps (the last on a partial group); epoch 2: 4 batches, 2 steps
        assert [(r["epoch"], r["samples"]) for r in first] == [(1, 37), (2, 32)]
        assert (trainer.updates, trainer.epoch, trainer.batches) == ({0: 5, 1: 5}, 1, 9)
        stopped = _state(compiled)
        second = trainer.fit(data, epochs=3, progress=False)
        assert [(r["epoch"], r["samples"]) for r in second] == [(2, 5), (3, 37)]
        assert (trainer.updates, trainer.epoch) == ({0: 9, 1: 9}, 3)
    end = _state(compiled)
    _assert_same(stopped, _by_steps([data, data[:4]], accumulate=2, runtime=runtime))
    _assert_same(end, _by_steps([data, data[:4], data[4:], data], accumulate=2))


def test_max_steps_already_reached_warns():
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd) as trainer:
        trainer.fit(_data(), epochs=1, max_steps=3, progress=False)
        with pytest.warns(UserWarning) as warned:
            assert trainer.fit(_data(), epochs=2, max_steps=3, progress=False) == []
    assert [str(w.message) for w in warned] == [
        "fit(max_steps=3) trains nothing: the first stage has already taken 3 optimizer step(s) (trainer.updates); "
        "max_steps counts the total from the start of training (with or without checkpoint=), so pass a larger "
        "max_steps= to train on"]
    assert warned[0].filename == __file__


def test_max_steps_with_checkpoint_saves_where_it_stops_and_the_same_call_again_resumes_there(tmp_path, capsys,
                                                                                                caplog):
    data, root = _data(), tmp_path / "ckpt"
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd) as trainer:
        trainer.fit(data, epochs=2, max_steps=7, checkpoint=root, every=2, progress=False)
        assert (trainer.batches, trainer.epoch) == (7, 1)
    assert capsys.readouterr().err == ""
    compiled = _compiled(other_weights=True)  # all of them come from the checkpoint
    with compiled.trainer(optimizer=_sgd) as trainer:
        with caplog.at_level(logging.INFO, logger="ppll_compile"):
            history = trainer.fit(data, epochs=2, checkpoint=root, progress=False)
        assert [(r["epoch"], r["samples"]) for r in history] == [(2, 24)]
    said = (f"fit resumed from checkpoint {str(root / 'ckpt-000003')!r} at batch 7: epoch 2, 2 of its 5 batches "
            f"done")
    assert capsys.readouterr().err == said + "\n"
    assert [r.getMessage() for r in caplog.records if r.name == "ppll_compile"] == [said]
    _assert_same(_state(compiled), _by_steps([data, data[:2], data[2:4], data[4:]]))


@pytest.mark.parametrize(("options", "message"), [
    ({"epochs": 1.5}, "epochs must be a whole number >= 1 (the total number of epochs from the start of training), "
                      "got 1.5; pass e.g. epochs=2 (for part of an epoch: max_steps=)"),
    ({"epochs": -1}, "epochs must be a whole number >= 1 (the total number of epochs from the start of training), "
                     "got -1; pass e.g. epochs=2 (for part of an epoch: max_steps=)"),
    ({"epochs": True}, "epochs must be a whole number >= 1"),
    ({"max_steps": 0}, "max_steps must be None or a whole number >= 1 (optimizer steps of the first stage from the "
                       "start of training, as trainer.updates counts them), got 0; pass e.g. max_steps=1000, or "
                       "leave it out to train whole epochs"),
    ({"max_steps": -4}, "max_steps must be None or a whole number >= 1 .*, got -4;"),
    ({"max_steps": 2.5}, "max_steps must be None or a whole number >= 1 .*, got 2.5;"),
    ({"metrics": {"m": lambda o, t: 0.0}}, re.escape("fit(...) was given metrics=, which needs an evaluation after "
                                                     "every epoch, but no evaluate= loader; pass evaluate=val_loader")),
])
def test_bad_counts_are_refused_before_any_training(options, message):
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd) as trainer:
        with pytest.raises(PPLLError, match=message if ".*" in message or "\\" in message else re.escape(message)):
            trainer.fit(_data(), progress=False, **options)
        assert trainer.batches == 0


def test_a_non_float_autocast_dtype_is_refused():
    compiled = _compiled()
    with pytest.raises(PPLLError, match=re.escape(
            "autocast=torch.int8 is not a floating-point dtype: torch.autocast runs a stage's forward in a lower "
            "float precision, and torch.int8 holds no fractions; pass autocast=torch.bfloat16 or torch.float16 (or "
            "None: float32)")):
        compiled.trainer(optimizer=_sgd, autocast=torch.int8)
    with pytest.raises(PPLLError, match=re.escape("autocast=[None, torch.int64] is not a floating-point dtype")):
        compiled.trainer(optimizer=_sgd, autocast=[None, torch.int64])


def test_compile_stages_is_checked_and_passed_to_every_stage():
    compiled = _compiled()
    with pytest.raises(PPLLError, match=re.escape(
            "compile_stages must be True (every stage's forward under torch.compile), False (eager) or a dict of "
            "torch.compile keywords (backend, mode, options, dynamic, fullgraph), e.g. compile_stages={'mode': "
            "'max-autotune'}; got 'yes'")):
        compiled.trainer(optimizer=_sgd, compile_stages="yes")
    with compiled.trainer(optimizer=_sgd) as trainer:
        assert all(r.config.compile_stages is False for r in trainer.runners)


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_step_gives_the_batch_size_of_every_loss(runtime):
    data = _data(n=3, last=5)
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd, runtime=runtime) as trainer:
        got = [trainer.step(x, y) for x, y in data] + [trainer.finish()]
    losses = [[loss for part in got for loss in part[i]] for i in range(2)]
    sizes = [[size for part in got for size in part.sizes[i]] for i in range(2)]
    assert sizes == [[8, 8, 5], [8, 8, 5]]
    assert all(len(part.sizes[i]) == len(part[i]) for part in got for i in range(2))
    assert [len(ls) for ls in losses] == [3, 3]
    assert got[0] == [list(ls) for ls in got[0]]  # still a list of lists


def test_lr_gives_every_stages_learning_rate_as_its_scheduler_moves_it():
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)) \
            as trainer:
        assert trainer.lr == {0: 0.05, 1: 0.05}
        trainer.fit(_data(n=2), epochs=1, progress=False)
        assert trainer.lr == {0: 0.0125, 1: 0.0125}
        assert trainer.lr == {r.index: r.optimizers[0].param_groups[0]["lr"] for r in trainer.runners}


def test_dna_per_block_refuses_max_steps_and_evaluate():
    from tests.models import conv_student, conv_teacher
    x = torch.randn(8, 3, 16, 16)
    torch.manual_seed(0)
    compiled = ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(x,), split_points=["5"],
                                    replicas=(1, 1), devices=["cpu", "cpu"], optimizer="momentum")
    with compiled.trainer(optimizer=_sgd, runtime="dna-per-block") as trainer:
        with pytest.raises(PPLLError, match=re.escape(
                "fit(max_steps=3) stops after that many optimizer steps, but runtime='dna-per-block' trains each "
                "block over every epoch before the next, so no step of it ends training of the whole model; leave "
                "max_steps= out (whole epochs), or use runtime=\"dna\"")):
            trainer.fit([(x, None)], max_steps=3, progress=False)
        with pytest.raises(PPLLError, match=re.escape(
                "fit(evaluate=...) evaluates after every epoch, but runtime='dna-per-block' trains each block over "
                "every epoch before the next")):
            trainer.fit([(x, None)], evaluate=[(x, None)], progress=False)
        assert trainer.batches == 0

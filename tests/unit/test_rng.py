"""Training randomness per stage: every runtime trains the same computation with dropout on in every stage."""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.runtime.messages import Message
from ppll_compile.runtime.queues import Recent
from ppll_compile.runtime.rng import RNG_LOCK, stream_seed
from tests.helpers import (
    assert_tensors_equal,
    compile_dropout_chain,
    dropout_chain,
    dropout_chain_data,
    dropout_chain_sgd,
)


def _params(compiled: ppll_compile.CompiledPipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]


def _train(model: nn.Module, runtime: str, data: list, **options) -> tuple[list[torch.Tensor], list]:
    """Train a copy of ``model`` on ``data``; its stage parameters and ``draws_random`` of every stage."""
    compiled = compile_dropout_chain(copy.deepcopy(model))
    if runtime == "threads":
        options.setdefault("threads_per_stage", 1)
    with compiled.trainer(optimizer=dropout_chain_sgd, runtime=runtime, **options) as trainer:
        for x, y in data:
            trainer.step(x, y)
    return _params(compiled), [r.draws_random for r in trainer.runners]


pytestmark = pytest.mark.usefixtures("one_thread_quietly")  # the same reduction order in every runtime


# ---- the seed ----------------------------------------------------------------------------------------

def test_stream_seed_is_stable_and_every_argument_counts():
    base = stream_seed(0, 1, 2)
    assert base == stream_seed(0, 1, 2, reused=False, replica=0) == 0xD63DB11C9BD85A9B  # the same everywhere
    others = [stream_seed(1, 1, 2), stream_seed(0, 0, 2), stream_seed(0, 1, 3), stream_seed(0, 1, 2, reused=True),
              stream_seed(0, 1, 2, replica=1), stream_seed(0, 2, 1)]
    assert len({base, *others}) == 1 + len(others)
    assert all(0 <= s < 2 ** 64 for s in (base, *others)) and stream_seed(-1, 0, 0) < 2 ** 64


def test_a_reused_input_is_marked_and_gets_another_stream():
    recent = Recent()
    msg = Message(index=4, values=(torch.zeros(2),), target=torch.zeros(2))
    recent.remember(msg)
    again = recent.reuse()
    assert not msg.reused and again is not None and again.reused and again.index == 4


def test_seed_must_be_an_int_or_none():
    compiled = compile_dropout_chain(dropout_chain())
    for bad in ("0", 1.5, True):
        with pytest.raises(TypeError, match="seed must be an int"):
            compiled.trainer(optimizer=dropout_chain_sgd, seed=bad)
    assert compiled.trainer(optimizer=dropout_chain_sgd, seed=None).seed is None


# ---- the same computation ------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"queue_depth": 1}])
def test_threads_equal_sequential_with_dropout_in_every_stage(options):
    model, data = dropout_chain(), dropout_chain_data()
    ref, draws = _train(model, "sequential", data)
    ours, draws_threads = _train(model, "threads", data, **options)
    assert_tensors_equal(ours, ref)
    assert draws == draws_threads == [True, True, True]


def test_training_does_not_depend_on_the_global_generator_and_the_seed_does():
    model, data = dropout_chain(), dropout_chain_data()
    runs = []
    for global_seed, seed in [(123, 0), (456, 0), (123, 7)]:
        compiled = compile_dropout_chain(copy.deepcopy(model))
        torch.manual_seed(global_seed)  # the caller's stream when training starts: it must not matter
        with compiled.trainer(optimizer=dropout_chain_sgd, seed=seed) as trainer:
            for x, y in data:
                trainer.step(x, y)
        runs.append(_params(compiled))
    assert_tensors_equal(runs[1], runs[0])
    assert not all(torch.equal(p, q) for p, q in zip(runs[2], runs[0]))


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_training_leaves_the_callers_generator_untouched(runtime):
    compiled, data = compile_dropout_chain(dropout_chain()), dropout_chain_data()
    torch.manual_seed(99)
    before = torch.get_rng_state()
    with compiled.trainer(optimizer=dropout_chain_sgd, runtime=runtime) as trainer:
        for x, y in data:
            trainer.step(x, y)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_stage_without_random_ops_is_never_locked():
    # with no random op anywhere, once every stage has trained a step no forward takes the lock: training and
    # evaluation go on while another thread holds it
    compiled, data = compile_dropout_chain(dropout_chain((0.0, 0.0, 0.0))), dropout_chain_data()
    trainer = compiled.trainer(optimizer=dropout_chain_sgd, runtime="threads")
    trainer.step(*data[0])
    trainer.finish()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with RNG_LOCK:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(10)
    done = []
    worker = threading.Thread(target=lambda: done.append((
        [trainer.step(x, y) for x, y in data[1:]], trainer.finish(), trainer.evaluate(data[:2]))), daemon=True)
    worker.start()
    worker.join(15)
    finished_while_held = bool(done)
    release.set()
    holder.join(10)
    worker.join(15)
    trainer.close()
    assert finished_while_held, "training blocked on the RNG lock although no stage draws random numbers"
    assert [r.draws_random for r in trainer.runners] == [False, False, False]
    # dropout in stages 0 and 2 only: stage 1 is found to draw nothing on its first step
    _, draws = _train(dropout_chain((0.3, 0.0, 0.3)), "threads", dropout_chain_data())
    assert draws == [True, False, True]


def test_a_stage_measured_alone_draws_what_training_it_does():
    x, y = dropout_chain_data(1)[0]
    trainer = compile_dropout_chain(dropout_chain()).trainer(optimizer=dropout_chain_sgd)
    msg = trainer.message(x, y)
    first = trainer.runners[0]
    out, loss = first.forward_loss(msg)
    sent, trained = first.train_step(msg)
    assert float(trained) == float(loss.detach()) and torch.equal(sent.values[0], out[0].detach())


def test_resume_continues_the_same_stream(tmp_path):
    model, data = dropout_chain(), dropout_chain_data()
    straight, _ = _train(model, "threads", data)
    first = compile_dropout_chain(copy.deepcopy(model)).trainer(optimizer=dropout_chain_sgd, runtime="threads")
    for x, y in data[:3]:
        first.step(x, y)
    first.save(tmp_path / "ckpt")
    first.close()
    resumed_pipeline = compile_dropout_chain(copy.deepcopy(model))
    with resumed_pipeline.trainer(optimizer=dropout_chain_sgd, runtime="sequential") as resumed:
        resumed.load(tmp_path / "ckpt")
        for x, y in data[3:]:
            resumed.step(x, y)
    assert_tensors_equal(_params(resumed_pipeline), straight)
    assert json.loads((tmp_path / "ckpt" / "ckpt-000000" / "manifest.json").read_text())["trainer"]["seed"] == 0
    with pytest.warns(UserWarning, match=r"was trained with seed=0; this trainer has seed=3"):
        compile_dropout_chain(copy.deepcopy(model)).trainer(optimizer=dropout_chain_sgd, seed=3).load(tmp_path / "ckpt")

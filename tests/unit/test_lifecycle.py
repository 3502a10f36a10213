"""A trainer's lifecycle: empty batches, close() after a failure, Ctrl-C, a trainer dropped without close(),
and one open trainer per compiled pipeline."""

import gc
import threading
import time

import pytest
import torch

import ppll_compile
from ppll_compile import StageError
from ppll_compile.errors import PPLLError
from ppll_compile.runtime.base import RuntimeSetup
from ppll_compile.runtime.config import TrainConfig
from ppll_compile.runtime.threads import ThreadsRuntime
from tests import ckpt_worker as w
from tests.dist_worker import Chain, Trap
from tests.helpers import sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _chain(trap: Trap, runtime: str, trap_stage: int = 1):
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Chain(3, trap, trap_stage), example_inputs=(torch.randn(4, 8),), policy="dgl",
                                    split_points=["blocks.0", "blocks.1"], leaf_modules=(Trap,))
    trap.armed = True
    return compiled, compiled.trainer(optimizer=sgd, runtime=runtime)


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_an_empty_batch_is_refused_and_nothing_steps(runtime):
    compiled = w.pipeline()
    trainer = compiled.trainer(optimizer=sgd, runtime=runtime)
    before = w.parameters(compiled)
    with pytest.raises(ValueError, match=r"^batch 0 is empty \(0 examples\): nothing to train on, and a mean loss "
                                         r"over no examples is NaN; skip empty batches"):
        trainer.step(torch.zeros(0, 3, 8, 8), torch.zeros(0, dtype=torch.int64))
    trainer.close()
    assert trainer.batches == 0 and set(trainer.steps.values()) == {0}
    assert all(torch.equal(p, q) for p, q in zip(before, w.parameters(compiled)))


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_close_after_a_stage_error_releases_and_returns(runtime):
    trap = Trap("raise", 1)
    compiled, trainer = _chain(trap, runtime)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with pytest.raises(StageError, match="^stage 1 failed at batch 1: RuntimeError: boom at call 1"):
        for _ in range(20):
            trainer.step(x, y)
        trainer.finish()
    assert trainer.close() is None and trainer.closed
    with pytest.raises(StageError):  # the trainer is done: its error stays
        trainer.step(x, y)
    assert not [t for t in threading.enumerate() if t.name.startswith("ppll-stage") and t.is_alive()]
    compiled.trainer(optimizer=sgd).close()  # the pipeline takes a new trainer


def test_a_trainer_dropped_without_close_ends_its_threads():
    trainer = w.pipeline().trainer(optimizer=sgd, runtime="threads")
    for i in range(3):
        trainer.step(*w.batch(i))
    workers = list(trainer._runtime._workers)
    assert len(workers) == 2 and all(t.is_alive() for t in workers)
    del trainer
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in workers)


def test_a_second_open_trainer_is_refused_until_the_first_is_closed_or_gone():
    compiled = w.pipeline()
    first = compiled.trainer(optimizer=sgd, runtime="threads")
    first.step(*w.batch(0))
    with pytest.raises(PPLLError, match=r"^this compiled pipeline already has an open trainer \(Trainer\(Residual, "
                                        r"runtime='threads', stages here=\[0, 1\], batches=1\)\); two would train "
                                        r"the same parameters at once. Close it first"):
        compiled.trainer(optimizer=sgd)
    first.close()
    second = compiled.trainer(optimizer=sgd)
    del second
    gc.collect()
    with compiled.trainer(optimizer=sgd) as third:
        third.step(*w.batch(0))
    compiled.trainer(optimizer=sgd)


def test_a_worker_that_fails_before_its_loop_stops_the_pipeline_instead_of_hanging():
    """A worker whose own setup raises (here torch refusing its thread count) reports a StageError; the caller's
    next step raises it instead of waiting for ever on a full queue."""
    compiled = w.pipeline()
    with compiled.trainer(optimizer=sgd) as trainer:
        messages = [trainer.message(*w.batch(i)) for i in range(2)]
    runtime = ThreadsRuntime.build(RuntimeSetup(plan=compiled.plan, lowered=compiled.lowered,
                                                config=TrainConfig(optimizer=sgd), threads_per_stage=-1))
    try:
        assert runtime.step(messages[0]) == [[], []]
        assert runtime.wait_stopped(5) == []
        with pytest.raises(StageError, match=r"^stage [01] failed: RuntimeError: set_num_threads expects a positive "
                                             r"integer\n--- traceback of stage [01] ---"):
            runtime.step(messages[1])
    finally:
        runtime.close()


@pytest.mark.parametrize("bad", [0, -5, float("nan"), 10**9, None])
def test_timeout_must_be_a_positive_number_of_seconds_up_to_a_week(bad):
    with pytest.raises(PPLLError) as e:
        w.pipeline().trainer(optimizer=sgd, timeout=bad)
    assert str(e.value) == (f"timeout must be a positive number of seconds up to 604800 (a week; how long a process "
                            f"waits for the others, and a new trainer for a previous one's worker threads), got {bad!r}")

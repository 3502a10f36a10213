"""What a closed, interrupted or failed trainer leaves behind: a worker still inside a stage's forward never steps
afterwards, a new trainer of the same pipeline waits for it (or refuses), and failed trainers are freed."""

import threading
import time
import warnings

import pytest
import torch

import ppll_compile
from tests.dist_worker import Chain
from tests.helpers import interrupted_inside_a_forward, params_and_grads, same_tensors, sgd, Gate
import gc
import weakref
from ppll_compile import StageError
from ppll_compile.errors import PPLLError
from tests.dist_worker import Trap
from tests.helpers import GATE_X, GATE_Y

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


@pytest.fixture
def gated():
    """A three-stage chain whose stage 1 holds a :class:`Gate`, and the gate (opened at the end of the test)."""
    gate = Gate()
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Chain(3, gate, 1), example_inputs=(torch.randn(4, 8),), policy="dgl",
                                    split_points=["blocks.0", "blocks.1"], leaf_modules=(Gate,))
    yield compiled, gate
    gate.opened.set()


@pytest.mark.slow
def test_a_new_trainer_waits_for_the_old_worker_and_its_loaded_checkpoint_stays(gated, tmp_path):
    """The issue's sequence: Ctrl-C inside a forward, close, a new trainer, load; then the old worker's forward
    returns. The new trainer is only built once that worker has ended, and the loaded parameters stay."""
    compiled, gate = gated
    stuck = interrupted_inside_a_forward(compiled, gate, tmp_path)
    opener = threading.Timer(1.5, gate.opened.set)
    opener.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = compiled.trainer(optimizer=sgd, runtime="threads")
    assert not stuck.is_alive() and gate.opened.is_set()
    assert [str(w.message) for w in caught if "previous trainer" in str(w.message)] == [
        "stage 1's worker thread of this compiled pipeline's previous trainer is still running; waiting up to 300 s "
        "(timeout=) for it to end before building the new trainer"]
    trainer.load(tmp_path)
    loaded = params_and_grads(compiled)
    time.sleep(0.3)
    assert same_tensors(params_and_grads(compiled), loaded)
    trainer.close()


def test_a_closed_trainers_worker_never_steps_once_its_forward_returns(gated, tmp_path):
    compiled, gate = gated
    stuck = interrupted_inside_a_forward(compiled, gate, tmp_path)
    before = params_and_grads(compiled)
    gate.opened.set()
    stuck.join(10)
    assert not stuck.is_alive()
    assert same_tensors(params_and_grads(compiled),
                        before)  # no backward, no optimizer step: parameters and gradients as they were


def test_a_new_trainer_refuses_while_the_old_worker_runs_and_is_accepted_once_it_ended(gated, tmp_path):
    compiled, gate = gated
    stuck = interrupted_inside_a_forward(compiled, gate, tmp_path)
    with pytest.raises(PPLLError) as e:
        compiled.trainer(optimizer=sgd, runtime="threads", timeout=0.3)
    assert str(e.value) == (
        "stage 1's worker thread of this compiled pipeline's previous trainer is still running after 0.3 s: it is "
        "inside the stage's own code (a forward that waits or hangs), which cannot be interrupted. Closing that "
        "trainer cancelled it, so it will never step again, but it would still run the stage's modules beside the "
        "new trainer's. Make that code return, or build the trainer with a longer timeout= (the seconds it waits), "
        "or restart the process (and load the last checkpoint there)")
    gate.opened.set()
    stuck.join(10)
    gate.armed = False
    with compiled.trainer(optimizer=sgd, runtime="threads") as trainer:
        trainer.step(GATE_X, GATE_Y)


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_failed_trainers_are_freed(runtime):
    """A failed step's error keeps its message, but no trainer stays alive once the caller dropped it."""
    trap = Trap("raise", 0)
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Chain(3, trap, 1), example_inputs=(torch.randn(4, 8),), policy="dgl",
                                    split_points=["blocks.0", "blocks.1"], leaf_modules=(Trap,))
    trap.armed = True
    refs, messages = [], set()
    for _ in range(20):
        trap.calls = 0
        trainer = compiled.trainer(optimizer=sgd, runtime=runtime)
        refs.append(weakref.ref(trainer))
        with pytest.raises(StageError) as e:
            for _ in range(5):
                trainer.step(GATE_X, GATE_Y)
            trainer.finish()
        messages.add(str(e.value).splitlines()[0])
        trainer.close()
        del trainer, e
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert messages == {"stage 1 failed at batch 0: RuntimeError: boom at call 0"}

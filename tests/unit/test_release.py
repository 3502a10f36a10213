"""What a closed, interrupted or failed trainer leaves behind: a worker still inside a stage's forward never steps
afterwards, a new trainer of the same pipeline waits for it (or refuses), and failed trainers are freed."""

import _thread
import gc
import threading
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import StageError
from ppll_compile.errors import PPLLError
from tests.dist_worker import Chain, Trap
from tests.helpers import sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


class Gate(nn.Module):
    """Identity whose forward, once armed, says it entered and waits until opened: a stage's own code that blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False  # compile() runs the module while planning
        self.entered = threading.Event()
        self.opened = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.entered.set()
            self.opened.wait(30)
        return x


X, Y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])


@pytest.fixture
def gated():
    """A three-stage chain whose stage 1 holds a :class:`Gate`, and the gate (opened at the end of the test)."""
    gate = Gate()
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Chain(3, gate, 1), example_inputs=(torch.randn(4, 8),), policy="dgl",
                                    split_points=["blocks.0", "blocks.1"], leaf_modules=(Gate,))
    yield compiled, gate
    gate.opened.set()


def _state(compiled) -> list[torch.Tensor | None]:
    """Every stage's parameters and gradients, copied."""
    params = [p for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]
    return [p.detach().clone() for p in params] + [None if p.grad is None else p.grad.clone() for p in params]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


def _interrupted_inside_a_forward(compiled, gate, root):
    """A threads trainer that saved a checkpoint under ``root``, then got Ctrl-C (KeyboardInterrupt in the caller)
    while stage 1 waits inside its own forward, and was closed; the worker thread still inside that forward."""
    before = set(threading.enumerate())
    trainer = compiled.trainer(optimizer=sgd, runtime="threads", queue_depth=1)
    trainer.step(X, Y)
    trainer.finish()
    trainer.save(root)
    gate.armed = True

    def ctrl_c() -> None:
        if gate.entered.wait(10):
            time.sleep(0.5)  # the caller is waiting in step() by then: every queue is full
            _thread.interrupt_main()

    threading.Thread(target=ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(50):
            trainer.step(X, Y)
    start = time.monotonic()
    trainer.close()
    assert time.monotonic() - start < 1.5
    stuck = [t for t in set(threading.enumerate()) - before if t.name == "ppll-stage-1" and t.is_alive()]
    assert len(stuck) == 1
    return stuck[0]


def test_a_closed_trainers_worker_never_steps_once_its_forward_returns(gated, tmp_path):
    compiled, gate = gated
    stuck = _interrupted_inside_a_forward(compiled, gate, tmp_path)
    before = _state(compiled)
    gate.opened.set()
    stuck.join(10)
    assert not stuck.is_alive()
    assert _same(_state(compiled), before)  # no backward, no optimizer step: parameters and gradients as they were


def test_a_new_trainer_refuses_while_the_old_worker_runs_and_is_accepted_once_it_ended(gated, tmp_path):
    compiled, gate = gated
    stuck = _interrupted_inside_a_forward(compiled, gate, tmp_path)
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
        trainer.step(X, Y)


@pytest.mark.slow
def test_a_new_trainer_waits_for_the_old_worker_and_its_loaded_checkpoint_stays(gated, tmp_path):
    """The issue's sequence: Ctrl-C inside a forward, close, a new trainer, load; then the old worker's forward
    returns. The new trainer is only built once that worker has ended, and the loaded parameters stay."""
    compiled, gate = gated
    stuck = _interrupted_inside_a_forward(compiled, gate, tmp_path)
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
    loaded = _state(compiled)
    time.sleep(0.3)
    assert _same(_state(compiled), loaded)
    trainer.close()


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
                trainer.step(X, Y)
            trainer.finish()
        messages.add(str(e.value).splitlines()[0])
        trainer.close()
        del trainer, e
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert messages == {"stage 1 failed at batch 0: RuntimeError: boom at call 0"}


def test_a_closed_threads_trainer_refuses_to_step_and_still_evaluates():
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Chain(3), example_inputs=(torch.randn(4, 8),), policy="dgl",
                                    split_points=["blocks.0", "blocks.1"])
    trainer = compiled.trainer(optimizer=sgd, runtime="threads")
    trainer.step(X, Y)
    trainer.close()
    steps = dict(trainer.steps)
    with pytest.raises(PPLLError) as e:
        trainer.step(X, Y)
    assert str(e.value) == ("this trainer was closed (close(), or the end of its with block): its stages no longer "
                            "train; build a new trainer (and load a checkpoint) to go on training")
    assert trainer.steps == steps == {0: 1, 1: 1, 2: 1}
    trainer.close()  # again: nothing left to release
    assert trainer.evaluate([(X, Y)])["samples"] == 4

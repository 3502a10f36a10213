"""What a closed, interrupted or failed trainer leaves behind: a worker still inside a stage's forward never steps
afterwards, a new trainer of the same pipeline waits for it (or refuses), and failed trainers are freed."""

import pytest
import torch

import ppll_compile
from ppll_compile.errors import PPLLError
from tests.dist_worker import Chain
from tests.helpers import GATE_X, GATE_Y, sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def test_a_closed_threads_trainer_refuses_to_step_and_still_evaluates():
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Chain(3), example_inputs=(torch.randn(4, 8),), policy="dgl",
                                    split_points=["blocks.0", "blocks.1"])
    trainer = compiled.trainer(optimizer=sgd, runtime="threads")
    trainer.step(GATE_X, GATE_Y)
    trainer.close()
    steps = dict(trainer.steps)
    with pytest.raises(PPLLError) as e:
        trainer.step(GATE_X, GATE_Y)
    assert str(e.value) == ("this trainer was closed (close(), or the end of its with block): its stages no longer "
                            "train; build a new trainer (and load a checkpoint) to go on training")
    assert trainer.steps == steps == {0: 1, 1: 1, 2: 1}
    trainer.close()  # again: nothing left to release
    assert trainer.evaluate([(GATE_X, GATE_Y)])["samples"] == 4

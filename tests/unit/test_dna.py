"""The DNA baselines and the frozen teacher: ``dna`` (every block on each batch) and ``dna-per-block`` (DNA's
published schedule, block after block over every epoch) held to blockwise distillation by hand; every runtime
keeps the teacher in eval mode."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from ppll_compile.errors import PPLLError
from tests.helpers import (
    CONV_X,
    DNA_EPOCHS,
    compiled_conv_pair,
    conv_pair_data,
    dna_assert_equal,
    dna_by_hand,
    dna_fit,
    Loader,
    sgd,
)
from tests.models import conv_student, conv_teacher


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the DNA schedules ---------------------------------------------------------------------------------

def test_per_block_schedule_reads_the_data_per_block_and_equals_dna_and_the_hand_loop():
    data = conv_pair_data()
    results = {}
    for runtime in ("dna", "dna-per-block"):
        c = compiled_conv_pair()
        start = {k: v.clone() for k, v in c.model.state_dict().items()}
        order: list[int] = []
        for k, block in enumerate(c.student_blocks):
            block.register_forward_pre_hook(lambda *_, k=k: order.append(k))
        loader = Loader(data)
        trainer, history = dna_fit(runtime, c, loader)
        results[runtime] = ([p.detach().clone() for p in c.model.parameters()], history, loader.passes, order,
                            trainer.batches, trainer.steps)
    torch.manual_seed(0)
    teacher, student = conv_teacher(), conv_student()
    student.load_state_dict(start)
    reference = dna_by_hand(c, teacher, student, data, DNA_EPOCHS)
    blocks, batches = 4, len(data) * DNA_EPOCHS
    for runtime, (params, history, passes, order, count, steps) in results.items():
        dna_assert_equal(params, reference)
        assert count == batches and steps == {0: batches, 1: batches}
        assert [h["samples"] for h in history] == [21, 21]
    assert results["dna"][2] == DNA_EPOCHS and results["dna"][3] == list(range(blocks)) * batches
    # DNA as published: the loader read again for every block and epoch, block 0 over every epoch first
    assert results["dna-per-block"][2] == blocks * DNA_EPOCHS
    assert results["dna-per-block"][3] == [k for k in range(blocks) for _ in range(batches)]
    for ours, theirs in zip(results["dna-per-block"][1], results["dna"][1]):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)


def _dropout_student() -> nn.Sequential:
    """conv_student with dropout in every block and BatchNorm in the first (blocks 0 and 1 form stage 0 with split
    "8", 2 and 3 stage 1)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(0.3),
        nn.Conv2d(8, 12, 1), nn.ReLU(), nn.Dropout(0.3), nn.Conv2d(12, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Dropout2d(0.3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(32, 10))


def test_per_block_schedule_continues_each_stages_random_stream_with_dropout_in_every_block():
    # a stage's blocks share one stream per batch: block 1 must draw where block 0 stopped (block 0 replayed,
    # its BatchNorm statistics untouched by the replay)
    data = conv_pair_data(seed=2)
    states = {}
    for runtime in ("sequential", "dna-per-block"):
        torch.manual_seed(0)
        teacher = conv_teacher()
        c = compiled_conv_pair(teacher, _dropout_student(), split="8")
        assert [s.blocks for s in c.plan.stages] == [(0, 1), (2, 3)]
        dna_fit(runtime, c, Loader(data))
        states[runtime] = {k: v.clone() for k, v in c.model.state_dict().items()}
    assert states["dna-per-block"].keys() == states["sequential"].keys()
    dna_assert_equal(list(states["dna-per-block"].values()), list(states["sequential"].values()))


def test_per_block_schedule_refuses_step_and_a_loader_that_changes_length():
    c = compiled_conv_pair()
    with c.trainer(optimizer=sgd, runtime="dna-per-block") as trainer:
        with pytest.raises(PPLLError, match=re.escape(
                'runtime="dna-per-block" trains each block over all the epochs before the next, so it needs the '
                'whole data at once: call trainer.fit(loader, epochs) instead of step(), or use runtime="dna" '
                '(every block on each batch in turn, the same parameters)')):
            trainer.step(CONV_X)

    class Shrinking(Loader):
        def __iter__(self) -> Any:
            self.passes += 1
            return iter(self.items if self.passes == 1 else self.items[:-1])

    with c.trainer(optimizer=sgd, runtime="dna-per-block") as trainer:
        with pytest.raises(PPLLError, match=re.escape(
                'runtime="dna-per-block" reads the loader again for every block and epoch; in epoch 1 it gave 2 '
                'batches to block 1 but 3 to block 0. Use a loader that yields the same batches on every pass (a list '
                'or a DataLoader, not a generator), or runtime="dna" (every block on each batch in turn)')):
            trainer.fit(Shrinking(conv_pair_data()), epochs=1, progress=False)

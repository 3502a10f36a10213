"""The DNA baselines and the frozen teacher: ``dna`` (every block on each batch) and ``dna-per-block`` (DNA's
published schedule, block after block over every epoch) held to blockwise distillation by hand; every runtime
keeps the teacher in eval mode."""

# The 2-process test runs this file as its worker: ``python tests/test_dna.py K PORT TIMEOUT OUT`` forks K ranks
# (torch imported once) that train the BatchNorm/Dropout teacher's student under ``dna-per-block`` and then under
# ``distributed``, and save what they saw.

from __future__ import annotations

import os
import re
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))

import ppll_compile  # noqa: E402
from ppll_compile.errors import PPLLError  # noqa: E402
from ppll_compile.pipebd.policy import distill_loss, load_distill_policy  # noqa: E402
from tests.helpers import run_gloo_workers, sgd  # noqa: E402
from tests.models import conv_student, conv_teacher  # noqa: E402

X = torch.randn(8, 3, 16, 16)
EPOCHS = 2


class Loader:
    """(inputs, target) pairs, like a DataLoader of a fixed dataset; counts the passes over it."""

    def __init__(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.items = items
        self.passes = 0

    def __iter__(self) -> Any:
        self.passes += 1
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def _data(sizes: tuple[int, ...] = (8, 8, 5), seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 16, 16, generator=g), torch.zeros(n, dtype=torch.long)) for n in sizes]


def bn_teacher() -> nn.Sequential:
    """conv_teacher's shapes with BatchNorm (running statistics far from their defaults) and Dropout in its blocks:
    in train mode it would give other targets on every call. Its blocks end after layers 5, 10, 15 (inclusive)."""
    torch.manual_seed(0)
    teacher = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(), nn.Conv2d(8, 24, 1), nn.ReLU(), nn.Conv2d(24, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
        nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Dropout2d(0.5),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5),
        nn.Linear(32, 10))
    with torch.no_grad():
        for m in teacher.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return teacher


def _compiled(teacher: nn.Module | None = None, student: nn.Module | None = None, split: str = "5") -> Any:
    """The pair compiled in 2 stages ending at student layer ``split`` (conv_teacher and conv_student by default)."""
    torch.manual_seed(0)
    teacher = conv_teacher() if teacher is None else teacher
    student = conv_student() if student is None else student
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.compile(student, teacher=teacher, example_inputs=(X,), split_points=[split],
                                    replicas=(1, 1))


def _slices(model: nn.Sequential, ends: list[str]) -> list[nn.Sequential]:
    cut = [int(e) + 1 for e in ends[:-1]]
    return [model[a:b] for a, b in zip([0, *cut], [*cut, len(model)])]


def _by_hand(compiled: Any, teacher: nn.Sequential, student: nn.Sequential, data: list, epochs: int) -> list:
    """DNA as published, written out: block after block, each over every epoch, the teacher in eval mode run from
    the input; the student's parameters after. ``student`` starts as the compiled one did."""
    plan = compiled.plan
    teacher.eval()
    t_blocks = _slices(teacher, [b.teacher_module for b in plan.blocks])
    s_blocks = _slices(student, [b.student_module for b in plan.blocks])
    rules = load_distill_policy(plan.policy)
    for k, block in enumerate(s_blocks):
        opt = sgd(list(block.parameters()))
        loss_fn = distill_loss(rules.last if k == len(s_blocks) - 1 else rules.loss)
        for _ in range(epochs):
            for x, _ in data:
                with torch.no_grad():
                    for tb in t_blocks[:k]:
                        x = tb(x)
                    y = t_blocks[k](x)
                loss = loss_fn(block(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return [p.detach().clone() for p in student.parameters()]


def _fit(runtime: str, compiled: Any, loader: Any, epochs: int = EPOCHS) -> tuple[Any, list[dict[str, Any]]]:
    with compiled.trainer(optimizer=sgd, runtime=runtime) as trainer:
        history = trainer.fit(loader, epochs=epochs, progress=False)
    return trainer, history


def _assert_equal(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the DNA schedules ---------------------------------------------------------------------------------

def test_per_block_schedule_reads_the_data_per_block_and_equals_dna_and_the_hand_loop():
    data = _data()
    results = {}
    for runtime in ("dna", "dna-per-block"):
        c = _compiled()
        start = {k: v.clone() for k, v in c.model.state_dict().items()}
        order: list[int] = []
        for k, block in enumerate(c.student_blocks):
            block.register_forward_pre_hook(lambda *_, k=k: order.append(k))
        loader = Loader(data)
        trainer, history = _fit(runtime, c, loader)
        results[runtime] = ([p.detach().clone() for p in c.model.parameters()], history, loader.passes, order,
                            trainer.batches, trainer.steps)
    torch.manual_seed(0)
    teacher, student = conv_teacher(), conv_student()
    student.load_state_dict(start)
    reference = _by_hand(c, teacher, student, data, EPOCHS)
    blocks, batches = 4, len(data) * EPOCHS
    for runtime, (params, history, passes, order, count, steps) in results.items():
        _assert_equal(params, reference)
        assert count == batches and steps == {0: batches, 1: batches}
        assert [h["samples"] for h in history] == [21, 21]
    assert results["dna"][2] == EPOCHS and results["dna"][3] == list(range(blocks)) * batches
    # DNA as published: the loader read again for every block and epoch, block 0 over every epoch first
    assert results["dna-per-block"][2] == blocks * EPOCHS
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
    data = _data(seed=2)
    states = {}
    for runtime in ("sequential", "dna-per-block"):
        torch.manual_seed(0)
        teacher = conv_teacher()
        c = _compiled(teacher, _dropout_student(), split="8")
        assert [s.blocks for s in c.plan.stages] == [(0, 1), (2, 3)]
        _fit(runtime, c, Loader(data))
        states[runtime] = {k: v.clone() for k, v in c.model.state_dict().items()}
    assert states["dna-per-block"].keys() == states["sequential"].keys()
    _assert_equal(list(states["dna-per-block"].values()), list(states["sequential"].values()))


def test_per_block_schedule_refuses_step_and_a_loader_that_changes_length():
    c = _compiled()
    with c.trainer(optimizer=sgd, runtime="dna-per-block") as trainer:
        with pytest.raises(PPLLError, match=re.escape(
                'runtime="dna-per-block" trains each block over all the epochs before the next, so it needs the '
                'whole data at once: call trainer.fit(loader, epochs) instead of step(), or use runtime="dna" '
                '(every block on each batch in turn, the same parameters)')):
            trainer.step(X)

    class Shrinking(Loader):
        def __iter__(self) -> Any:
            self.passes += 1
            return iter(self.items if self.passes == 1 else self.items[:-1])

    with c.trainer(optimizer=sgd, runtime="dna-per-block") as trainer:
        with pytest.raises(PPLLError, match=re.escape(
                'runtime="dna-per-block" reads the loader again for every block and epoch; in epoch 1 it gave 2 '
                'batches to block 1 but 3 to block 0. Use a loader that yields the same batches on every pass (a list '
                'or a DataLoader, not a generator), or runtime="dna" (every block on each batch in turn)')):
            trainer.fit(Shrinking(_data()), epochs=1, progress=False)


# ---- the teacher stays in eval mode --------------------------------------------------------------------

def _teacher_state(teacher: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in teacher.state_dict().items()}


@pytest.mark.parametrize("runtime", ["sequential", "threads", "dna", "dna-per-block"])
def test_the_teacher_stays_in_eval_mode_under_every_runtime(runtime):
    # BatchNorm in train mode would normalise by batch statistics and update its running ones; dropout would make
    # the targets random: either way the student would not match the hand loop with the teacher in eval mode
    data = _data(seed=4)
    teacher = bn_teacher()
    before = _teacher_state(teacher)
    c = _compiled(teacher, conv_student())
    assert [b.teacher_module for b in c.plan.blocks] == ["5", "10", "15", "19"]
    start = {k: v.clone() for k, v in c.model.state_dict().items()}
    trainer, _ = _fit(runtime, c, Loader(data))
    after = _teacher_state(teacher)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert not any(m.training for block in c.teacher_blocks for m in block.modules())
    assert not any(m.training for m in teacher.modules())
    student = conv_student()
    student.load_state_dict(start)
    _assert_equal([p.detach().clone() for p in c.model.parameters()], _by_hand(c, bn_teacher(), student, data, EPOCHS))


# ---- data-parallel on 2 processes ----------------------------------------------------------------------

def _rank_main(out: Path) -> None:
    """One rank: the bn_teacher pair under ``dna-per-block`` (data-parallel), then under ``distributed`` (a stage
    per rank); the process group is this function's, so both trainers share it."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    record: dict[str, Any] = {}
    for runtime in ("dna-per-block", "distributed"):
        c = _compiled(bn_teacher(), conv_student())
        loader = Loader(_data(seed=4))
        with c.trainer(optimizer=sgd, runtime=runtime, timeout=60) as trainer:
            trainer.fit(loader, epochs=EPOCHS, progress=False)
            stages = list(trainer.stages)
        record[runtime] = {"stages": stages, "student": {k: v.clone() for k, v in c.model.state_dict().items()},
                           "teacher": _teacher_state(c.teacher), "passes": loader.passes,
                           "teacher_training": any(m.training for b in c.teacher_blocks for m in b.modules())}
    torch.save(record, out / f"rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_dna_per_block_and_distributed_on_two_processes_equal_the_hand_loop_teacher_in_eval(tmp_path):
    run_gloo_workers(Path(__file__).resolve(), 2, tmp_path, timeout=90)
    c = _compiled(bn_teacher(), conv_student())
    student = conv_student()
    student.load_state_dict(c.model.state_dict())
    _by_hand(c, bn_teacher(), student, _data(seed=4), EPOCHS)
    ref = student.state_dict()
    stage_of = lambda name: int(int(name.split(".")[0]) > 5)  # noqa: E731 - stage 0 ends at student layer 5
    teacher = _teacher_state(bn_teacher())
    for rank in range(2):
        record = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        for runtime, stages in (("dna-per-block", [0, 1]), ("distributed", [rank])):
            rec = record[runtime]
            assert rec["stages"] == stages and not rec["teacher_training"]
            for name, value in ref.items():
                if stage_of(name) in stages:
                    torch.testing.assert_close(rec["student"][name], value, msg=lambda m: f"{runtime} {name}: {m}")
            for name, value in teacher.items():
                assert torch.equal(rec["teacher"][name], value), (runtime, name)
        assert record["dna-per-block"]["passes"] == 4 * EPOCHS  # every process reads the data once per block


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from dist_worker import launch
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]),
           body=lambda argv: _rank_main(Path(argv[0])))

"""The DNA baselines and the frozen teacher: ``dna`` (every block on each batch) and ``dna-per-block`` (DNA's
published schedule, block after block over every epoch) held to blockwise distillation by hand; every runtime
keeps the teacher in eval mode."""

# The 2-process test runs this file as its worker: ``python tests/integration/test_dna_runs.py K PORT TIMEOUT OUT``
# forks K ranks (torch imported once) that train the BatchNorm/Dropout teacher's student under ``dna-per-block`` and
# then under ``distributed``, and save what they saw.

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))

from tests.helpers import (
    DNA_EPOCHS,
    bn_teacher,
    compiled_conv_pair,
    conv_pair_data,
    dna_assert_equal,
    dna_by_hand,
    dna_fit,
    Loader,
    run_gloo_workers,
    sgd,
    state_copy,
)  # noqa: E402
from tests.models import conv_student  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the teacher stays in eval mode --------------------------------------------------------------------


# ---- data-parallel on 2 processes ----------------------------------------------------------------------

def _rank_main(out: Path) -> None:
    """One rank: the bn_teacher pair under ``dna-per-block`` (data-parallel), then under ``distributed`` (a stage
    per rank); the process group is this function's, so both trainers share it."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    record: dict[str, Any] = {}
    for runtime in ("dna-per-block", "distributed"):
        c = compiled_conv_pair(bn_teacher(), conv_student())
        loader = Loader(conv_pair_data(seed=4))
        with c.trainer(optimizer=sgd, runtime=runtime, timeout=60) as trainer:
            trainer.fit(loader, epochs=DNA_EPOCHS, progress=False)
            stages = list(trainer.stages)
        record[runtime] = {"stages": stages, "student": {k: v.clone() for k, v in c.model.state_dict().items()},
                           "teacher": state_copy(c.teacher), "passes": loader.passes,
                           "teacher_training": any(m.training for b in c.teacher_blocks for m in b.modules())}
    torch.save(record, out / f"rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_dna_per_block_and_distributed_on_two_processes_equal_the_hand_loop_teacher_in_eval(tmp_path):
    run_gloo_workers(Path(__file__).resolve(), 2, tmp_path, timeout=90)
    c = compiled_conv_pair(bn_teacher(), conv_student())
    student = conv_student()
    student.load_state_dict(c.model.state_dict())
    dna_by_hand(c, bn_teacher(), student, conv_pair_data(seed=4), DNA_EPOCHS)
    ref = student.state_dict()
    stage_of = lambda name: int(int(name.split(".")[0]) > 5)  # noqa: E731 - stage 0 ends at student layer 5
    teacher = state_copy(bn_teacher())
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
        assert record["dna-per-block"]["passes"] == 4 * DNA_EPOCHS  # every process reads the data once per block


@pytest.mark.parametrize("runtime", ["sequential", "threads", "dna", "dna-per-block"])
def test_the_teacher_stays_in_eval_mode_under_every_runtime(runtime):
    # BatchNorm in train mode would normalise by batch statistics and update its running ones; dropout would make
    # the targets random: either way the student would not match the hand loop with the teacher in eval mode
    data = conv_pair_data(seed=4)
    teacher = bn_teacher()
    before = state_copy(teacher)
    c = compiled_conv_pair(teacher, conv_student())
    assert [b.teacher_module for b in c.plan.blocks] == ["5", "10", "15", "19"]
    start = {k: v.clone() for k, v in c.model.state_dict().items()}
    trainer, _ = dna_fit(runtime, c, Loader(data))
    after = state_copy(teacher)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert not any(m.training for block in c.teacher_blocks for m in block.modules())
    assert not any(m.training for m in teacher.modules())
    student = conv_student()
    student.load_state_dict(start)
    dna_assert_equal([p.detach().clone() for p in c.model.parameters()], dna_by_hand(c, bn_teacher(), student, data,
                                                                                     DNA_EPOCHS))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from dist_worker import launch
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]),
           body=lambda argv: _rank_main(Path(argv[0])))

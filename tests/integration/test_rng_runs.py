"""Training randomness per stage: every runtime trains the same computation with dropout on in every stage."""

# The distributed test runs this file as its worker: ``python tests/integration/test_rng_runs.py K PORT TIMEOUT OUT``
# forks K ranks (torch imported once) that train the pipeline of :func:`_pipeline` and save their stage states.

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))

from tests.helpers import (
    assert_tensors_equal,
    compile_dropout_chain,
    dropout_chain,
    dropout_chain_data,
    dropout_chain_sgd,
    run_gloo_workers,
)  # noqa: E402
import time
import warnings
from torch import nn
import ppll_compile


pytestmark = pytest.mark.usefixtures("one_thread_quietly")  # the same reduction order in every runtime


# ---- distributed: one process per stage on gloo ---------------------------------------------------------

def _distill_params(runtime: str, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    from tests.models import conv_teacher
    torch.manual_seed(0)
    teacher = conv_teacher()
    student = nn.Sequential(  # conv_student with dropout in every block
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout2d(0.3),
        nn.Conv2d(8, 12, 1), nn.ReLU(), nn.Dropout(0.3), nn.Conv2d(12, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Dropout2d(0.3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(32, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(student, teacher=teacher, example_inputs=(torch.randn(8, 3, 16, 16),),
                                        split_points=["7"])
    # stage 1 waits before its first block: under threads, stage 0 draws for the next batch first
    slow = compiled.student_blocks[compiled.plan.stages[1].blocks[0]]
    forward = slow.forward
    slow.forward = lambda *v: (time.sleep(0.02), forward(*v))[1]
    with compiled.trainer(optimizer=dropout_chain_sgd, runtime=runtime) as trainer:
        for x in batches:
            trainer.step(x)
    return [p.detach().clone() for p in student.parameters()], [r.draws_random for r in trainer.runners]


@pytest.mark.slow
def test_distributed_equals_sequential_with_dropout_in_every_stage(tmp_path):
    timeout = 90
    run_gloo_workers(Path(__file__).resolve(), 3, tmp_path, timeout=timeout)
    ref_compiled = compile_dropout_chain(dropout_chain())
    with ref_compiled.trainer(optimizer=dropout_chain_sgd, runtime="sequential") as trainer:
        for x, y in dropout_chain_data():
            trainer.step(x, y)
    for rank in range(3):
        record = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        assert_tensors_equal(record["params"], [p.detach().clone() for p in ref_compiled.stage_parameters(rank)])
        assert record["draws_random"] is True


def _rank_main(out: Path) -> None:
    """One rank of the distributed test: train the pipeline on the test's batches, save its stage's parameters."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    compiled = compile_dropout_chain(dropout_chain())
    with compiled.trainer(optimizer=dropout_chain_sgd, runtime="distributed", timeout=60) as trainer:
        for x, y in dropout_chain_data():  # rank 0 feeds the batches; every other rank receives one per step
            trainer.step(x, y)
        trainer.finish()
    (stage,) = trainer.stages
    torch.save({"params": [p.detach().clone() for p in compiled.stage_parameters(stage)],
                "draws_random": trainer.runners[0].draws_random}, out / f"rank-{rank}.pt")


def test_pipebd_threads_and_dna_equal_sequential_with_dropout_in_every_block():
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 3, 16, 16, generator=g) for _ in range(4)]
    ref, draws = _distill_params("sequential", batches)
    for runtime in ("threads", "dna"):
        ours, _ = _distill_params(runtime, batches)
        assert_tensors_equal(ours, ref)
    assert draws == [True, True]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from dist_worker import launch
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]),
           body=lambda argv: _rank_main(Path(argv[0])))

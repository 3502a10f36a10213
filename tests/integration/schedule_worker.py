"""Worker of the distributed golden-schedule test: ``torchrun --nproc-per-node=K tests/integration/schedule_worker.py
OUT CASE [CASE ...]``.

For each case of ``tests/grids.py`` (a FIFO case of K stages), every rank compiles the golden
tests' MLP for K stages, trains it on their batches under ``runtime="distributed"`` with the case's queue depth and
barrier, traced, and gathers the timeline; rank 0 saves it as ``OUT/<case>.json`` (:meth:`Timeline.save`).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: ``tests.…`` imports

from tests.grids import CASES, MLP, mlp_batches
from tests.helpers import compile_quietly


def main(out: Path, names: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    stages = int(os.environ["WORLD_SIZE"])
    for name in names:
        case = CASES[name]
        assert case.stages == stages and case.queue == "fifo", (name, stages)
        torch.manual_seed(0)
        compiled = compile_quietly(MLP(), torch.randn(4, 8), gpus=stages)
        with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.01), runtime="distributed", trace=True,
                              queue=case.queue, queue_depth=case.depth, decoupled=case.decoupled,
                              timeout=60) as trainer:
            for x, y in mlp_batches():
                trainer.step(x, y)
            trainer.finish()
            timeline = trainer.timeline()  # every rank gathers
        if os.environ["RANK"] == "0":
            timeline.save(out / f"{name}.json")
        print(f"rank {os.environ['RANK']}: {name} done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

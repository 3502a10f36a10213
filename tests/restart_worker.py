"""One process of a ``torchrun --max-restarts`` job whose rank ``KILL_RANK`` SIGKILLs itself once:
``torchrun --standalone --nproc-per-node=3 --max-restarts=1 tests/restart_worker.py KILL_RANK KILL_AT OUT``.

Every incarnation trains the 3-stage pipeline of :func:`dist_worker.fifo_pipeline` under ``distributed`` with
``fit(resume_loader(), epochs=2, checkpoint=OUT/ckpt, every=EVERY)``. In the first incarnation only
(``TORCHELASTIC_RESTART_COUNT`` 0), rank ``KILL_RANK`` SIGKILLs itself as its stage starts the forward of batch
``KILL_AT`` (counted from 0), after writing the time to ``OUT/killed.json``. torchrun then restarts every process;
the new ones resume from the latest complete checkpoint. Each rank of a restarted incarnation writes to
``OUT/resumed-RANK.json`` the time its stage finished its first forward and the batch count of the checkpoint it
resumed from; rank 0 saves the whole model's final ``model_state_dict()`` to ``OUT/final.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

from dist_worker import fifo_pipeline  # noqa: E402

from tests.helpers import resume_loader  # noqa: E402

__all__ = ["EVERY", "checkpoint_batches", "main"]

warnings.simplefilter("ignore")  # the CPU fallback note of compile()

EVERY = 2
"""Batches between two checkpoints of an epoch."""


def checkpoint_batches(root: Path) -> int:
    """The batch count of the checkpoint ``root/latest`` names (0 when there is none)."""
    try:
        name = (root / "latest").read_text().strip()
        return json.loads((root / name / "manifest.json").read_text())["trainer"]["batches"]
    except FileNotFoundError:
        return 0


def _watch(module: Any, rank: int, kill_at: int | None, out: Path, resumed_from: int) -> None:
    """Kill this process at the forward of batch ``kill_at``; in a restarted incarnation (``kill_at`` None),
    write when the first forward finished."""
    seen = [0]

    def before(_module: Any, _args: Any) -> None:
        if kill_at is not None and seen[0] == kill_at:
            (out / "killed.json").write_text(json.dumps({"time": time.time(), "rank": rank, "batch": kill_at}))
            os.kill(os.getpid(), signal.SIGKILL)
        seen[0] += 1

    def after(_module: Any, _args: Any, _output: Any) -> None:
        if kill_at is None and seen[0] == 1:
            (out / f"resumed-{rank}.json").write_text(json.dumps({"time": time.time(), "from": resumed_from}))

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def main(argv: list[str]) -> None:
    """``argv`` = [KILL_RANK, KILL_AT, OUT]."""
    torch.set_num_threads(1)
    kill_rank, kill_at, out = int(argv[0]), int(argv[1]), Path(argv[2])
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    root = out / "ckpt"
    with fifo_pipeline(3, "distributed") as trainer:
        stage = trainer.stages[0]
        _watch(trainer.lowered.modules[stage], rank, kill_at if attempt == 0 and rank == kill_rank else None, out,
               checkpoint_batches(root) if attempt > 0 else 0)
        trainer.fit(resume_loader(), epochs=2, checkpoint=root, every=EVERY, progress=False)
        state = trainer.model_state_dict()
        if rank == 0:
            torch.save({"state": state, "attempt": attempt, "batches": trainer.batches}, out / "final.pt")


if __name__ == "__main__":
    main(sys.argv[1:])

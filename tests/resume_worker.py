"""Workers of the distributed resume test: ``python tests/resume_worker.py K PORT TIMEOUT OUT``.

Three runs of ``K`` gloo processes, one after another, each ``fit(resume_loader(), epochs=2, checkpoint=...,
every=EVERY)`` on the 2-stage pipeline of :func:`dist_worker.fifo_pipeline`: an uninterrupted one (checkpoints in
``OUT/ref``), one whose rank 0 SIGKILLs itself when its loader draws batch :data:`KILL_AT` (checkpoints in
``OUT/run``), and the same call again, which resumes from ``OUT/run``. Every rank of the first and last run writes
its stages' tensors to ``OUT/{run}-{rank}.pt``. Prints ``{"killed": codes}`` of the second run, then
``{"codes": ...}``: per rank 0 when the first and last run both exited 0.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

from dist_worker import fifo_pipeline, launch, stage_states  # noqa: E402

from tests.helpers import RESUME_EPOCH, free_port, resume_loader  # noqa: E402

__all__ = ["EVERY", "KILL_AT", "main"]

warnings.simplefilter("ignore")  # the CPU fallback note of compile()

EVERY = 2
"""Batches between two checkpoints of an epoch."""
KILL_AT = RESUME_EPOCH + 3
"""The batch (counted from 0) whose drawing kills rank 0: in the second epoch, one batch after a checkpoint."""


def main(argv: list[str]) -> None:
    """One rank of one run: ``argv`` = [run, OUT] with run ``ref``, ``kill`` or ``resume``."""
    torch.set_num_threads(1)
    run, out = argv[0], Path(argv[1])
    rank = int(os.environ["RANK"])
    kill = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if run == "kill" else None
    loader = resume_loader(KILL_AT if kill is not None else None, kill)
    with fifo_pipeline(2, "distributed") as trainer:
        trainer.fit(loader, epochs=2, checkpoint=out / ("ref" if run == "ref" else "run"), every=EVERY,
                    progress=False)
        torch.save({"states": stage_states(trainer), "batches": trainer.batches}, out / f"{run}-{rank}.pt")


def _run(k: int, run: str, out: str, timeout: float) -> list[int | None]:
    """The exit codes of ``k`` workers of ``run``."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        launch(k, free_port(), [run, out], timeout, body=main)
    return json.loads(printed.getvalue().strip().splitlines()[-1])["codes"]


if __name__ == "__main__":
    # python tests/resume_worker.py K PORT TIMEOUT OUT
    k, each, out = int(sys.argv[1]), float(sys.argv[3]) / 3, sys.argv[4]
    ref = _run(k, "ref", out, each)
    killed = _run(k, "kill", out, each)
    print(json.dumps({"killed": killed}), flush=True)
    resumed = _run(k, "resume", out, each)
    print(json.dumps({"codes": [a or b or 0 for a, b in zip(ref, resumed)]}), flush=True)

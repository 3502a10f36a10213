"""The distributed runtime's faults: every rank raises the failing stage's StageError within seconds of the failure."""

# Three ranks are forked by tests/dist_worker.py without torchrun. The failing rank catches its error and waits in
# its handler, neither closing nor exiting, until every other rank has reported; the process group's timeout is
# 120 s, far beyond the launcher's limit, so a rank that waits for it blindly fails the test instead of passing late.

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.slow  # every test forks worker processes

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_worker.py"
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")} | {"OMP_NUM_THREADS": "1"}
WITHIN = 10.0
"""Seconds from the failure to each rank's StageError (the watching thread looks at the store every 0.25 s)."""


def _run(scenario: str, out: Path, k: int = 3, limit: float = 40) -> list[dict[str, Any]]:
    """Fork ``k`` ranks of ``scenario`` (killed after ``limit`` seconds); what each rank wrote."""
    cmd = [sys.executable, str(WORKER), str(k), str(free_port()), str(limit), scenario, str(out)]
    proc = subprocess.Popen(cmd, cwd=HERE.parent, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        text = proc.communicate(timeout=limit + 20)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the launcher still ran after {limit + 20} s (killed):\n{proc.communicate()[0][-3000:]}")
    codes = [json.loads(line)["codes"] for line in text.splitlines() if line.startswith('{"codes"')]
    assert codes == [[0] * k], f"exit codes {codes} (null: killed after {limit} s, still waiting):\n{text[-3000:]}"
    return [json.loads((out / f"error-{r}.json").read_text()) for r in range(k)]


@pytest.mark.parametrize("scenario, stage", [("stay", 2), ("stay-replica", 1)], ids=["last-stage", "replica"])
def test_every_rank_raises_within_seconds_while_the_failed_process_lives(tmp_path, scenario, stage):
    """``stay``: the last of 3 stages fails; ``stay-replica``: one of stage 1's two replicas (its peer waits in DDP)."""
    records = _run(scenario, tmp_path)
    failing = records[-1]
    assert failing["fired"] is not None
    assert failing["others_reported"], "the other ranks reported only after the failed process had gone"
    for rank, rec in enumerate(records):
        assert rec["type"] == "StageError", (rank, rec["text"][:500])
        assert rec["text"].startswith(f"stage {stage} failed at batch 3: RuntimeError: boom at call 3"), \
            (rank, rec["text"][:500])
        assert ("reported by stage" in rec["text"]) == (rank != 2), (rank, rec["text"][:500])
        late = rec["raised"] - failing["fired"]
        assert late < WITHIN, f"rank {rank} raised {late:.1f} s after the failure"
        assert rec["closed"] - rec["closing"] < 15, f"rank {rank}: close() took {rec['closed'] - rec['closing']:.1f} s"
        assert rec["initialized"] is False, f"rank {rank}: close() left the process group initialised"

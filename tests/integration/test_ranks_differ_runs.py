"""Ranks started with different models: every rank raises one error that names the ranks and the first difference,
before any of them trains (no shape error, no lost connection)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ppll_compile.runtime.distributed.group import SAME_MODEL
from tests.helpers import free_port

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DIFFER = "PPLLError: the ranks were started with different models (rank 1 differs from rank 0), first in "
FIRST = {
    "relu": "stage 1: rank 0 has 'node _4 = 4: Linear(in_features=16, out_features=16, bias=True)(_3)' where rank 1 "
            "has 'node _4 = 4: ReLU()(_3)'",
    "width": "stage 0: rank 0 has 'node _0 = 0: Linear(in_features=8, out_features=16, bias=True)(input_1)' where "
             "rank 1 has 'node _0 = 0: Linear(in_features=8, out_features=32, bias=True)(input_1)'",
}


def _torchrun(tmp_path: Path, *cases: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Two ranks of ranks_differ_worker.py under torchrun (gloo, CPU); killed with their group after ``timeout``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(HERE / "ranks_differ_worker.py"), str(tmp_path), *cases]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun still running after {timeout} s (killed):\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_every_rank_says_the_ranks_differ_before_any_trains(tmp_path):
    """(a) rank 1's model has one more ReLU, which alone would train silently; (b) its hidden layers are twice as
    wide, which alone fails with a shape error on rank 1 and a lost connection on rank 0. Both ranks' stderr carry
    the same error for each, and nothing else is raised or trained."""
    run = _torchrun(tmp_path, "relu", "width")
    reports = [line for line in run.stderr.splitlines() if line.startswith("rank ")]
    assert run.returncode == 0, "\n".join(reports) + run.stderr[-3000:]
    assert sorted(reports) == sorted(f"rank {r}, {case}: {DIFFER}{FIRST[case]}; {SAME_MODEL}"
                                     for r in (0, 1) for case in ("relu", "width")), "\n".join(reports)
    assert "trained" not in run.stdout
    for raw in ("mat1 and mat2", "Connection reset", "Connection closed"):
        assert raw not in run.stderr, run.stderr[-3000:]


SHARED = {
    "relu": "PPLLError: the ranks were started with different models (rank 1 differs from rank 0), first in the traced "
            "model: rank 0 has 'node _4 = 4: Linear(in_features=16, out_features=16, bias=True)(_3)' where rank 1 has "
            "'node _4 = 4: ReLU()(_3)'",
    "short": "PPLLError: rank 1 could not lower rank 0's plan on its own model, so the ranks were started with "
             "different models: CutError: rank 0's plan: '_2' is neither a node nor a module of the traced model",
}


def test_sharing_the_plan_every_rank_says_the_ranks_differ_at_compile(tmp_path):
    """With rank 0's plan shared (the default under torchrun), compile() compares the traced models."""
    run = _torchrun(tmp_path, "shared-relu", "shared-short")
    reports = [line for line in run.stderr.splitlines() if line.startswith("rank ")]
    assert run.returncode == 0, "\n".join(reports) + run.stderr[-3000:]
    assert len(reports) == 4 and "trained" not in run.stdout, "\n".join(reports)
    for r in (0, 1):
        for case, start in SHARED.items():
            line = next(line for line in reports if line.startswith(f"rank {r}, shared-{case}: "))
            assert line.removeprefix(f"rank {r}, shared-{case}: ").startswith(start), line
            assert line.endswith(SAME_MODEL), line

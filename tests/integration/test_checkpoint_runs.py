"""Checkpoints: a kill at any moment leaves one that loads; a load either restores everything or changes nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests import ckpt_worker as w
from tests.helpers import free_port, sgd

WORKER = (Path(__file__).parents[1] / "ckpt_worker.py")
pytestmark = pytest.mark.usefixtures("one_thread_quietly")


# ---- kills --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_save_killed_at_any_moment_leaves_a_checkpoint_that_loads(tmp_path):
    """A trainer saving after every batch is SIGKILLed 12 times at random moments; after every kill a fresh
    process loads the newest checkpoint and finds exactly the state of a run that never stopped."""
    proc = subprocess.run([sys.executable, str(WORKER), "kill", str(tmp_path), "12", "1"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["verified"] == [0] * 12, proc.stderr[-3000:]
    assert report["mid_save"] >= 1  # some kills did land in the middle of a save
    assert report["batches"] == sorted(report["batches"]) and report["batches"][0] >= 1  # each run resumed
    # leftovers never pile up: each save removes those of the one killed before it
    assert report["most_temporary"] <= 2 and report["most_complete"] <= 3


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["killed", "corrupt"])
def test_distributed_saves_and_loads_agree_on_every_rank(tmp_path, scenario):
    """killed: rank 1 dies while writing its stage file, so the pointer never moves and the first checkpoint
    stays the newest. corrupt: rank 1's stage file is damaged, so both ranks refuse and neither changes."""
    proc = subprocess.run([sys.executable, str(WORKER), "dist", scenario, str(tmp_path), str(free_port())],
                          capture_output=True, text=True, timeout=200)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) if (tmp_path / f"rank-{r}.json").exists()
             else None for r in (0, 1)]
    if scenario == "killed":
        assert ranks[0] is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ranks[0]["error"].startswith("CheckpointError: could not write its stages: another process of the "
                                            "pipeline is gone (RuntimeError: "), ranks[0]
        assert ranks[0]["latest"] == ranks[0]["first"] == "ckpt/ckpt-000000"
        loaded = w.pipeline(seed=7).trainer(optimizer=sgd)
        assert loaded.load(tmp_path / "ckpt") == tmp_path / "ckpt" / "ckpt-000000" and loaded.batches == 1
    else:
        assert json.loads(proc.stdout.strip().splitlines()[-1])["codes"] == [0, 0], proc.stderr[-3000:]
        for r in ranks:
            assert r["unchanged"] and "stage-1.pt' has" in r["error"] and "another sha256" in r["error"]
        assert ranks[0]["error"].startswith("CheckpointError: the process of rank 1 could not read the checkpoint")
        assert ranks[0]["batches"] == 2

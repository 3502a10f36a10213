"""torchrun --max-restarts brings a killed pipeline back by itself: the restarted processes form a working process
group, resume from the latest complete checkpoint and end with the parameters of a run that never stopped."""

import json
import time
from pathlib import Path

import pytest
import torch

from tests.dist_worker import fifo_pipeline
from tests.helpers import resume_loader, run_torchrun

HERE = Path(__file__).parents[1]
pytestmark = pytest.mark.usefixtures("one_thread_quietly")  # the workers' one thread: the same sums
WORKER = HERE / "restart_worker.py"
EVERY = 2  # as restart_worker.EVERY
KILL_AT = 9  # in the second epoch (batches 6..11), one batch after the checkpoint at batch 8
TIMEOUT = 420  # two incarnations of 3 processes (start, compile, train) on a busy 2-core machine


def _reference(root: Path) -> dict[str, torch.Tensor]:
    """The whole model after the same fit, never stopped, under ``sequential`` (what ``distributed`` computes)."""
    with fifo_pipeline(3, "sequential") as trainer:
        trainer.fit(resume_loader(), epochs=2, checkpoint=root, every=EVERY, progress=False)
        return trainer.model_state_dict()


def run_restarting_job(kill_rank: int, out: Path, timeout: float = TIMEOUT) -> str:
    """``torchrun --standalone --nproc-per-node=3 --max-restarts=1`` of the worker; its output (exit status 0)."""
    return run_torchrun(["--standalone", "--nproc-per-node=3", "--max-restarts=1"], WORKER,
                        [str(kill_rank), str(KILL_AT), str(out)], timeout)


@pytest.mark.slow
@pytest.mark.parametrize("kill_rank", [1, 0, 2], ids=["middle", "first", "last"])
def test_a_rank_killed_under_torchrun_max_restarts_comes_back_to_the_parameters_of_a_run_that_never_stopped(
        tmp_path, kill_rank):
    start = time.time()
    text = run_restarting_job(kill_rank, tmp_path)
    assert (tmp_path / "killed.json").exists(), f"rank {kill_rank} was never killed:\n{text[-4000:]}"
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed["rank"] == kill_rank and killed["time"] > start
    resumed = [json.loads((tmp_path / f"resumed-{r}.json").read_text()) for r in range(3)]
    # every rank restarted, from the checkpoint saved at batch 8 (the one before the kill at batch 9)
    assert [r["from"] for r in resumed] == [8, 8, 8], text[-4000:]
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["attempt"] == 1 and final["batches"] == 12
    ref = _reference(tmp_path / "ref")
    assert list(final["state"]) == list(ref)
    for name, tensor in ref.items():
        assert torch.equal(final["state"][name], tensor), name
    print(f"kill of rank {kill_rank} -> next trained batch: {max(r['time'] for r in resumed) - killed['time']:.1f} s")

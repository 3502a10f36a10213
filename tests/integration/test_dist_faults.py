"""The distributed runtime's faults: every rank raises the failing stage's StageError within seconds of the failure,
and a frozen or hung stage is the one named (its neighbours' waits are followed to the stage that went silent)."""

# Three ranks are forked by tests/dist_worker.py without torchrun. The failing rank catches its error and waits in
# its handler, neither closing nor exiting, until every other rank has reported; the process group's timeout is
# 120 s, far beyond the launcher's limit, so a rank that waits for it blindly fails the test instead of passing late.

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ppll_compile.errors import StageError
from ppll_compile.plans.plan import TensorSpec
from ppll_compile.runtime.distributed.faults import BEAT_KEY, ERROR_KEY, Faults
from ppll_compile.runtime.distributed.wire import Wire
from tests.helpers import free_port, run_dist_scenario

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dist_worker as w  # noqa: E402

pytestmark = pytest.mark.slow  # every test forks worker processes

HERE = Path(__file__).resolve().parents[1]
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


# ---- a frozen or hung stage is the one named ---------------------------------------------------------------

@pytest.mark.parametrize("how", ["stop", "sleep"])
def test_a_frozen_last_stage_is_named_by_every_other_rank(tmp_path, how):
    """The last of 3 ranks freezes before its forward on batch 3 (SIGSTOP, or a sleep far past the 4 s timeout of
    the process group): rank 1 times out sending to it and its connections close, so rank 0 loses rank 1 at once;
    both must name stage 2, the silent one, not stage 1."""
    codes, text = run_dist_scenario("frozen", 3, tmp_path, 120, how)
    assert codes == [0, 0, -9], f"exit codes {codes} (-9: the frozen rank, killed by rank 0):\n{text[-3000:]}"
    for rank in (0, 1):
        rec = json.loads((tmp_path / f"frozen-{rank}.json").read_text())
        assert rec["type"] == "StageError", (rank, rec["text"][:500])
        assert rec["text"].startswith("stage 2 failed: lost contact with the process of stage 2 (rank 2)"), \
            (rank, rec["text"][:500])
        late = rec["raised"] - rec["frozen_at"]
        assert late < w.FROZEN_TIMEOUT + WITHIN, f"rank {rank} raised {late:.1f} s after the freeze"


STAGE_OF = {0: 0, 1: 1, 2: 2}


@pytest.fixture
def store(tmp_path):
    """A process group of this process alone; its store is the protocol's (other ranks' heartbeats are written
    into it by hand)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()


def _faults(rank: int) -> Faults:
    wire = Wire(stage=rank, planned=4, in_specs=(TensorSpec(name="h", shape=(4, 2), dtype="float32", bytes=32),),
                raw_spec=None, comm=torch.device("cpu"))
    return Faults(rank=rank, stage=rank, stage_of=STAGE_OF.__getitem__, receivers=[], wire=wire)


def _beat(store: Any, rank: int, n: int, on: int | None) -> None:
    store.set(f"{BEAT_KEY}{rank}", json.dumps({"n": n, "on": on}))


@contextlib.contextmanager
def _beating(store: Any, rank: int, on: int | None) -> Iterator[None]:
    """``rank`` beats (waiting on ``on``) every 50 ms while the block runs."""
    done = threading.Event()
    _beat(store, rank, 0, on)

    def run() -> None:
        n = 0
        while not done.wait(0.05):
            n += 1
            _beat(store, rank, n, on)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


LOST = RuntimeError("Connection closed by peer [127.0.0.1]:4242")


def test_the_waits_are_followed_past_a_live_peer_to_the_silent_stage(store):
    _beat(store, 2, 7, None)  # stage 2 stopped beating in its own work (frozen in its forward)
    with _beating(store, 1, 2), pytest.raises(StageError) as e:  # rank 1 lives, waiting to send to rank 2
        _faults(0).lost(LOST, 1, "sending to")
    message = ("lost contact with the process of stage 2 (rank 2): it went silent without reporting an error "
               "(killed, frozen, or hung in its own work past the process group's timeout); this rank was sending "
               "to rank 1, which waits on it (rank 0 (stage 0) -> rank 1 (stage 1) -> rank 2 (stage 2)); see its "
               "own output. RuntimeError: Connection closed by peer [127.0.0.1]:4242")
    assert str(e.value) == f"stage 2 failed: {message} (reported by stage 0 to stage 0)"
    assert json.loads(store.get(ERROR_KEY))["stage"] == 2 and store.get("ppll/taken/2") == b"1"


def test_a_peer_that_stopped_beating_is_named_though_it_was_waiting(store):
    _beat(store, 1, 3, 2)  # rank 1 waited on rank 2 when it went silent (killed or frozen itself)
    _beat(store, 2, 9, None)
    with pytest.raises(StageError, match=r"^stage 1 failed: lost contact with the process of stage 1 \(rank 1\) while "
                                         r"sending to it: it stopped without reporting an error"):
        _faults(0).lost(LOST, 1, "sending to")


def test_a_frozen_peer_that_waited_on_this_rank_is_named_at_once(store):
    _beat(store, 2, 5, 1)  # frozen while it waited for rank 1's next batch
    start = time.monotonic()
    with pytest.raises(StageError, match=r"^stage 2 failed: lost contact with the process of stage 2 \(rank 2\)"):
        _faults(1).lost(RuntimeError("Timed out waiting 4000ms for send operation to complete"), 2, "sending to")
    assert time.monotonic() - start < 1.0  # nothing to sample: the waits lead back here


def test_a_report_stored_while_sampling_is_the_one_raised(store):
    _beat(store, 2, 7, None)
    first = {"stage": 2, "batch": None, "by": 1, "rank": 1, "traceback": "", "message": "found by rank 1"}

    def later() -> None:
        time.sleep(0.3)
        store.compare_set(ERROR_KEY, "", json.dumps(first))

    threading.Thread(target=later, daemon=True).start()
    _beat(store, 1, 1, 2)  # rank 1 does not beat on: without the report, rank 1 would be named
    with pytest.raises(StageError) as e:
        _faults(0).lost(LOST, 1, "sending to")
    assert str(e.value) == "stage 2 failed: found by rank 1 (reported by stage 1 to stage 0)"

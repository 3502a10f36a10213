"""The distributed runtime's failure-report protocol in one process: a one-rank gloo group holds the store, and the
sends are recorded. Reports are published once and raised as the original stage's StageError, STOP carries the
report downstream once, a lost peer is named, and the watching thread aborts the groups on another rank's report."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ppll_compile.errors import StageError
from ppll_compile.plans.plan import TensorSpec
from ppll_compile.runtime.distributed import faults as faults_module
from ppll_compile.runtime.distributed.faults import ERROR_KEY, Faults, wait_quietly
from ppll_compile.runtime.distributed.wire import Wire

STAGES = {0: 0, 1: 1, 2: 1, 3: 2}  # rank -> stage: stage 1 has two replicas


class Sent:
    """A finished ``isend``: what was sent to whom."""

    def __init__(self, tensor: torch.Tensor, dst: int, log: list) -> None:
        log.append((dst, tensor.clone()))

    def wait(self) -> None:
        pass


@pytest.fixture
def group(tmp_path):
    """A process group of this process alone; its store is the protocol's."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()


@pytest.fixture
def sends(monkeypatch) -> list[tuple[int, torch.Tensor]]:
    log: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(dist, "isend", lambda tensor, dst: Sent(tensor, dst, log))
    return log


def _faults(rank: int = 1, receivers: tuple[int, ...] = (3,)) -> Faults:
    wire = Wire(stage=STAGES[rank], planned=4, in_specs=(TensorSpec(name="h", shape=(4, 2), dtype="float32", bytes=32),),
                raw_spec=None, comm=torch.device("cpu"))
    return Faults(rank=rank, stage=STAGES[rank], stage_of=STAGES.__getitem__, receivers=list(receivers), wire=wire)


def _stops(sends: list[tuple[int, torch.Tensor]]) -> list[tuple[int, dict[str, Any]]]:
    """The STOP messages among ``sends``: (receiver, report)."""
    out = []
    for (dst, header), (dst2, blob) in zip(sends[::2], sends[1::2]):
        assert dst == dst2 and header[0].item() == 4 and header[6].item() == blob.numel()
        out.append((dst, json.loads(bytes(blob.tolist()).decode())))
    return out


def _report(stage: int = 2, rank: int = 3, **more: Any) -> dict[str, Any]:
    return {"stage": stage, "batch": 6, "by": stage, "rank": rank, "message": "ValueError: bad input",
            "traceback": "Traceback ...", **more}


# ---- a stage that raises --------------------------------------------------------------------------------------

def test_a_raising_stage_publishes_its_report_stops_downstream_and_raises_its_stage_error(group, sends):
    faults = _faults(rank=1, receivers=(3,))
    assert faults.guard(4, lambda: "done") == "done" and sends == [] and not group.check([ERROR_KEY])

    def fails():
        raise ValueError("bad input")

    with pytest.raises(StageError) as e:
        faults.guard(4, fails)
    assert (e.value.stage, e.value.batch) == (1, 4) and faults.error is e.value
    assert str(e.value).startswith("stage 1 failed at batch 4: ValueError: bad input\n--- traceback of stage 1 ---\n")
    assert isinstance(e.value.__cause__, ValueError)
    stored = json.loads(group.get(ERROR_KEY))
    assert {k: v for k, v in stored.items() if k != "traceback"} == {
        "stage": 1, "batch": 4, "by": 1, "rank": 1, "message": "ValueError: bad input"}
    assert "raise ValueError" in stored["traceback"]
    assert _stops(sends) == [(3, stored)]  # the same report, to the one receiver
    assert group.get("ppll/taken/1") == b"1"


def test_the_first_report_stays_published(group):
    first, second = _faults(rank=1), _faults(rank=3)
    first.publish(_report(stage=1, rank=1))
    second.publish(_report(stage=2, rank=3))
    assert json.loads(group.get(ERROR_KEY)) == _report(stage=1, rank=1)
    assert second.read_report() == _report(stage=1, rank=1)


def test_a_failure_after_another_ranks_report_raises_that_report(group, sends):
    _faults(rank=3).publish(_report(stage=2, rank=3))
    faults = _faults(rank=1, receivers=(3,))

    def times_out():
        raise RuntimeError("allreduce timed out")

    with pytest.raises(StageError) as e:
        faults.guard(5, times_out)
    assert (e.value.stage, e.value.batch) == (2, 6)
    assert str(e.value) == ("stage 2 failed at batch 6: ValueError: bad input (reported by stage 2 to stage 1)\n"
                            "--- traceback of stage 2 ---\nTraceback ...")
    assert json.loads(group.get(ERROR_KEY)) == _report(stage=2, rank=3)  # not replaced by this rank's
    assert _stops(sends) == [(3, _report(stage=2, rank=3))]


# ---- a report from elsewhere ------------------------------------------------------------------------------------

def test_a_remote_report_is_raised_for_its_stage_and_passed_on_once(group, sends):
    faults = _faults(rank=1, receivers=(3,))
    report = _report(stage=0, rank=0, by=0)
    for _ in range(2):
        with pytest.raises(StageError) as e:
            faults.remote(report)
        assert str(e.value).splitlines()[0] == ("stage 0 failed at batch 6: ValueError: bad input (reported by stage 0 "
                                                "to stage 1)")
    assert _stops(sends) == [(3, report)]  # STOP went on once
    assert group.get("ppll/taken/1") == b"1"


def test_check_store_raises_only_once_a_report_is_there(group, sends):
    faults = _faults(rank=3, receivers=())
    faults.check_store()
    assert faults.read_report() is None and faults.error is None
    group.set(ERROR_KEY, json.dumps(_report(stage=1, rank=2)))
    with pytest.raises(StageError, match=r"^stage 1 failed at batch 6: ValueError: bad input \(reported by stage 1 to "
                                         r"stage 2\)"):
        faults.check_store()
    assert sends == []  # the last stage has no receivers


def test_a_lost_peer_is_named_with_its_stage_and_what_this_rank_was_doing(group, sends):
    faults = _faults(rank=3, receivers=())
    with pytest.raises(StageError) as e:
        faults.lost(ConnectionError("Connection reset by peer\nmore detail"), 2, "receiving from")
    message = ("lost contact with the process of stage 1 (rank 2) while receiving from it: it stopped without "
               "reporting an error (killed, out of memory, crashed, or no message within the process group's "
               "timeout); see its own output. ConnectionError: Connection reset by peer")
    assert str(e.value) == f"stage 1 failed: {message} (reported by stage 2 to stage 2)"
    assert json.loads(group.get(ERROR_KEY)) == {"stage": 1, "batch": None, "by": 2, "rank": 3, "traceback": "",
                                                "message": message}
    assert group.get("ppll/taken/2") == b"1" and group.get("ppll/taken/3") == b"1"


def test_a_lost_peer_after_a_report_raises_the_report_and_a_stage_error_passes_through(group, sends):
    faults = _faults(rank=1, receivers=(3,))
    own = StageError(1, 2, "mine")
    with pytest.raises(StageError) as e:
        faults.lost(own, 3, "sending to")
    assert e.value is own and not group.check([ERROR_KEY])
    group.set(ERROR_KEY, json.dumps(_report(stage=0, rank=0, by=0)))
    with pytest.raises(StageError, match=r"^stage 0 failed at batch 6: ValueError: bad input \(reported by stage 0"):
        faults.lost(RuntimeError("closed"), 3, "sending to")


def test_data_and_an_early_close_are_reported_in_words(group, sends):
    faults = _faults(rank=0, receivers=(1, 2))
    try:
        raise OSError("disk gone")
    except OSError as error:
        faults.data_failed(error)
    assert (faults.error.stage, faults.error.batch) == (0, None)
    report = json.loads(group.get(ERROR_KEY))
    assert report["message"] == "reading data on the first stage's process raised OSError: disk gone"
    assert [dst for dst, _ in _stops(sends)] == [1, 2]

    later = _faults(rank=1, receivers=(3,))
    later.closed_early()
    assert _stops(sends[4:]) == [(3, {"stage": 1, "batch": None, "by": 1, "rank": 1, "traceback": "",
                                      "message": "the process of stage 1 (rank 1) closed the pipeline in the middle "
                                                 "of an epoch (an exception in its training script?)"})]
    assert json.loads(group.get(ERROR_KEY)) == report  # the first report stays


def test_a_failed_collective_raises_the_report_if_there_is_one(group, sends):
    faults = _faults(rank=1)
    assert faults.collective(lambda: 3) == 3

    def fails():
        raise RuntimeError("peer closed")

    with pytest.raises(RuntimeError, match="^peer closed$"):
        faults.collective(fails)
    group.set(ERROR_KEY, json.dumps(_report(stage=2, rank=3)))
    with pytest.raises(StageError, match=r"^stage 2 failed at batch 6"):
        faults.collective(fails)
    assert _stops(sends) == [(3, _report(stage=2, rank=3))]


def test_wait_taken_returns_once_every_rank_took_the_report(group, sends):
    faults = _faults(rank=1)
    faults.closed_early()  # marks rank 1
    group.set("ppll/taken/0", "1")
    start = time.monotonic()
    faults.wait_taken(2)
    assert time.monotonic() - start < 1.0  # the linger is 5 s
    assert [dst for dst, _ in _stops(sends)] == [3]


def test_wait_quietly_waits_on_every_send_and_ignores_failures():
    waited = []

    class Work:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def wait(self) -> None:
            waited.append(self)
            if self.fails:
                raise RuntimeError("peer gone")

    works = [Work(False), Work(False), Work(True)]
    wait_quietly(works)
    assert waited == works


# ---- the watching thread ----------------------------------------------------------------------------------------

def test_the_watcher_aborts_the_groups_on_another_ranks_report_and_not_on_its_own(group, monkeypatch):
    aborted: list[list] = []
    called = threading.Event()
    monkeypatch.setattr(faults_module, "abort", lambda groups: (aborted.append(groups), called.set()))
    faults = _faults(rank=1)
    faults.watch(["g"])
    try:
        group.set(ERROR_KEY, json.dumps(_report(stage=1, rank=1)))  # this rank's own report
        assert not called.wait(0.7)  # about three looks at the store
        group.set(ERROR_KEY, json.dumps(_report(stage=2, rank=3)))
        assert called.wait(5.0)
    finally:
        faults.unwatch()
    assert aborted == [["g"]]
    group.delete_key(ERROR_KEY)
    assert faults.read_report() == _report(stage=2, rank=3)  # what the watcher found is kept


def test_unwatch_stops_the_watcher(group, monkeypatch):
    aborted: list = []  # the watcher runs in its own thread: record, and assert here
    monkeypatch.setattr(faults_module, "abort", aborted.append)
    faults = _faults(rank=1)
    faults.watch([])
    faults.unwatch()
    assert not [t for t in threading.enumerate() if t.name == "ppll-watch"]
    group.set(ERROR_KEY, json.dumps(_report(stage=2, rank=3)))
    time.sleep(0.6)
    assert aborted == []

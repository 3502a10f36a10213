"""The fault protocol of the ``distributed`` runtime: error reports in the store, STOP messages, lost peers.

A stage that raises publishes ``{stage, batch, by, message, traceback}`` under :data:`ERROR_KEY` in the
process group's store and sends a STOP header carrying the same report downstream before it raises. A
rank that gets STOP, finds the key while it waits, or whose send or receive fails because a peer died,
raises a :class:`StageError` for the *original* stage ("reported by stage ..."), or one naming the lost peer.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from ..errors import StageError
from .wire import Wire

__all__ = ["ERROR_KEY", "Faults", "wait_quietly"]

ERROR_KEY = "ppll/error"
"""Store key under which the first failing stage publishes its report (JSON)."""

_LINGER = 5.0  # seconds a failing rank waits for its STOP message to be taken before it raises


def wait_quietly(works: list[Any]) -> None:
    """Wait for ``works`` (sends), ignoring their failures: the peer may be gone."""
    try:
        for w in works:
            w.wait()
    except Exception:  # noqa: BLE001 - best effort: the peer may be gone
        pass


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


class Faults:
    """One rank's side of the fault protocol; ``error`` is the StageError this rank raised, once it has.

    ``stage`` is this rank's stage, ``stage_of(rank)`` names a peer's stage, ``receivers`` are the ranks
    this rank sends batches to (they get its STOP), and ``wire`` encodes the STOP message.
    """

    def __init__(self, *, stage: int, stage_of: Callable[[int], int], receivers: list[int], wire: Wire) -> None:
        self.stage = stage
        self.error: StageError | None = None
        """The error this rank raised (its own stage's, or one another rank reported); it stays raised."""
        self._stage_of = stage_of
        self._receivers = receivers
        self._wire = wire
        self._stop_sent = False

    def publish(self, report: dict[str, Any]) -> None:
        """Put ``report`` under ERROR_KEY unless an earlier failure is there already (best effort)."""
        try:
            _store().compare_set(ERROR_KEY, "", json.dumps(report))
        except Exception:  # noqa: BLE001 - the store's host may be gone
            pass

    def read_report(self) -> dict[str, Any] | None:
        """The report published under ERROR_KEY, or ``None`` (also when the store cannot be reached)."""
        try:
            store = _store()
            if store.check([ERROR_KEY]):
                return json.loads(store.get(ERROR_KEY))
        except Exception:  # noqa: BLE001
            pass
        return None

    def announce(self, report: dict[str, Any]) -> None:
        """Publish ``report`` and send it downstream with STOP."""
        self.publish(report)
        self.stop_downstream(report)

    def stop_downstream(self, report: dict[str, Any]) -> None:
        """Send STOP with ``report`` to every receiver and give them a few seconds to take it (best effort)."""
        if not self._receivers or self._stop_sent:
            return
        self._stop_sent = True
        works = []
        tensors = self._wire.stop(report)
        for dst in self._receivers:
            try:
                works += [dist.isend(t, dst) for t in tensors]
            except Exception:  # noqa: BLE001 - that receiver is gone already
                continue
        waiter = threading.Thread(target=wait_quietly, args=(works,), name="ppll-stop", daemon=True)
        waiter.start()
        waiter.join(_LINGER)

    def check_store(self) -> None:
        """Raise the StageError of a report another rank published, if there is one."""
        report = self.read_report()
        if report is not None:
            self.remote(report)

    def remote(self, report: dict[str, Any]) -> NoReturn:
        """Raise the StageError of another rank's ``report`` (after passing STOP on)."""
        by = report.get("by", report["stage"])
        self.error = StageError(int(report["stage"]), report.get("batch"),
                                f"{report['message']} (reported by stage {by} to stage {self.stage})",
                                report.get("traceback", ""))
        self.stop_downstream(report)
        raise self.error

    def lost(self, error: BaseException, peer: int, doing: str) -> NoReturn:
        """A send or receive failed: raise the published report if any, else an error naming the lost peer rank."""
        if isinstance(error, StageError):
            raise error
        report = self.read_report()
        if report is None:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            stage = self._stage_of(peer)
            report = {"stage": stage, "batch": None, "by": self.stage, "traceback": "",
                      "message": f"lost contact with the process of stage {stage} (rank {peer}) while {doing} it: "
                                 f"it stopped without reporting an error (killed, out of memory, crashed, or no "
                                 f"message within the process group's timeout); see its own output. "
                                 f"{type(error).__name__}: {first}"}
            self.publish(report)
        self.remote(report)

    def guard(self, batch: int | None, fn: Callable[[], Any]) -> Any:
        """Run this rank's own stage work; an exception becomes its StageError, published to every rank."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure must stop the pipeline and reach every rank
            earlier = self.read_report()
            if earlier is not None:  # e.g. a replica's all-reduce timed out because its peer had failed first
                self.remote(earlier)
            report = {"stage": self.stage, "batch": batch, "by": self.stage,
                      "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            self.error = StageError(self.stage, batch, report["message"], report["traceback"])
            self.announce(report)
            raise self.error from e

    def data_failed(self, error: Exception) -> None:
        """Rank 0's data loader raised ``error`` (being handled): tell every rank, remember the StageError."""
        report = {"stage": 0, "batch": None, "by": 0, "traceback": traceback.format_exc(),
                  "message": f"reading data on the first stage's process raised {type(error).__name__}: {error}"}
        self.announce(report)
        self.error = StageError(0, None, report["message"], report["traceback"])

    def closed_early(self, rank: int) -> None:
        """Tell every rank that this one closed the pipeline in the middle of an epoch."""
        report = {"stage": self.stage, "batch": None, "by": self.stage, "traceback": "",
                  "message": f"the process of stage {self.stage} (rank {rank}) closed the pipeline in the "
                             f"middle of an epoch (an exception in its training script?)"}
        self.announce(report)

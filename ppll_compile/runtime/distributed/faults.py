"""The fault protocol of the ``distributed`` runtime: error reports in the store, STOP messages, lost peers.

A stage that raises publishes ``{stage, batch, by, rank, message, traceback}`` under :data:`ERROR_KEY` in
the process group's store and sends a STOP header carrying the same report downstream before it raises.
A rank that gets STOP, finds the key while it waits, or whose send or receive fails because a peer died,
raises a :class:`StageError` for the *original* stage ("reported by stage ..."), or one naming the lost peer.

Every rank also watches the store from a thread: when another rank's report appears, it aborts this rank's
process groups (:func:`.group.abort`), so that a send, receive or collective (a replica's all-reduce) that
waits on the failed rank fails at once, and the rank raises the report's StageError within a poll or two,
even while the failed process stays alive.

The same thread beats: every quarter second it writes under :data:`BEAT_KEY` + rank a count and the rank this
one waits on (sending to it or receiving from it), if any. A rank whose send or receive fails without a report
(a peer killed, or the process group's timeout) names the *silent* stage: it follows the waits from the peer
it lost (a peer that waits on another rank, and still beats, is not the cause) to the first rank that is not
waiting on a further one (busy in its own work, frozen, or gone). A frozen or hung stage deep in the pipeline
is thus named by every rank, not the neighbour whose own connections closed first. The first report stored
wins: every rank raises that one.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from ...errors import StageError
from .group import abort
from .wire import Wire

ERROR_KEY = "ppll/error"
"""Store key under which the first failing stage publishes its report (JSON)."""

BEAT_KEY = "ppll/beat/"
"""Store key (+ rank) of a rank's heartbeat: ``{"n": count, "on": the rank it waits on, COLLECTIVE, or null}``."""

COLLECTIVE = -1
"""``waiting_on`` of a rank inside a collective (a barrier, a gather): it waits on every rank."""

_TAKEN = "ppll/taken/"  # + rank: that rank has raised the StageError of the report (or is known to be gone)
_LINGER = 5.0  # seconds a failing rank waits for its STOP to be taken, and rank 0 for every rank to take a report
_WATCH = 0.25  # seconds between looks at the store by the watching thread
_ALIVE = 1.5  # seconds a rank's heartbeat may stand still before it counts as silent (6 beats)


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

    ``rank`` and ``stage`` are this rank's, ``stage_of(rank)`` names a peer's stage, ``receivers`` are the
    ranks this rank sends batches to (they get its STOP), and ``wire`` encodes the STOP message.
    """

    def __init__(self, *, rank: int, stage: int, stage_of: Callable[[int], int], receivers: list[int],
                 wire: Wire) -> None:
        self.rank = rank
        self.stage = stage
        self.error: StageError | None = None
        """The error this rank raised (its own stage's, or one another rank reported); it stays raised."""
        self._stage_of = stage_of
        self._receivers = receivers
        self._wire = wire
        self._stop_sent = False
        self._seen: dict[str, Any] | None = None  # the report the watching thread found
        self._unwatched = threading.Event()
        self._watcher: threading.Thread | None = None
        self._beats = 0
        self.waiting_on: int | None = None
        """The rank this rank's main thread waits on now (sending to it, or receiving from it); set by the links."""

    def watch(self, groups: list[Any]) -> None:
        """Start the thread that aborts ``groups`` on this rank once another rank has published a report."""
        self._watcher = threading.Thread(target=self._watch, args=(groups,), name="ppll-watch", daemon=True)
        self._watcher.start()

    def unwatch(self) -> None:
        """Stop the watching thread (before the process group goes)."""
        self._unwatched.set()
        if self._watcher is not None:
            self._watcher.join(4 * _WATCH)

    def _watch(self, groups: list[Any]) -> None:
        self.beat()
        while not self._unwatched.wait(_WATCH):
            self.beat()
            report = self._stored_report()
            if report is not None and report.get("rank") != self.rank:
                self._seen = report
                abort(groups)
                return

    def beat(self) -> None:
        """Write this rank's heartbeat: one more beat, and the rank it waits on now (best effort)."""
        self._beats += 1
        try:
            _store().set(f"{BEAT_KEY}{self.rank}", json.dumps({"n": self._beats, "on": self.waiting_on}))
        except Exception:  # noqa: BLE001 - the store's host may be gone
            pass

    def _heartbeat(self, rank: int) -> dict[str, Any] | None:
        """``rank``'s last heartbeat, or ``None`` (none written, or the store cannot be reached)."""
        try:
            store = _store()
            key = f"{BEAT_KEY}{rank}"
            return json.loads(store.get(key)) if store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None

    def _beating(self, rank: int, first: dict[str, Any]) -> bool:
        """Whether ``rank`` still beats after ``first`` (waits up to :data:`_ALIVE` seconds, less once a report
        appears: the rank that found the cause was quicker)."""
        deadline = time.monotonic() + _ALIVE
        while time.monotonic() < deadline:
            time.sleep(_WATCH / 2)
            later = self._heartbeat(rank)
            if later is not None and later.get("n") != first.get("n"):
                return True
            if self.read_report() is not None:
                return True
        return False

    def silent(self, peer: int) -> list[int]:
        """The waits from this rank through ``peer`` to the silent rank (the last one): each rank after ``peer``
        is the one the rank before it waits on, and still beats, and the last waits on no further rank."""
        chain = [self.rank, peer]
        while True:
            beat = self._heartbeat(chain[-1])
            on = beat.get("on") if beat is not None else None
            if not isinstance(on, int) or on < 0 or on in chain or not self._beating(chain[-1], beat or {}):
                return chain
            chain.append(on)

    def publish(self, report: dict[str, Any]) -> None:
        """Put ``report`` under ERROR_KEY unless an earlier failure is there already (best effort)."""
        try:
            _store().compare_set(ERROR_KEY, "", json.dumps(report))
        except Exception:  # noqa: BLE001 - the store's host may be gone
            pass

    def read_report(self) -> dict[str, Any] | None:
        """The report published under ERROR_KEY, or ``None`` (also when the store cannot be reached)."""
        return self._seen if self._seen is not None else self._stored_report()

    def wait_taken(self, world: int) -> None:
        """Wait (a few seconds at most) until every rank has raised the report's error: the store may live here."""
        try:
            _store().wait([f"{_TAKEN}{r}" for r in range(world)], timedelta(seconds=_LINGER))
        except Exception:  # noqa: BLE001 - a rank that is gone without anyone noticing, or the store is
            pass

    def _mark_taken(self, rank: int) -> None:
        """Note in the store that ``rank`` has raised the report's StageError (or is gone)."""
        try:
            _store().set(f"{_TAKEN}{rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host may be gone
            pass

    def _fail(self, error: StageError) -> None:
        """``error`` is this rank's StageError from now on."""
        self.error = error
        self._mark_taken(self.rank)

    def _stored_report(self) -> dict[str, Any] | None:
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
        self._fail(StageError(int(report["stage"]), report.get("batch"),
                               f"{report['message']} (reported by stage {by} to stage {self.stage})",
                               report.get("traceback", "")))
        self.stop_downstream(report)
        raise self.error

    def lost(self, error: BaseException, peer: int, doing: str) -> NoReturn:
        """A send or receive failed: raise the published report if any, else an error naming the lost peer rank."""
        if isinstance(error, StageError):
            raise error
        report = self.read_report()
        chain = self.silent(peer) if report is None else []
        report = self.read_report() if report is None else report  # one found meanwhile by a rank nearer the cause
        if report is None:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            silent = chain[-1]
            stage = self._stage_of(silent)
            if silent == peer:
                message = (f"lost contact with the process of stage {stage} (rank {peer}) while {doing} it: it "
                           f"stopped without reporting an error (killed, out of memory, crashed, or no message "
                           f"within the process group's timeout); see its own output. {type(error).__name__}: "
                           f"{first}")
            else:
                waits = " -> ".join(f"rank {r} (stage {self._stage_of(r)})" for r in chain)
                message = (f"lost contact with the process of stage {stage} (rank {silent}): it went silent without "
                           f"reporting an error (killed, frozen, or hung in its own work past the process group's "
                           f"timeout); this rank was {doing} rank {peer}, which waits on it ({waits}); see its "
                           f"own output. {type(error).__name__}: {first}")
            report = {"stage": stage, "batch": None, "by": self.stage, "rank": self.rank, "traceback": "",
                      "message": message}
            self.publish(report)
            self._mark_taken(silent)
            report = self.read_report() or report  # the first report stored wins, on every rank
        self.remote(report)

    def guard(self, batch: int | None, fn: Callable[[], Any]) -> Any:
        """Run this rank's own stage work; an exception becomes its StageError, published to every rank."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure must stop the pipeline and reach every rank
            earlier = self.read_report()
            if earlier is not None:  # e.g. a replica's all-reduce timed out because its peer had failed first
                self.remote(earlier)
            report = {"stage": self.stage, "batch": batch, "by": self.stage, "rank": self.rank,
                      "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            error = StageError(self.stage, batch, report["message"], report["traceback"])
            self._fail(error)
            self.announce(report)
            raise error from e

    def data_failed(self, error: Exception) -> None:
        """Rank 0's data loader raised ``error`` (being handled): tell every rank, remember the StageError."""
        report = {"stage": 0, "batch": None, "by": 0, "rank": self.rank, "traceback": traceback.format_exc(),
                  "message": f"reading data on the first stage's process raised {type(error).__name__}: {error}"}
        self._fail(StageError(0, None, report["message"], report["traceback"]))
        self.announce(report)

    def closed_early(self) -> None:
        """Tell every rank that this one closed the pipeline in the middle of an epoch."""
        report = {"stage": self.stage, "batch": None, "by": self.stage, "rank": self.rank, "traceback": "",
                  "message": f"the process of stage {self.stage} (rank {self.rank}) closed the pipeline in the "
                             f"middle of an epoch (an exception in its training script?)"}
        self._mark_taken(self.rank)
        self.announce(report)

    def collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, a collective over the ranks; if it fails after a failure was reported, raise that StageError.

        Meanwhile this rank's heartbeat says it waits on every rank (:data:`COLLECTIVE`): the waits of a rank that
        lost it end here."""
        self.waiting_on = COLLECTIVE
        try:
            return fn()
        except Exception:
            report = self.read_report()
            if report is None:
                raise
            self.remote(report)
        finally:
            self.waiting_on = None

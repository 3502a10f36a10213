"""``queue="latest"`` under ``distributed`` with the README's step loop: stages that drop inputs take fewer than were
fed, and the loop still ends at once (no rank waits for the process group's timeout) with every loss returned."""

# Three ranks are forked by tests/dist_worker.py (scenario ``latest-steps``): two epochs of 30 batches fed with
# ``trainer.step`` and closed with ``trainer.finish()``; the last stage sleeps 20 ms per batch, so it drops inputs.

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.helpers import run_dist_scenario

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dist_worker as w  # noqa: E402

pytestmark = pytest.mark.slow  # forks worker processes


def test_latest_under_the_step_loop_ends_at_once_and_returns_every_loss(tmp_path):
    codes, text = run_dist_scenario("latest-steps", 3, tmp_path, 120, "2")
    assert codes == [0, 0, 0], f"exit codes {codes} (null: killed, still waiting):\n{text[-3000:]}"
    records = [json.loads((tmp_path / f"latest-{r}.json").read_text()) for r in range(3)]
    assert [r["stage"] for r in records] == [0, 1, 2]
    assert [len(ls) for ls in records[0]["losses"]] == [30, 30] and records[0]["dropped"] == 0
    for rank, rec in enumerate(records):
        # the two epochs took a fraction of the process group's timeout: no rank waited for it
        assert rec["seconds"] < w.LATEST_TIMEOUT / 3, (rank, rec["seconds"])
        # every input a stage trained on gave its loss back through step() or finish()
        assert rec["steps"] == sum(len(ls) for ls in rec["losses"]), (rank, rec)
        assert all(math.isfinite(v) for ls in rec["losses"] for v in ls)
        if rank > 0:  # each input the stage before sent on was trained on or dropped, none lost or waited for
            assert rec["steps"] + rec["dropped"] == records[rank - 1]["steps"], (rank, rec, records[rank - 1])
    assert records[2]["dropped"] > 0, records[2]
    assert all(len(ls) > 0 for ls in records[2]["losses"]), records[2]["losses"]

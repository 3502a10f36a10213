"""The ``distributed`` runtime's traced timeline held to the golden schedule grids (``tests/golden/schedule/``).

One torchrun job of two processes (gloo on the CPU, one torch thread each; tests/integration/schedule_worker.py)
trains the golden tests' MLP in two stages under every two-stage FIFO case and saves each timeline; each test
compares one of them with its golden grid in the reduced form of ``tests/grids.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ppll_compile.plans.timeline import Timeline
from tests.grids import (
    CASES,
    golden_grid,
    project,
    reduce_grid,
    reduce_timeline,
    show,
)
from tests.helpers import free_port, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

WORKER = Path(__file__).resolve().with_name("schedule_worker.py")
PROCESSES = 2
DIST = [name for name, c in CASES.items() if c.queue == "fifo" and c.stages == PROCESSES]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where the torchrun job left the timeline of every case of :data:`DIST`."""
    out = tmp_path_factory.mktemp("schedule-dist")
    run_torchrun([f"--nproc-per-node={PROCESSES}", f"--master-port={free_port()}"], WORKER, [str(out), *DIST],
                 timeout=240)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", DIST)
def test_the_distributed_timeline_follows_the_golden_grid(traced, name):
    """Every stage trains on every batch in order, each turn's actions as in the golden grid.

    The distributed runtime posts each output's send as soon as the forward made it (the next stage's receiving
    thread takes it into its queue), so its trace has every send inside the forward: the whole reduced form is
    compared where the golden grid sends everything early, and elsewhere (a full queue defers the grid's send to
    after the step) the order of the turns and the batches sent on.
    """
    case = CASES[name]
    want = reduce_grid(golden_grid(case))
    level = "exact" if not any(a[0] == "S" for row in want for a in row) else "order"
    got = project(reduce_timeline(Timeline.load(traced / f"{name}.json"), case.stages), level)
    want = project(want, level)
    assert got == want, f"\n{level}, traced:{show(got)}\ngolden:{show(want)}"

"""The stage-cost objective is defined once: the numbers a plan reports are the solver's objective for the layout it
chose, to the last bit, and an infeasible memory cap reports the smallest cap that works."""

from __future__ import annotations

import pytest
from ppll_compile.partitioners.objective import Segments, stage_seconds
from ppll_compile import partitioners

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def test_the_objective_by_hand():
    # (sum(compute[1:3]) - start[1] + head[2]) / (speed r) + 2 (r-1)/r grad / bandwidth, then comm[2] / r
    s = Segments.of([1.0, 2.0, 4.0, 8.0], head=[0, 0, 0.5, 0], comm=[0, 0, 3.0, 0], start=[0, 1.0, 0, 0],
                    grad_bytes=[0, 10.0, 30.0, 0], head_grad_bytes=[0, 0, 8.0, 0])
    compute, send = s.seconds(1, 3, speed=2.0, replicas=2, bandwidth=4.0)
    assert (compute, send) == ((2 + 4 - 1 + 0.5) / 4 + 2 * 1 / 2 * 48 / 4, 1.5)
    assert s.cost(1, 3) == 2 + 4 - 1 + 0.5 + 3
    assert stage_seconds(5.0, 3.0) == (5.0, 3.0)  # one replica, speed 1: exactly the work and the send
    assert partitioners.stage_costs(partitioners.Problem(compute=[1.0, 2.0, 4.0, 8.0], head=[0, 0, 0.5, 0],
                                                         comm=[0, 0, 3.0, 0], start=[0, 1.0, 0, 0],
                                                         speeds=[1.0, 2.0, 1.0]), (1, 3, 4)) \
        == [1.0, (2 + 4 - 1 + 0.5) / 2 + 3, 8.0]

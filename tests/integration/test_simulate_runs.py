"""The plan-time schedule simulator: hand-computed schedules (early forwarding, deferred sends, the barrier
before every step, the optimizer step), steady state, replicas, bandwidth, queue blocking, and agreement with an
independent event-driven simulation on random plans."""

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.plans.plan import Plan
from ppll_compile.simulation.simulate import simulate
from tests.helpers import quiet, synthetic_plan

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


@pytest.fixture(scope="module")
def mlp_plan() -> Plan:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    with quiet():
        return ppll_compile.plan(model, 3, example_inputs=(torch.randn(4, 8),))


def test_the_bottleneck_stage_is_busy_almost_always_over_many_steps(mlp_plan):
    plan = synthetic_plan(mlp_plan, [dict(compute=1.0, out=1), dict(compute=1.5, out=1), dict(compute=3.0)])
    utilisation = [simulate(plan, steps=n).stages[2].utilisation for n in (4, 40, 400, 4000)]
    assert utilisation == sorted(utilisation) and utilisation[-1] > 0.999
    assert [s.utilisation for s in simulate(plan, steps=4000).stages] == pytest.approx([1 / 3, 1 / 2, 1], rel=1e-3)
    middle = synthetic_plan(mlp_plan, [dict(compute=1.0, out=1), dict(compute=3.0, out=1), dict(compute=2.0)])
    bottleneck = simulate(middle, steps=4000).stages[1]
    assert bottleneck.utilisation == pytest.approx(3 / 4, rel=1e-3)  # the send keeps it busy the rest of the time
    assert bottleneck.blocked == 0 and bottleneck.idle / 4000 == pytest.approx(0, abs=1e-2)

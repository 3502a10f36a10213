"""The Plan: totals, serialisation, validation, hand edits, and the planner's choices end to end."""

import pytest
import torchvision

import ppll_compile
import itertools
from models import Residual
from ppll_compile import PartitionError
from tests.helpers import plan_residual


pytestmark = pytest.mark.usefixtures("quietly")  # no CPU-fallback warnings of compile


def test_input_inferred_for_torchvision_classifier():
    p = ppll_compile.plan(torchvision.models.resnet18(), gpus=2)
    assert p.inputs[0].shape == (32, 3, 224, 224) and p.num_classes == 1000


def test_exact_plan_is_optimal_over_every_choice_of_cuts():
    model = Residual()
    best = plan_residual(model, 3)
    manual = [plan_residual(model, 3, split_points=list(c)).bottleneck_cost
              for c in itertools.combinations(best.legal_cuts, 2)]
    assert best.bottleneck_cost == pytest.approx(min(manual), rel=1e-9)
    for name in ("uniform", "greedy", "params"):
        assert plan_residual(model, 3, partitioner=name).bottleneck_cost >= best.bottleneck_cost - 1e-15


def test_memory_cap_infeasible_names_the_smallest_cap():
    p = plan_residual()
    smallest = min(
        max(s.memory_bytes for s in plan_residual(split_points=list(c)).stages)
        for c in itertools.combinations(p.legal_cuts, 2))
    with pytest.raises(PartitionError, match="the smallest limit that works is") as info:
        plan_residual(memory_limit=smallest - 1)
    assert "no partition into 3 stages fits a memory limit" in str(info.value)
    capped = plan_residual(memory_limit=smallest)
    assert max(s.memory_bytes for s in capped.stages) <= smallest

"""Measured costs equal their closed forms."""

import pytest
import torch
from tests.helpers import measured_costs


@pytest.mark.parametrize("name", ["residual", "masked", "resnet18", "mobilenet_v2", "vit"])
def test_repeated_nodes_reuse_exactly_what_running_them_measures(name):
    # a node that repeats an earlier one replays its measurement; running every node afresh gives the same
    import torchvision

    from tests.models import Masked, Residual

    torch.manual_seed(0)
    model, inputs = {
        "residual": lambda: (Residual(), (torch.randn(2, 3, 8, 8),)),
        "masked": lambda: (Masked(depth=4), (torch.randn(2, 5, 8), torch.ones(2, 5))),
        "resnet18": lambda: (torchvision.models.resnet18(), (torch.randn(2, 3, 64, 64),)),
        "mobilenet_v2": lambda: (torchvision.models.mobilenet_v2(), (torch.randn(2, 3, 64, 64),)),
        "vit": lambda: (torchvision.models.VisionTransformer(32, 8, 4, 2, 32, 64), (torch.randn(2, 3, 32, 32),)),
    }[name]()
    reused, _ = measured_costs(model, *inputs)
    fresh, _ = measured_costs(model, *inputs, reuse=False)
    assert reused == fresh

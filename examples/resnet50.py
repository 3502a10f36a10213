"""torchvision's ResNet-50 (ImageNet, 1000 classes, random weights) as a ppll-plan MODEL file.

Run ``ppll-plan examples/resnet50.py --gpus 4`` or ``python examples/resnet50.py``; planning runs on fake
tensors, so batch 64 at 224x224 costs no real compute.
"""

from __future__ import annotations

import torch
import torchvision
from torch import Tensor, nn

__all__ = ["build_model", "example_inputs"]


def build_model(num_classes: int = 1000) -> nn.Module:
    """A freshly initialised ResNet-50 (no weights are downloaded)."""
    return torchvision.models.resnet50(weights=None, num_classes=num_classes)


def example_inputs() -> tuple[Tensor, ...]:
    """One ImageNet batch of 64 (planning uses only its shape and dtype)."""
    return (torch.randn(64, 3, 224, 224),)


if __name__ == "__main__":
    import ppll_compile

    print(ppll_compile.plan(build_model(), 4, example_inputs=example_inputs()).table())

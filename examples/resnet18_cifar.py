"""torchvision's ResNet-18 on 32x32 images (random weights), as a ppll-plan MODEL file.

The ImageNet stem (7x7 stride-2 convolution, then max pooling) is kept as torchvision builds it, so the last
stage works on 1x1 feature maps with 512 channels: its layers are few, wide and memory-bound, and its optimizer
step is large (most of the 11M parameters), which a FLOP count does not see. Run
``ppll-plan examples/resnet18_cifar.py --gpus 2 --policy dgl``.
"""

from __future__ import annotations

import torch
import torchvision
from torch import Tensor, nn

__all__ = ["build_model", "example_inputs"]


def build_model(num_classes: int = 10) -> nn.Module:
    """A freshly initialised ResNet-18 (no weights are downloaded)."""
    return torchvision.models.resnet18(weights=None, num_classes=num_classes)


def example_inputs() -> tuple[Tensor, ...]:
    """One batch of 64 CIFAR-sized images (planning uses only its shape and dtype)."""
    return (torch.randn(64, 3, 32, 32),)


if __name__ == "__main__":
    import ppll_compile

    print(ppll_compile.plan(build_model(), 2, example_inputs=example_inputs(), policy="dgl").table())

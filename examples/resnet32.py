"""CIFAR ResNet-32 (He et al. 2016), the backbone of the InfoPro local-learning experiments, as a ppll-plan MODEL file.

Run ``ppll-plan examples/resnet32.py --gpus 4`` or ``python examples/resnet32.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["BasicBlock", "ResNet32", "build_model", "example_inputs"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity shortcut, or a 1x1 conv-BN projection ("option B") on a shape change."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet32(nn.Module):
    """3x3 conv (16) -> three stages of 5 BasicBlocks (16/32/64 channels, stride 2 at stages 2 and 3) -> pool -> linear."""

    def __init__(self, num_classes: int = 10, blocks_per_stage: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._stage(16, 16, blocks_per_stage, stride=1)
        self.layer2 = self._stage(16, 32, blocks_per_stage, stride=2)
        self.layer3 = self._stage(32, 64, blocks_per_stage, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    @staticmethod
    def _stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(in_planes, planes, stride)]
        layers += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(num_classes: int = 10) -> ResNet32:
    """A freshly initialised ResNet-32 for ``num_classes`` CIFAR classes."""
    return ResNet32(num_classes)


def example_inputs() -> tuple[Tensor, ...]:
    """One CIFAR batch of 64 (planning uses only its shape and dtype)."""
    return (torch.randn(64, 3, 32, 32),)


if __name__ == "__main__":
    import ppll_compile

    print(ppll_compile.plan(build_model(), 4, example_inputs=example_inputs()).table())

"""Tiny models whose graphs, cuts and costs the tests know exactly."""

import torch
import torch.nn.functional as F
from torch import nn


class Residual(nn.Module):
    """stem conv -> two residual blocks -> pool -> linear."""

    def __init__(self, c: int = 8, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.a1 = nn.Conv2d(c, c, 3, padding=1)
        self.a2 = nn.Conv2d(c, c, 3, padding=1)
        self.b1 = nn.Conv2d(c, c, 3, padding=1)
        self.b2 = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = x + self.a2(torch.relu(self.a1(x)))
        x = x + self.b2(torch.relu(self.b1(x)))
        return self.fc(x.mean((2, 3)))


class TwoInputs(nn.Module):
    """Two branches joined by an add, then an MLP: cut apart only with the raw input b carried along."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.left = nn.Linear(4, 16)
        self.right = nn.Linear(6, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, classes)

    def forward(self, a, b):
        h = self.left(a) + self.right(b)
        h = torch.relu(self.hidden(h))
        return self.out(h)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, mask):
        return x + torch.relu(self.lin(x)) * mask


class Masked(nn.Module):
    """Token model where every block reads an attention-mask-like tensor: cuts carry (x, mask)."""

    def __init__(self, d: int = 8, depth: int = 3, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x, mask):
        m = mask.unsqueeze(-1)
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x, m)
        return self.head(x.mean(1))


class DictOut(nn.Module):
    """Returns a dict and takes an optional keyword argument fixed at its default."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 2)

    def forward(self, x, scale=None):
        h = torch.relu(self.l1(x))
        if scale is not None:
            h = h * scale
        h = torch.relu(self.l2(h))
        return {"logits": self.l3(h), "features": h}


class DataDependent(nn.Module):
    """Untraceable: branches on a tensor value inside a submodule."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.gate = Gate()
        self.post = nn.Linear(4, 2)

    def forward(self, x):
        return self.post(self.gate(self.pre(x)))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Noisy(nn.Module):
    """A custom module whose forward depends on self.training through a functional call."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, training=self.training)


class WithNoisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 16)
        self.noise = Noisy()
        self.l2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.l2(self.noise(torch.relu(self.l1(x))))


def conv_teacher(classes: int = 10) -> nn.Module:
    """A small CNN teacher whose stage outputs are 8x16x16, 16x8x8 and 32x4x4, then logits."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 24, 1), nn.ReLU(), nn.Conv2d(24, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def conv_student(classes: int = 10) -> nn.Module:
    """A slimmer student with the teacher's stage output shapes (and other widths inside its stages)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 12, 1), nn.ReLU(), nn.Conv2d(12, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


class Res(nn.Module):
    """A residual block: two 3x3 convolutions with BatchNorm, added to the input, then ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class CNN(nn.Module):
    """A stem and four residual blocks in a Sequential (their ends: relu_1, relu_3, relu_5, relu_7), linear."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[Res(c) for _ in range(4)])
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

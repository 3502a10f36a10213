"""A small Vision Transformer for 32x32 images (patch 4, dim 192, depth 6, 3 heads), as a ppll-plan MODEL file.

Run ``ppll-plan examples/vit_small.py --gpus 4 --policy vit`` or ``python examples/vit_small.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Block", "ViTSmall", "build_model", "example_inputs"]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x)) with GELU."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViTSmall(nn.Module):
    """Patch embedding + CLS token + learned positions -> ``depth`` blocks -> LayerNorm -> CLS -> linear."""

    def __init__(self, num_classes: int = 10, image_size: int = 32, patch_size: int = 4, dim: int = 192,
                 depth: int = 6, heads: int = 3, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # N x tokens x dim
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def build_model(num_classes: int = 10) -> ViTSmall:
    """A freshly initialised ViT-Small/4 for 32x32 inputs and ``num_classes`` classes."""
    return ViTSmall(num_classes)


def example_inputs() -> tuple[Tensor, ...]:
    """One CIFAR batch of 64 (planning uses only its shape and dtype)."""
    return (torch.randn(64, 3, 32, 32),)


if __name__ == "__main__":
    import ppll_compile

    print(ppll_compile.plan(build_model(), 4, example_inputs=example_inputs(), policy="vit").table())

"""FLOP counting with torch's ``FlopCounterMode``, plus formulas for the kernels it does not count right."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import flop_counter as _torch_flops
from torch.utils.flop_counter import FlopCounterMode

# torch wraps custom formulas so that they receive tensor shapes (torch.Size) instead of tensors

def _sdpa_cpu(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return _torch_flops.sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return _torch_flops.sdpa_backward_flop_count(grad_out, query, key, value)


def _native_mha(query: Any, key: Any, value: Any, embed_dim: int, num_heads: int, *args: Any,
                **kwargs: Any) -> int:
    # in-projection of q, k, v, attention (QK^T and AV), out-projection; batch-first (B, L, E) inputs
    b, lq, e = query
    lk = key[1]
    head_dim = e // num_heads
    proj = 2 * b * e * e * (lq + 2 * lk) + 2 * b * lq * e * e
    heads = (b, num_heads, lq, head_dim), (b, num_heads, lk, head_dim), (b, num_heads, lk, head_dim)
    return proj + _torch_flops.sdpa_flop_count(*heads)


def _conv_backward(grad_out: Any, x: Any, w: Any, _bias: Any, _stride: Any, _padding: Any, _dilation: Any,
                   transposed: bool, _output_padding: Any, _groups: Any, output_mask: Sequence[bool],
                   *args: Any, **kwargs: Any) -> int:
    # the input gradient and the weight gradient each take as many multiply-adds as the forward convolution;
    # torch's own formula counts a grouped (e.g. depthwise) weight gradient as if the conv were dense
    forward = _torch_flops.conv_flop_count(x, w, grad_out, transposed=transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    aten = torch.ops.aten
    table = {
        "convolution_backward": _conv_backward,
        "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
        "_native_multi_head_attention": _native_mha,
    }
    return {getattr(aten, name): fn for name, fn in table.items() if hasattr(aten, name)}


EXTRA_FORMULAS = _extra_formulas()
"""FLOP formulas (by ATen operator packet) for kernels ``FlopCounterMode`` does not count right."""


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts CPU flash attention, native multi-head attention, and a
    convolution's backward by the gradients it computes."""
    return FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)

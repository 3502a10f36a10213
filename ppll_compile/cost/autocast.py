"""Autocast as CUDA runs it, on meta tensors: what a head or a loss computes in a low precision, measured where no
CUDA device is."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LOW_FUNCTIONS = frozenset({
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.prelu,
    F.scaled_dot_product_attention, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
    torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm, torch.addbmm, torch.mv,
})
"""The functions (of those a head calls) that ``torch.autocast`` runs in its low dtype on CUDA: PyTorch's Automatic
Mixed Precision reference, "CUDA Ops that can autocast to float16" (the same list for bfloat16),
https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float16."""
FLOAT32_FUNCTIONS = frozenset({
    F.cross_entropy, F.nll_loss, F.log_softmax, F.softmax, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.binary_cross_entropy_with_logits, F.kl_div, F.cosine_similarity, F.layer_norm, F.group_norm,
    torch.log_softmax, torch.softmax, torch.Tensor.log_softmax, torch.Tensor.softmax, torch.layer_norm,
})
"""The functions (of those a head or a loss calls) that ``torch.autocast`` runs in float32 on CUDA whatever their
operands' dtype: the same reference, "CUDA Ops that can autocast to float32"
(https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float32)."""


class MetaAutocast(TorchFunctionMode):
    """``torch.autocast`` as CUDA runs it, on any device (meta included), for measuring a head or a loss: a call of
    :data:`LOW_FUNCTIONS` gets copies of its float32 tensor operands in ``dtype``, one of :data:`FLOAT32_FUNCTIONS`
    float32 copies of its bfloat16 and float16 ones. So a measurement sees the casts (and the low-precision weight
    copies autocast keeps for backward), the low-precision layers and the float32 losses."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in LOW_FUNCTIONS:
            args, kwargs = _cast((args, kwargs), (torch.float32,), self.dtype)
        elif func in FLOAT32_FUNCTIONS:
            args, kwargs = _cast((args, kwargs), (torch.bfloat16, torch.float16), torch.float32)
        return func(*args, **kwargs)


def _cast(tree: Any, dtypes: tuple[torch.dtype, ...], to: torch.dtype) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(to) if t.dtype in dtypes else t, tree)

"""Every operator a tensor computation runs, as it runs: its family, dtype, counted FLOPs and bytes read and written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from .flops import EXTRA_FORMULAS

FAMILIES = ("matmul", "attention", "conv", "conv_bwd", "norm", "math", "pool", "memory", "step")
"""Operator families, each with its own calibrated rate: FLOP/s for the first four, bytes/s for the others
(``step``: an optimizer's update of parameters and state, streamed from memory)."""
COMPUTE = FAMILIES[:4]
"""The families whose rate is FLOP/s."""
_REGISTRY = {**flop_registry, **{k: shape_wrapper(v) for k, v in EXTRA_FORMULAS.items()}}
_BY_NAME = {
    "conv": ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution"),
    "conv_bwd": ("convolution_backward",),
    "norm": ("native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
             "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "batch_norm_backward",
             "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
             "_fused_rms_norm", "_fused_rms_norm_backward"),
    "math": ("gelu", "gelu_backward", "silu", "silu_backward", "sigmoid", "sigmoid_backward", "tanh",
             "tanh_backward", "exp", "log", "erf", "pow", "rsqrt", "sqrt", "_softmax", "_softmax_backward_data",
             "_log_softmax", "_log_softmax_backward_data", "mish", "mish_backward", "hardswish",
             "hardswish_backward"),
    "pool": ("max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
             "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "max_pool3d_with_indices",
             "max_pool3d_with_indices_backward", "avg_pool3d", "avg_pool3d_backward", "_adaptive_avg_pool3d",
             "_adaptive_avg_pool3d_backward", "upsample_bilinear2d", "upsample_nearest2d",
             "upsample_bilinear2d_backward", "upsample_nearest2d_backward"),
}
_FAMILY = {name: family for family, names in _BY_NAME.items() for name in names}
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "_unsafe_view", "set_", "resize_", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
         "is_same_size", "_has_compatible_shallow_copy_type"}
"""Operators that run no kernel (allocations, metadata), beside views."""


@dataclass(frozen=True)
class Op:
    """One operator run: its family (one of :data:`FAMILIES`), dtype, FLOPs and bytes read plus written."""

    kind: str
    dtype: str
    flops: int
    bytes: int
    call: tuple[Any, ...] = ()
    """A compute family's operator as it was called: its name and every argument, a tensor as ``("T", shape,
    stride, dtype)``; what :func:`measure_calls` re-creates and times. Empty for memory-bound operators."""
    kept: int = 0
    """Of :attr:`bytes`, those of operands that are not float32 (integers, masks, tensors already in a lower
    precision): what a plan in a lower precision keeps as they are (see :mod:`~ppll_compile.plans.precision`)."""


def _is_view(func: Any) -> bool:
    """Whether an operator only makes a view (its output aliases an input and nothing is written): no kernel."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def nbytes(t: Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


class OpLog(TorchDispatchMode):
    """Records an :class:`Op` for every operator that runs a kernel (views and allocations run none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in _FREE or _is_view(func):
            return out
        seen: dict[int, Tensor] = {}
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, Tensor):
                seen.setdefault(id(t), t)
        tensors = list(seen.values())
        formula = _REGISTRY.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        kind = _FAMILY.get(name) or ("attention" if "attention" in name else "matmul" if flops else "memory")
        floating = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        call = (str(func), _describe(args), _describe(kwargs)) if kind in COMPUTE else ()
        kept = sum(nbytes(t) for t in tensors if t.dtype != torch.float32)
        self.ops.append(Op(kind, str(floating).removeprefix("torch."), flops, sum(nbytes(t) for t in tensors), call,
                           kept))
        return out


def _describe(value: Any) -> Any:
    """Arguments as hashable plain data: a tensor as ``("T", shape, stride, dtype)``, sequences as tuples."""
    if isinstance(value, Tensor):
        return "T", tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride()), \
            str(value.dtype).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return "K", tuple(sorted((k, _describe(v)) for k, v in value.items()))
    if isinstance(value, (torch.device, torch.dtype, torch.layout, torch.memory_format)):
        return "D", str(value)
    return value

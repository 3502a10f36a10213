"""Node signatures: what a node's measurement depends on, so that a repeated node can replay an earlier one."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

PLAIN = (int, float, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.memory_format,
          torch.layout)
_PURE_MODULES = ("torch", "_operator", "operator", "builtins", "math")
"""Modules whose functions compute their result from their arguments alone (no hidden state)."""
_HOOK_FREE = ("_parameters", "_buffers", "_modules")


class Uncacheable(Exception):
    """A value that a node's signature cannot stand for exactly."""


def plain(v: Any) -> Any:
    """A hashable stand-in for a constant that tells apart values of different types (``1``, ``1.0``, ``True``)."""
    if type(v) in PLAIN:
        return type(v), v
    if isinstance(v, slice):
        return slice, plain(v.start), plain(v.stop), plain(v.step)
    if type(v) in (tuple, list, frozenset, set):
        items = (plain(x) for x in v)
        return type(v), (frozenset(items) if isinstance(v, (set, frozenset)) else tuple(items))
    if pure_function(v):
        return "fn", v
    raise Uncacheable


def pure_function(f: Any) -> bool:
    """A plain function of torch, ``operator``, ``math`` or the builtins (not a method bound to some object)."""
    if isinstance(f, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if isinstance(f, types.BuiltinFunctionType):
        owner = getattr(f, "__self__", None)
        if not (owner is None or isinstance(owner, (types.ModuleType, type))):
            return False
    elif not isinstance(f, types.FunctionType):
        return False
    return (getattr(f, "__module__", None) or "").split(".")[0] in _PURE_MODULES


def module_signature(module: nn.Module) -> Any:
    """What determines a ``torch.nn`` module's computation: classes, attributes and parameter/buffer layouts.

    Raises :class:`Uncacheable` for a module (or submodule) defined outside ``torch.nn``, or one with hooks.
    """
    parts = []
    for name, m in module.named_modules(remove_duplicate=False):
        if not type(m).__module__.startswith("torch.nn.") or isinstance(m, nn.modules.lazy.LazyModuleMixin):
            raise Uncacheable
        attrs = []
        for k, v in vars(m).items():
            if k in _HOOK_FREE:
                continue
            if isinstance(v, dict):
                if v:
                    raise Uncacheable  # a hook, or state the forward may read
                continue
            attrs.append((k, plain(v)))
        tensors = tuple((k, None) if t is None else (k, tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
                        for k, t in (*m._parameters.items(), *m._buffers.items()))
        parts.append((name, type(m), tuple(attrs), tensors))
    return tuple(parts)


@dataclass(frozen=True)
class Out:
    """An output tensor of a memoised node: its layout and where its storage key comes from."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ref: tuple[str, Any]


@dataclass(frozen=True)
class Outcome:
    """A measured node, relative to its inputs, to replay on any node with the same signature."""

    flops_fwd: int
    flops_bwd: int
    grad: bool
    saved: tuple[tuple[tuple[str, Any], int], ...]
    """(storage reference, bytes) of every saved activation, in the order they were saved."""
    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]
    """The output's leaves: :class:`Out` for tensors, the value itself for constants."""
    work: tuple[Any, ...] = ()
    """Backward FLOPs without the input gradient, and the operators of the forward, backward and that backward."""

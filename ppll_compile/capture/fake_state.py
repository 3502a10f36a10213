"""The model's parameters and buffers as fake tensors, swapped in only as far as the nodes being measured need."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree


def storage_id(t: Tensor) -> int:
    """The identity of a tensor's storage: views and in-place results share their base's."""
    return t.untyped_storage()._cdata


_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def on_device(fake: Tensor, device: torch.device) -> Tensor:
    """``fake`` (a fake tensor) standing on ``device`` if it stands on the meta device: a parameter of a model built
    under ``torch.device("meta")``, or a meta example input, measured as if on the device the model would run on
    (a fake tensor holds no data wherever it stands)."""
    if fake.device.type == "meta" and device.type != "meta":
        fake.fake_device = device  # type: ignore[attr-defined]
    return fake


class FakeState:
    """The model's parameters and buffers, swapped for fake tensors as the nodes being run come to need them.

    A ``torch.nn`` leaf module reads only its own parameters and buffers, so only those are swapped before it
    runs; a get_attr node reads one. Anything that could read further (another module, a function from
    outside torch, a constant tensor) first swaps in all of them, as if swapped at the start.
    """

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, stack: contextlib.ExitStack,
                 device: torch.device | None = None):
        self.gm = gm
        self.device = device or torch.device("cpu")  # where a meta parameter's fake stands (the inputs' device)
        self.mode = mode
        self.stack = stack
        self.state = {id(t): t for _, t in (*gm.named_parameters(remove_duplicate=False),
                                            *gm.named_buffers(remove_duplicate=False))}
        self.keys: dict[int, str] = {}  # storage id of live fake values -> storage key
        self.fakes: dict[int, Tensor] = {}  # id of a real parameter or buffer -> its fake
        self.fake_ids: set[int] = set()
        self.storages: set[int] = set()  # storage ids of the fakes
        self.swapped: set[str] = set()  # module paths whose tensors are swapped
        self.all = False

    def fake(self, t: Tensor) -> Tensor:
        """The fake tensor standing for parameter or buffer ``t`` (one per tensor object)."""
        f = self.fakes.get(id(t))
        if f is None:
            f = self.fakes[id(t)] = on_device(self.mode.from_tensor(t), self.device)
            self.fake_ids.add(id(f))
            self.storages.add(storage_id(f))
            self.keys.pop(storage_id(f), None)  # left by a value freed before this storage took its place
        return f

    def known(self, obj: Any) -> bool:
        """Whether ``obj`` is a parameter or buffer of the model, or the fake standing for one."""
        return id(obj) in self.state or id(obj) in self.fake_ids

    def swap_module(self, path: str) -> None:
        """Swap in the fakes of one module's parameters and buffers (its whole subtree)."""
        if self.all or path in self.swapped:
            return
        m = self.gm.get_submodule(path)
        tensors = self._once(m, (*m.named_parameters(remove_duplicate=False),
                                 *m.named_buffers(remove_duplicate=False)))
        self.stack.enter_context(torch.nn.utils.stateless._reparametrize_module(m, tensors))
        self.swapped.add(path)

    def swap_all(self) -> None:
        """Swap in the fakes of every parameter and buffer not swapped yet."""
        if self.all:
            return
        done = tuple(p + "." for p in self.swapped)
        tensors = self._once(self.gm, [(k, t) for k, t in (*self.gm.named_parameters(remove_duplicate=False),
                                                           *self.gm.named_buffers(remove_duplicate=False))
                                       if not k.startswith(done)])
        self.stack.enter_context(torch.nn.utils.stateless._reparametrize_module(self.gm, tensors))
        self.all = True

    def _once(self, root: nn.Module, named: Sequence[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """Fakes for ``named`` tensors, one name per module attribute: a module reached by several paths is
        swapped once (a second swap would keep the first's fake as the original to restore)."""
        seen: set[tuple[int, str]] = set()
        tensors = {}
        for k, t in named:
            owner, _, attr = k.rpartition(".")
            key = (id(root.get_submodule(owner)), attr)
            if key not in seen:
                seen.add(key)
                tensors[k] = self.fake(t)
        return tensors

    def needs_all(self, values: Sequence[Any]) -> bool:
        """Whether a global module hook may run, or an input shares storage with a parameter or buffer."""
        if any(getattr(nn.modules.module, h, None) for h in _GLOBAL_HOOKS):
            return True
        real = {storage_id(t) for t in self.state.values()}
        return any(isinstance(v, Tensor) and storage_id(v) in real for v in pytree.tree_leaves(list(values)))

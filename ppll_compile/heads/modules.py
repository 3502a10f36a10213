"""The modules auxiliary heads are: a plain head, InfoPro's (it reads the raw input), a momentum head (it follows the
next stage's blocks by EMA); the losses they take are :mod:`.losses`."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import PolicyError
from .losses import Loss, task_loss, to_target_length

CIFAR_MEAN = (0.491373, 0.482353, 0.446667)
"""CIFAR's per-channel mean, as InfoPro's code has it (125.3, 123.0, 113.9 over 255): infopro's default ``mean``."""
CIFAR_STD = (0.247059, 0.243529, 0.261569)
"""CIFAR's per-channel standard deviation (63.0, 62.1, 66.7 over 255): infopro's default ``std``."""


class AuxHead(nn.Module):
    """An auxiliary head: ``net`` maps the boundary tensor to logits; :meth:`loss` is the stage's local loss."""

    needs_input: bool = False
    """Whether :meth:`loss` needs the raw model input (InfoPro's reconstruction)."""

    def __init__(self, net: nn.Module, loss: Mapping[str, Any]) -> None:
        super().__init__()
        self.net = net
        self.classification_weight = float(loss["classification_weight"])

    def forward(self, h: Tensor) -> Tensor:
        return self.net(h)

    def loss(self, h: Tensor, target: Tensor, input: Tensor | None = None, *, loss: Loss | None = None,
             regression: Loss | None = None, where: str = "the head") -> Tensor:
        """The weighted local loss of boundary tensor ``h`` for ``target``: ``loss(scores, target)`` when given
        (``aux_loss=``), else the task's loss (:func:`task_loss`, ``regression`` taking every float target, 0/1
        labels included), times ``classification_weight``. A head type may override it as
        ``loss(h, target, input=None)``: the runtime then calls that (with ``loss=`` added only when the trainer has
        an ``aux_loss``)."""
        return self.scored_loss(h, target, input, loss=loss, regression=regression, where=where)[1]

    def scored_loss(self, h: Tensor, target: Tensor, input: Tensor | None = None, *, loss: Loss | None = None,
                    regression: Loss | None = None, where: str = "the head") -> tuple[Tensor, Tensor]:
        """The head's scores for ``h`` and the weighted local loss :meth:`loss` takes of them."""
        scores = self(h)
        if loss is not None:  # the user's aux_loss= reads the head's own scores
            return scores, self.classification_weight * loss(scores, target)
        scores = to_target_length(scores, target)
        return scores, self.classification_weight * task_loss(scores, target, regression, where=where)


class InfoProHead(AuxHead):
    """InfoPro head: a classifier ``net`` plus a ``decoder`` that reconstructs the raw model input from ``h``.

    ``reconstruction='bce'`` (the paper's): the decoder's output goes through a sigmoid and is scored by binary
    cross-entropy against the input de-normalised with ``mean`` and ``std`` (``x * std + mean``, clamped to the
    image range [0, 1]); ``'mse'``: the decoder's raw output is scored by MSE against the input as given.
    """

    needs_input = True

    def __init__(self, net: nn.Module, decoder: nn.Module, loss: Mapping[str, Any], *, reconstruction: str = "bce",
                 mean: Sequence[float] = CIFAR_MEAN, std: Sequence[float] = CIFAR_STD) -> None:
        super().__init__(net, loss)
        self.decoder = decoder
        self.reconstruction_weight = float(loss["reconstruction_weight"])
        self.reconstruction = reconstruction
        self.register_buffer("mean", torch.tensor([float(v) for v in mean]).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor([float(v) for v in std]).view(1, -1, 1, 1), persistent=False)

    def target(self, input: Tensor) -> Tensor:
        """What the decoder reconstructs: the de-normalised image in [0, 1] (``bce``), or the input itself."""
        return input if self.reconstruction == "mse" else (input * self.std + self.mean).clamp(0, 1)

    def reconstruct(self, h: Tensor) -> Tensor:
        """The decoder's reconstruction of the input: the image in [0, 1] (``bce``), or the raw output (``mse``)."""
        out = self.decoder(h)
        return out if self.reconstruction == "mse" else torch.sigmoid(out)

    def reconstruction_loss(self, h: Tensor, input: Tensor) -> Tensor:
        """The unweighted reconstruction term: BCE after the sigmoid (as logits, for stability), or MSE."""
        out = self.decoder(h)
        if self.reconstruction == "mse":
            return F.mse_loss(out, input)
        return F.binary_cross_entropy_with_logits(out, self.target(input))

    def scored_loss(self, h: Tensor, target: Tensor, input: Tensor | None = None, *, loss: Loss | None = None,
                    regression: Loss | None = None, where: str = "the head") -> tuple[Tensor, Tensor]:
        """The scores and the local loss: the weighted reconstruction term plus the weighted task (or ``loss``)
        term."""
        if input is None:
            raise PolicyError("the infopro head reconstructs the raw model input, but loss() got input=None; "
                              "pass the model's first input as input=")
        scores, term = super().scored_loss(h, target, loss=loss, regression=regression, where=where)
        return scores, self.reconstruction_weight * self.reconstruction_loss(h, input) + term


class MomentumHead(AuxHead):
    """MAN (momentum auxiliary network): a ``trunk`` that follows the next stage's first blocks by exponential moving
    average, then the small trained part (pool and one linear layer); ``net`` is the two in order.

    The trunk's weights are buffers: no optimizer sees them, checkpoints save them. Every :attr:`every` steps the
    next stage publishes the parameters named in :attr:`mirrors` and this head calls :meth:`pull` with them.
    """

    def __init__(self, trunk: nn.Module, readout: nn.Module, loss: Mapping[str, Any], *, momentum: float,
                 every: int) -> None:
        super().__init__(nn.Sequential(trunk, readout), loss)
        self.momentum = float(momentum)
        """EMA factor m: ``ema = m * ema + (1 - m) * weight``."""
        self.every = int(every)
        """Steps between two pulls."""
        self.ema_names = frozen_buffers(trunk, prefix="net.0.")
        """The trunk's EMA tensors (buffers of this head), in the order of :attr:`mirrors`."""
        self.mirrors: list[str] = []
        """Names, in the next stage module's ``named_parameters()``, of the parameters the EMA tensors follow (set by
        lowering; empty for a head built alone)."""

    @property
    def trunk(self) -> nn.Module:
        return self.net[0]

    def ema_tensors(self) -> list[Tensor]:
        """The trunk's EMA tensors, in the order of :attr:`mirrors`."""
        return [self.get_buffer(n) for n in self.ema_names]

    def ema_bytes(self) -> int:
        """Bytes of the EMA tensors: what the next stage sends back at every pull."""
        return sum(t.numel() * t.element_size() for t in self.ema_tensors())

    @torch.no_grad()
    def pull(self, tensors: Sequence[Tensor]) -> None:
        """One EMA step towards ``tensors`` (the next stage's current :attr:`mirrors`, in order):
        ``ema = m * ema + (1 - m) * t`` for each."""
        ema = self.ema_tensors()
        if len(tensors) != len(ema):
            raise ValueError(f"pull() got {len(tensors)} tensor(s), but the momentum head follows {len(ema)} "
                             f"(its mirrors, in order)")
        for e, t in zip(ema, tensors):
            e.mul_(self.momentum).add_(t.to(e.device), alpha=1 - self.momentum)


def head_loss(head: nn.Module, h: Tensor, target: Tensor, input: Tensor | None = None, *,
              loss: Loss | None = None, regression: Loss | None = None, where: str = "the head") -> Tensor:
    """The local loss of any head: :meth:`AuxHead.loss`, or, for a user's module, ``loss(scores, target)``
    (``aux_loss=``) or :func:`task_loss` of its scores."""
    return head_scored_loss(head, h, target, input, loss=loss, regression=regression, where=where)[1]


def head_scored_loss(head: nn.Module, h: Tensor, target: Tensor, input: Tensor | None = None, *,
                     loss: Loss | None = None, regression: Loss | None = None,
                     where: str = "the head") -> tuple[Any, Tensor]:
    """A head's scores for ``h`` and its local loss (see :func:`head_loss`); the scores are ``None`` for a head type
    that defines its own :meth:`AuxHead.loss`, called as ``head.loss(h, target, input)`` (plus ``loss=`` when given)."""
    if isinstance(head, AuxHead):
        if type(head).loss is AuxHead.loss:
            return head.scored_loss(h, target, input, loss=loss, regression=regression, where=where)
        return None, head.loss(h, target, input, **({"loss": loss} if loss is not None else {}))
    scores = head(h)
    return scores, loss(scores, target) if loss is not None else task_loss(scores, target, regression, where=where)


def frozen_buffers(module: nn.Module, prefix: str = "") -> list[str]:
    """Turn every parameter of ``module`` into a buffer (weights shared inside it stay shared); the buffers' names,
    each parameter once, in ``module.named_parameters()`` order, with ``prefix``."""
    names = [prefix + n for n, _ in module.named_parameters()]
    tensors: dict[int, Tensor] = {}
    for m in module.modules():
        for leaf, p in list(m._parameters.items()):
            if p is not None:
                t = tensors.setdefault(id(p), p.detach())
                del m._parameters[leaf]
                m.register_buffer(leaf, t)
    return names


def meta_copies(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Deep copies of ``modules`` on the meta device (their tensors are not copied, so this is cheap)."""
    memo: dict[int, Any] = {}
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            if id(t) not in memo:
                fake = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return list(copy.deepcopy(list(modules), memo))

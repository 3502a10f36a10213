"""Auxiliary heads: the modules a head config describes, their local loss, and their counted cost.

Two head types build on the model's own blocks: ``transformer`` with ``init: copy`` starts from copies of the
blocks that follow its cut, and ``momentum`` (MAN) keeps an exponential moving average of them. Building those
needs the blocks (``blocks=``, found by :func:`ppll_compile.lower.next_blocks` when lowering). Planning costs a head
on the meta device: given the blocks it costs meta copies of them, exactly; without them (as :func:`head_spec` is
called while planning today) it costs a stand-in of the same shape where the blocks are the usual kind: fresh
pre-norm transformer blocks of the config's ``heads`` and ``mlp_ratio`` on sequences (the parameter shapes of a timm,
torchvision or Hugging Face ViT block of that MLP ratio), and a residual block's two conv3x3-BN layers at the input's
channels on feature maps (a ResNet basic block that keeps its width). A block of another shape (a bottleneck, a
downsampling block) is then costed as that stand-in, not as itself.
"""

from __future__ import annotations

import copy
import dataclasses
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cost import OPTIMIZER_STATES, ModuleCost, measure_module
from .errors import PolicyError
from .phases import phase
from .plan import HeadSpec, TensorSpec, format_bytes
from .policy import CIFAR_MEAN, CIFAR_STD, Policy, check_head_config, tensor_kind

__all__ = ["AuxHead", "InfoProHead", "MomentumHead", "head_loss", "model_loss", "logits_of", "build_head",
           "make_head", "head_for", "head_spec", "counted_head", "model_head", "copied_blocks", "stage_head",
           "stage_weights",
           "head_notes", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""Label of a position no loss is taken on (padding, a prompt, the last token of a causal LM), as in torch."""


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

    def loss(self, h: Tensor, target: Tensor, input: Tensor | None = None) -> Tensor:
        """The weighted local loss of boundary tensor ``h`` for class labels ``target``: N labels, or N x L
        per-token labels for a per-token head's N x L x C scores (:data:`IGNORE_INDEX` counts for nothing)."""
        return self.classification_weight * _cross_entropy(self(h), target)


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

    def loss(self, h: Tensor, target: Tensor, input: Tensor | None = None) -> Tensor:
        if input is None:
            raise PolicyError("the infopro head reconstructs the raw model input, but loss() got input=None; "
                              "pass the model's first input as input=")
        return self.reconstruction_weight * self.reconstruction_loss(h, input) + super().loss(h, target)


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
        self.ema_names = _as_buffers(trunk, prefix="net.0.")
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


def logits_of(output: Any) -> Any:
    """The class scores in a model's output: the tensor itself, an output object's or dict's ``logits``, or the
    first tensor of a tuple or list (e.g. a Hugging Face ``ModelOutput`` or ``return_dict=False`` tuple)."""
    if isinstance(output, Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, (tuple, list)):
        return next((v for v in output if isinstance(v, Tensor)), output)
    return output


def _cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of N x C scores for N labels, or of N x L x C scores for N x L labels (per token);
    positions labelled :data:`IGNORE_INDEX` count for nothing."""
    if logits.dim() == 3 and target.dim() == 2:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def model_loss(output: Any, target: Tensor) -> Tensor:
    """The default loss of the last stage: cross-entropy of the model's class scores (:func:`logits_of`),
    per example or per token."""
    return _cross_entropy(logits_of(output), target)


def head_loss(head: nn.Module, h: Tensor, target: Tensor, input: Tensor | None = None) -> Tensor:
    """The local loss of any head: :meth:`AuxHead.loss`, or cross-entropy of the scores of a user's module."""
    if isinstance(head, AuxHead):
        return head.loss(h, target, input)
    return _cross_entropy(head(h), target)


_POOL_DIMS = {"feature_map": (2, 3), "channels_last": (1, 2), "sequence": (1,)}


class _Pool(nn.Module):
    """Reduce a feature map (over H x W, either layout) or a sequence (over tokens) to one vector per sample."""

    def __init__(self, kind: str, pool: str = "mean") -> None:
        super().__init__()
        self.kind, self.pool = kind, pool

    def forward(self, x: Tensor) -> Tensor:
        if self.pool == "cls":
            return x[:, 0]
        return x.mean(dim=_POOL_DIMS[self.kind])

    def extra_repr(self) -> str:
        return f"kind={self.kind}, pool={self.pool}"


class _ChannelsFirst(nn.Module):
    """An N x H x W x C map as N x C x H x W (a view; convolutions take its channels-last strides as they are)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(0, 3, 1, 2)


def _mlp(features: int, hidden: int, depth: int, num_classes: int) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(features, hidden), nn.ReLU()]
        features = hidden
    return [*layers, nn.Linear(features, num_classes)]


def _conv_bn_relu(cin: int, cout: int, kernel: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


def _conv_net(o: Mapping, kind: str, shape: Sequence[int], num_classes: int) -> nn.Module:
    first = [_ChannelsFirst()] if kind == "channels_last" else []
    channels = shape[3] if kind == "channels_last" else shape[1]
    width = o["width"] or channels
    width, layers = min(width, o["max_width"]) if o["max_width"] else width, []
    for _ in range(o["depth"]):
        layers += _conv_bn_relu(channels, width, 3)
        channels = width
    return nn.Sequential(*first, *layers, nn.AdaptiveAvgPool2d(o["pool"]), nn.Flatten(),
                         *_mlp(channels * o["pool"] ** 2, o["hidden"], 1 if o["hidden"] else 0, num_classes))


def _mlp_net(o: Mapping, kind: str, shape: Sequence[int], num_classes: int) -> nn.Module:
    pool = [] if kind == "vector" else [_Pool(kind)]
    features = shape[1] if kind == "feature_map" else shape[-1]
    return nn.Sequential(*pool, *_mlp(features, o["hidden"], o["depth"], num_classes))


def _token_net(o: Mapping, kind: str, shape: Sequence[int], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(shape[-1]), _Pool(kind, o["pool"]), nn.Linear(shape[-1], num_classes))


def _lm_net(o: Mapping, kind: str, shape: Sequence[int], num_classes: int) -> nn.Module:
    """Per-token scores N x L x C: LayerNorm(D), then Linear(D, C), or Linear(D, r, no bias) and Linear(r, C)."""
    d, r = shape[-1], o["rank"]
    project = [nn.Linear(d, r, bias=False), nn.Linear(r, num_classes)] if r else [nn.Linear(d, num_classes)]
    return nn.Sequential(nn.LayerNorm(d), *project)


def _infopro_nets(o: Mapping, shape: Sequence[int], num_classes: int,
                  input_shape: Sequence[int] | None) -> tuple[nn.Module, nn.Module]:
    """The paper's "1c2f" classifier (conv3x3-BN-ReLU, average pool, Linear-ReLU-Linear) and its decoder (upsample to
    the image, conv3x3-BN-ReLU, conv3x3 to the image's channels)."""
    if input_shape is None or len(input_shape) != 4:
        raise PolicyError(f"head type 'infopro' reconstructs the model input, which must be an image batch "
                          f"N x C x H x W, got input shape {None if input_shape is None else tuple(input_shape)}; "
                          f"pass input_shape, or use a policy without infopro heads (e.g. 'dgl')")
    c = shape[1]
    width, stride = o["cls_width"] or min(2 * c, 64), o["cls_stride"] or (2 if c < 64 else 1)
    classifier = nn.Sequential(nn.Conv2d(c, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU(), _Pool("feature_map"), *_mlp(width, o["hidden"], 1, num_classes))
    bilinear = o["upsample"] == "bilinear"
    decoder = nn.Sequential(nn.Upsample(size=tuple(input_shape[2:]), mode=o["upsample"],
                                        align_corners=True if bilinear else None),
                            nn.Conv2d(c, o["width"], 3, padding=1), nn.BatchNorm2d(o["width"]), nn.ReLU(),
                            nn.Conv2d(o["width"], input_shape[1], 3, padding=1))
    return classifier, decoder


def _check_stats(o: Mapping, input_shape: Sequence[int]) -> None:
    """``mean`` and ``std`` must fit the input's channels (one value each, or one per channel)."""
    channels = input_shape[1]
    if o["reconstruction"] != "bce" or all(len(o[k]) in (1, channels) for k in ("mean", "std")):
        return
    given = "CIFAR's, the default" if (tuple(o["mean"]), tuple(o["std"])) == (CIFAR_MEAN, CIFAR_STD) else "as given"
    values = "one value each" if channels == 1 else f"1 or {channels} values each"
    raise PolicyError(f"head type 'infopro' de-normalises the input with mean {list(o['mean'])} and std "
                      f"{list(o['std'])} ({given}), but the input has {channels} channel(s) (shape "
                      f"{tuple(input_shape)}); give mean: and std: with {values}, the normalisation of your data, or "
                      f"use reconstruction: mse")


def _infopro_head(o: Mapping, shape: Sequence[int], num_classes: int, input_shape: Sequence[int] | None,
                  loss: Mapping[str, Any]) -> InfoProHead:
    net, decoder = _infopro_nets(o, shape, num_classes, input_shape)
    _check_stats(o, input_shape)  # type: ignore[arg-type]  # an image shape, checked above
    return InfoProHead(net, decoder, loss, reconstruction=o["reconstruction"], mean=o["mean"], std=o["std"])


class _Blocks(nn.Module):
    """Blocks run in order on one tensor; a block that returns a tuple or an output object (as some Hugging Face
    layers do) passes its first tensor on."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = _first_tensor(block(x))
        return x


def _first_tensor(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    values = out.values() if isinstance(out, Mapping) else out
    return next(v for v in values if isinstance(v, Tensor))


def _attention_heads(width: int, heads: int = 0) -> int:
    """The attention heads of a fresh block of ``width`` D: ``heads`` (which must divide D), or for 0 one per 64
    channels (ViT's head size), lowered to a divisor of D."""
    if heads:
        if width % heads:
            near = sorted(sorted((h for h in range(1, width + 1) if width % h == 0), key=lambda h: abs(h - heads))[:2])
            raise PolicyError(f"head config: heads {heads} does not divide the boundary's width D = {width}; use a "
                              f"divisor of {width} (e.g. {' or '.join(map(str, near))}) or heads: 0 to choose one")
        return heads
    h = max(1, width // 64)
    while width % h:
        h -= 1
    return h


def _fresh_blocks(o: Mapping, width: int) -> list[nn.Module]:
    """``depth`` new pre-norm transformer blocks of ``width`` D (GELU, MLP ``mlp_ratio`` x D, no dropout)."""
    heads = _attention_heads(width, o.get("heads", 0))
    ff = max(1, int(o.get("mlp_ratio", 4.0) * width))  # as timm and torchvision round it
    return [nn.TransformerEncoderLayer(width, heads, dim_feedforward=ff, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(o["depth"])]


class _BasicBlock(nn.Module):
    """The stand-in of a convolutional block while planning: conv3x3-BN-ReLU, conv3x3-BN, plus the input, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn_relu(channels, channels, 3), nn.Conv2d(channels, channels, 3, padding=1,
                                                                                  bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.body(x) + x)


def _stand_in(o: Mapping, kind: str, shape: Sequence[int]) -> list[nn.Module]:
    """Blocks of the usual shape for copied ones that are not at hand (see the module's docstring)."""
    if kind == "sequence":
        return _fresh_blocks(o, shape[-1])
    return [_BasicBlock(shape[1]) for _ in range(o["depth"])]


def _copies(blocks: Sequence[nn.Module] | None, o: Mapping, kind: str, shape: Sequence[int]) -> list[nn.Module]:
    """Independent deep copies of the model's ``blocks`` (their stand-ins where none are given)."""
    if blocks is None:
        return _stand_in(o, kind, shape)
    if len(blocks) != o["depth"]:
        raise PolicyError(f"head config asks for depth {o['depth']}, but {len(blocks)} block(s) were given to copy; "
                          f"pass the {o['depth']} blocks after the cut")
    return list(copy.deepcopy(list(blocks)))  # one deepcopy: weights the blocks share stay shared


def _out_shape(trunk: nn.Module, shape: Sequence[int], what: str, way_out: str) -> tuple[int, ...]:
    """The shape of ``trunk``'s output on a boundary of ``shape``, run on a meta copy (so nothing is computed)."""
    probe = _meta_copies([trunk])[0].eval()
    try:
        with torch.no_grad():
            out = probe(torch.empty((2, *shape[1:]), device="meta"))
    except Exception as e:  # noqa: BLE001 - any failure of the user's blocks is reported as the policy's
        raise PolicyError(f"{what}: the copied blocks cannot run on the boundary tensor of shape {tuple(shape)} "
                          f"alone ({type(e).__name__}: {e}); {way_out}") from None
    return tuple(out.shape)


def _transformer_head(o: Mapping, kind: str, shape: Sequence[int], num_classes: int,
                      blocks: Sequence[nn.Module] | None, loss: Mapping[str, Any]) -> AuxHead:
    """``depth`` transformer blocks (fresh, or copies of the next ones), LayerNorm, pool (CLS or mean), linear."""
    d = shape[-1]
    trunk = _copies(blocks, o, kind, shape) if o["init"] == "copy" else _fresh_blocks(o, d)
    if o["init"] == "copy" and blocks is not None:
        d = _out_shape(_Blocks(trunk), shape, "head type 'transformer' (init: copy)", "use init: fresh")[-1]
    return AuxHead(nn.Sequential(_Blocks(trunk), nn.LayerNorm(d), _Pool(kind, o["pool"]), nn.Linear(d, num_classes)),
                   loss)


def _momentum_head(o: Mapping, kind: str, shape: Sequence[int], num_classes: int,
                   blocks: Sequence[nn.Module] | None, loss: Mapping[str, Any]) -> MomentumHead:
    """An EMA trunk of copies of the next ``depth`` blocks, then pool and one trained linear layer."""
    trunk = _Blocks(_copies(blocks, o, kind, shape))
    out = _out_shape(trunk, shape, "head type 'momentum'", "use another head type") if blocks is not None else shape
    readout = nn.Sequential(_Pool(kind, o["pool"]), nn.Linear(out[1] if kind == "feature_map" else out[-1],
                                                               num_classes))
    return MomentumHead(trunk, readout, loss, momentum=o["momentum"], every=o["every"])


def _as_buffers(module: nn.Module, prefix: str = "") -> list[str]:
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


def _meta_copies(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Deep copies of ``modules`` on the meta device (their tensors are not copied, so this is cheap)."""
    memo: dict[int, Any] = {}
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            if id(t) not in memo:
                fake = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return list(copy.deepcopy(list(modules), memo))


def copied_blocks(config: Mapping[str, Any]) -> int:
    """How many of the model's blocks after its cut a head config copies or follows (0: none, the head stands alone)."""
    if config.get("type") == "momentum" or (config.get("type") == "transformer" and config.get("init") == "copy"):
        return int(config.get("depth", 1))
    return 0


_NETS = {"conv": _conv_net, "mlp": _mlp_net, "token": _token_net, "lm": _lm_net}


def build_head(config: Mapping[str, Any], spec: TensorSpec, num_classes: int,
               input_shape: Sequence[int] | None = None, *, per_token: bool = False,
               blocks: Sequence[nn.Module] | None = None) -> AuxHead:
    """Build the head a config from :meth:`Policy.config_for` (or a hand-edited plan) describes for ``spec``;
    ``per_token``: the labels are one class per token (N x L), so the config must give N x L x C scores.
    ``blocks``: the model's blocks after the cut, for a head that copies or follows them (see :func:`copied_blocks`;
    without them such a head gets stand-ins of the usual shape, see the module's docstring)."""
    options, loss = check_head_config(config, spec, per_token)
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise PolicyError(f"num_classes must be an integer >= 1, got {reprlib.repr(num_classes)}")
    kind = tensor_kind(spec)
    if options["type"] == "infopro":
        return _infopro_head(options, spec.shape, num_classes, input_shape, loss)
    if options["type"] == "transformer":
        return _transformer_head(options, kind, spec.shape, num_classes, blocks, loss)
    if options["type"] == "momentum":
        return _momentum_head(options, kind, spec.shape, num_classes, blocks, loss)
    return AuxHead(_NETS[options["type"]](options, kind, spec.shape, num_classes), loss)


def make_head(policy: Policy, spec: TensorSpec, num_classes: int, input_shape: Sequence[int] | None = None, *,
              per_token: bool = False, blocks: Sequence[nn.Module] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The head ``policy`` gives boundary ``spec``, and its config (``{"type": "callable", ...}`` for callables);
    ``per_token``: for labels of one class per token (a callable is called as always and must then give
    N x L x C scores); ``blocks``: see :func:`build_head`."""
    config = policy.config_for(spec, per_token=per_token)
    if policy.builder is None:
        return build_head(config, spec, num_classes, input_shape, per_token=per_token, blocks=blocks), config
    head = policy.builder(spec, num_classes)
    if not isinstance(head, nn.Module):
        scores = f"per-token scores N x L x {num_classes}" if per_token else f"logits N x {num_classes}"
        raise PolicyError(f"policy callable {policy.name!r} returned {reprlib.repr(head)} for boundary {spec.name!r}; "
                          f"it must return an nn.Module mapping a tensor of shape {tuple(spec.shape)} to {scores}")
    return head, config


def head_for(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
             input_shape: Sequence[int] | None, *, per_token: bool = False,
             blocks: Sequence[nn.Module] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The head for a boundary: the policy's choice (``config`` None), a callable policy's, or a given config;
    ``per_token``: for labels of one class per token; ``blocks``: see :func:`build_head`."""
    if config is None or config.get("type") == "callable":
        return make_head(policy, spec, num_classes, input_shape, per_token=per_token, blocks=blocks)
    return build_head(config, spec, num_classes, input_shape, per_token=per_token, blocks=blocks), dict(config)


def head_spec(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
              input_shape: Sequence[int] | None, optimizer: str, *, per_token: bool = False,
              blocks: Sequence[nn.Module] | None = None) -> HeadSpec:
    """The head for a boundary, built on the meta device and counted like the backbone (FLOPs and memory), its
    loss taken on labels of one class per example, or per token (N x L) with ``per_token``. ``blocks``: the model's
    blocks after the cut, for a head that copies or follows them (costed as meta copies of them; without them, as
    stand-ins of the usual shape: see the module's docstring)."""
    return counted_head(policy, config, spec, num_classes, input_shape, optimizer, per_token=per_token,
                        blocks=blocks)[0]


def counted_head(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
                 input_shape: Sequence[int] | None, optimizer: str, *, per_token: bool = False,
                 blocks: Sequence[nn.Module] | None = None) -> tuple[HeadSpec, ModuleCost]:
    """:func:`head_spec`, and the head's measured cost (its operators, for the roofline)."""
    with phase("heads"):
        return _counted_head(policy, config, spec, num_classes, input_shape, optimizer, per_token, blocks)


def _counted_head(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
                  input_shape: Sequence[int] | None, optimizer: str, per_token: bool,
                  blocks: Sequence[nn.Module] | None) -> tuple[HeadSpec, ModuleCost]:
    fakes = _meta_copies(blocks) if blocks is not None else None
    with torch.device("meta"):
        head, config = head_for(policy, config, spec, num_classes, input_shape, per_token=per_token, blocks=fakes)
        head = head.to("meta")
        h = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
        y = torch.zeros(tuple(spec.shape[:2]) if per_token else spec.shape[0], dtype=torch.long)
        x = torch.empty(input_shape) if input_shape is not None else None
    h.requires_grad_(True)  # the stage's backward runs through the head into its output
    extra = 0
    if isinstance(head, MomentumHead):  # its trunk is not trained; its EMA weights are kept
        extra = head.ema_bytes()
        config = {**config, "mirror_bytes": extra}
    cost = measure_module(head, lambda: head_loss(head, h, y, x), inputs=(h,))
    pbytes = sum(p.numel() * p.element_size() for p in head.parameters())
    memory = pbytes * (2 + OPTIMIZER_STATES[optimizer]) + cost.activation_bytes + extra
    return HeadSpec(policy=policy.name, kind=_kind_text(spec), config=dict(config),
                    param_count=cost.param_count, flops_fwd=cost.flops_fwd, flops_bwd=cost.flops_bwd,
                    memory_bytes=memory, input_saved_bytes=cost.input_saved_bytes), cost


def stage_weights(ramp: Sequence[float], stage: int, stages: int) -> float:
    """A loss weight interpolated linearly over the auxiliary heads, as InfoPro's code does: ``ramp[0]`` at stage 0,
    ``ramp[1]`` at the last head (stage ``stages - 2``); with one head (2 stages), ``ramp[0]``."""
    r = stage / (stages - 2) if stages > 2 else 0.0
    return ramp[0] * (1 - r) + ramp[1] * r


def stage_head(head: HeadSpec, stage: int, stages: int) -> HeadSpec:
    """The head of stage ``stage`` of ``stages``: an infopro head's loss weights there (``lambda1`` for the
    reconstruction, ``lambda2`` for the classification, see :func:`stage_weights`) written into its config's loss
    section, which the head is built from; any other head as it is."""
    c = head.config
    if c.get("type") != "infopro" or "lambda1" not in c or "lambda2" not in c:
        return head  # a saved plan from before the ramps keeps its fixed weights
    loss = {**dict(c.get("loss", {})), "reconstruction_weight": stage_weights(c["lambda1"], stage, stages),
            "classification_weight": stage_weights(c["lambda2"], stage, stages)}
    return dataclasses.replace(head, config={**dict(c), "loss": loss})


def head_notes(head: HeadSpec, stage: int, link_bandwidth: float) -> list[str]:
    """What the plan should say about stage ``stage``'s head: a momentum head's weight transfers."""
    c = head.config
    if c.get("type") != "momentum":
        return []
    size, every = int(c.get("mirror_bytes", 0)), int(c.get("every", 1))
    return [f"stage {stage}'s momentum head follows stage {stage + 1}'s first {c.get('depth', 1)} block(s) by EMA "
            f"(momentum {c.get('momentum')}): stage {stage + 1} sends their weights, {format_bytes(size)}, back every "
            f"{every} step(s) ({format_bytes(size / every)} per step, {size / link_bandwidth * 1e3:.3g} ms a "
            f"transfer at the link bandwidth), outside the stage costs"]


def _kind_text(spec: TensorSpec) -> str:
    """The boundary's tensor kind, or its rank (``5-D``) where only a callable policy's head reads it."""
    try:
        return tensor_kind(spec)
    except PolicyError:
        return f"{len(spec.shape)}-D"


def model_head() -> HeadSpec:
    """The last stage's head: the model's own output under the trainer's loss."""
    return HeadSpec(policy="model", kind="model", config={"type": "model", "loss": "cross_entropy"})

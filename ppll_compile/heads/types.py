"""Head types: the one table that says, per type, its options, how it is built, and what it needs (the raw input,
the blocks after its cut, the runtime's help, per-stage loss weights); read by policies, heads, lowering and pipelines.

A new type is one :func:`register_head_type` call (here for a built-in one) with a :class:`HeadType`; nothing else
names it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cost.hardware import LARGEST_DEVICE, LARGEST_DEVICE_BYTES
from ..errors import PolicyError
from ..plans.units import format_bytes
from .modules import CIFAR_MEAN, CIFAR_STD, AuxHead, InfoProHead, MomentumHead, meta_copies
from .output import output_layers, projection_head
from .registry import (
    MAX_DEPTH,
    MAX_EVERY,
    MAX_SIDE,
    MAX_WIDTH,
    BlockUse,
    HeadRequest,
    HeadType,
    bounded,
    bounded_number,
    head_type,
    head_type_for,
    head_type_names,
    register_head_type,
    unregister_head_type,
)
from .schema import choice, fraction, per_channel, ramp

__all__ = ["HeadType", "HeadRequest", "BlockUse", "register_head_type", "unregister_head_type", "head_type",
           "head_type_for", "head_type_names"]

KINDS = ("feature_map", "channels_last", "sequence", "vector")
"""The boundary tensor kinds a head type may read: N x C x H x W, N x H x W x C, N x L x D, N x D."""


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


def _output_head(r: HeadRequest) -> AuxHead:
    """An optional trained adapter, then frozen copies of the model's final norm and output projection."""
    return projection_head(r.options, r.shape, r.num_classes, r.loss, r.blocks)


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


def _infopro_head(r: HeadRequest) -> InfoProHead:
    o = r.options
    net, decoder = _infopro_nets(o, r.shape, r.num_classes, r.input_shape)
    _check_stats(o, r.input_shape)  # type: ignore[arg-type]  # an image shape, checked above
    return _fitting(InfoProHead(net, decoder, r.loss, reconstruction=o["reconstruction"], mean=o["mean"],
                                std=o["std"]), r)


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
    probe = meta_copies([trunk])[0].eval()
    try:
        with torch.no_grad():
            out = probe(torch.empty((2, *shape[1:]), device="meta"))
    except Exception as e:  # noqa: BLE001 - any failure of the user's blocks is reported as the policy's
        raise PolicyError(f"{what}: the copied blocks cannot run on the boundary tensor of shape {tuple(shape)} "
                          f"alone ({type(e).__name__}: {e}); {way_out}") from None
    return tuple(out.shape)


def _transformer_head(r: HeadRequest) -> AuxHead:
    """``depth`` transformer blocks (fresh, or copies of the next ones), LayerNorm, pool (CLS or mean), linear."""
    o, d = r.options, r.shape[-1]
    trunk = _copies(r.blocks, o, r.kind, r.shape) if o["init"] == "copy" else _fresh_blocks(o, d)
    if o["init"] == "copy" and r.blocks is not None:
        d = _out_shape(_Blocks(trunk), r.shape, "head type 'transformer' (init: copy)", "use init: fresh")[-1]
    return _fitting(AuxHead(nn.Sequential(_Blocks(trunk), nn.LayerNorm(d), _Pool(r.kind, o["pool"]),
                                          nn.Linear(d, r.num_classes)), r.loss), r)


def _momentum_head(r: HeadRequest) -> MomentumHead:
    """An EMA trunk of copies of the next ``depth`` blocks, then pool and one trained linear layer."""
    o, kind, shape = r.options, r.kind, r.shape
    trunk = _Blocks(_copies(r.blocks, o, kind, shape))
    out = _out_shape(trunk, shape, "head type 'momentum'", "use another head type") if r.blocks is not None else shape
    readout = nn.Sequential(_Pool(kind, o["pool"]), nn.Linear(out[1] if kind == "feature_map" else out[-1],
                                                               r.num_classes))
    return MomentumHead(trunk, readout, r.loss, momentum=o["momentum"], every=o["every"])


def _plain(net: Any) -> Any:
    """The builder of a head that is ``net(options, kind, shape, num_classes)`` under the plain local loss."""
    return lambda r: _fitting(AuxHead(net(r.options, r.kind, r.shape, r.num_classes), r.loss), r)


def _fitting(head: AuxHead, r: HeadRequest) -> AuxHead:
    """``head``, unless its float32 parameters exceed the largest device's memory (planning builds it on the meta
    device, so nothing is allocated before this check)."""
    count = sum(p.numel() for p in head.parameters())
    if 4 * count > LARGEST_DEVICE_BYTES:
        raise PolicyError(f"head type {r.options['type']!r} on the boundary of shape {tuple(r.shape)} has {count:,} "
                          f"parameters, {format_bytes(4 * count)} in float32, more than the "
                          f"{format_bytes(LARGEST_DEVICE_BYTES)} of the largest device ({LARGEST_DEVICE}); make it "
                          f"narrower or shallower")
    return head


def stage_weights(ramp: Sequence[float], stage: int, stages: int) -> float:
    """A loss weight interpolated linearly over the auxiliary heads, as InfoPro's code does: ``ramp[0]`` at stage 0,
    ``ramp[1]`` at the last head (stage ``stages - 2``); with one head (2 stages), ``ramp[0]``."""
    r = stage / (stages - 2) if stages > 2 else 0.0
    return ramp[0] * (1 - r) + ramp[1] * r


def _infopro_loss(c: Mapping[str, Any], stage: int, stages: int) -> dict[str, float] | None:
    """``lambda1`` (reconstruction) and ``lambda2`` (classification) at stage ``stage``; None for a saved plan from
    before the ramps, which keeps its fixed weights."""
    if "lambda1" not in c or "lambda2" not in c:
        return None
    return {"reconstruction_weight": stage_weights(c["lambda1"], stage, stages),
            "classification_weight": stage_weights(c["lambda2"], stage, stages)}


def _momentum_notes(c: Mapping[str, Any], stage: int, link_bandwidth: float) -> list[str]:
    size, every = int(c.get("mirror_bytes", 0)), int(c.get("every", 1))
    return [f"stage {stage}'s momentum head follows stage {stage + 1}'s first {c.get('depth', 1)} block(s) by EMA "
            f"(momentum {c.get('momentum')}): stage {stage + 1} sends their weights, {format_bytes(size)}, back every "
            f"{every} step(s) ({format_bytes(size / every)} per step, {size / link_bandwidth * 1e3:.3g} ms a "
            f"transfer at the link bandwidth), outside the stage costs"]


def _width(default: int, low: int = 0) -> Any:
    return bounded(default, low, MAX_WIDTH, "a width x width layer this wide holds 4 TiB of parameters")


def _depth(default: int, low: int = 0) -> Any:
    return bounded(default, low, MAX_DEPTH, "deeper than ResNet-1001's trunk")


def _side(default: int, low: int = 0) -> Any:
    return bounded(default, low, MAX_SIDE, "more than the side of any map a head reads")


def _linears(features: int, hidden: int, depth: int) -> int:
    """Parameters of ``depth`` Linear(hidden) layers from ``features`` inputs and the last Linear to one class."""
    total = 0
    for _ in range(depth):
        total, features = total + features * hidden + hidden, hidden
    return total + features + 1


def _conv_least(o: Mapping[str, Any]) -> int:
    """A conv head's parameters on a one-channel boundary, for one class."""
    width = o["width"] or 1
    width = min(width, o["max_width"]) if o["max_width"] else width
    convs = (o["depth"] > 0) * (9 * width + 2 * width) + max(o["depth"] - 1, 0) * (9 * width * width + 2 * width)
    features = (width if o["depth"] else 1) * o["pool"] ** 2
    return convs + _linears(features, o["hidden"], 1 if o["hidden"] else 0)


def _infopro_least(o: Mapping[str, Any]) -> int:
    """An InfoPro head's parameters on a one-channel boundary of a one-channel image, for one class."""
    cls = o["cls_width"] or 2
    return 11 * cls + _linears(cls, o["hidden"], 1) + 12 * o["width"] + 9 * o["width"] + 1


def _mlp_least(o: Mapping[str, Any]) -> int:
    """An MLP head's parameters on a one-feature boundary, for one class."""
    return _linears(1, o["hidden"], o["depth"])


def _transformer_least(o: Mapping[str, Any]) -> int:
    """A fresh transformer head's parameters on the narrowest boundary its ``heads`` divides (copies: 0, the
    model's own blocks)."""
    if o["init"] == "copy":
        return 0
    d = max(1, o["heads"])
    ff = max(1, int(o["mlp_ratio"] * d))
    return o["depth"] * (4 * d * d + 4 * d + 2 * d * ff + ff + d + 4 * d) + 2 * d + d + 1


BUILT_IN = tuple(register_head_type(t).name for t in (
    HeadType(name="conv", kinds=("feature_map", "channels_last"), build=_plain(_conv_net), options={
        # channels_last: permuted to N x C x H x W first
        "width": _width(128),        # channels of each conv3x3 layer; 0 = the input's channels
        "max_width": _width(0),      # cap on those channels; 0 = no cap
        "depth": _depth(1),          # conv3x3-BN-ReLU layers: 0 (pool + linear only), 1, 2 (DGL), 3, 4, ...
        "pool": _side(2, 1),         # adaptive average pool output size
        "hidden": _width(0),         # MLP hidden width after pooling; 0 = one linear layer
    }, least_params=_conv_least),
    HeadType(name="infopro", kinds=("feature_map",), build=_infopro_head, needs_input=True, stage_loss=_infopro_loss,
             least_params=_infopro_least, options={  # InfoPro (Wang et al., ICLR 2021), as its code builds it
        "width": _width(12, 1),      # decoder: upsample to the image, conv3x3 to `width`, BN, ReLU, conv3x3 to it
        "upsample": choice("bilinear", "bilinear", "nearest"),  # the decoder's first layer (bilinear: align_corners)
        "reconstruction": choice("bce", "bce", "mse"),  # bce: sigmoid + BCE against the de-normalised input;
        #                              mse: MSE of the decoder's raw output against the input as given
        "mean": per_channel(CIFAR_MEAN),         # the input's normalisation, undone for bce: x * std + mean
        "std": per_channel(CIFAR_STD, positive=True),
        "lambda1": ramp((5.0, 0.5)),  # reconstruction weight at the first and the last auxiliary head
        "lambda2": ramp((0.5, 1.0)),  # classification weight at the first and the last auxiliary head
        "cls_width": _width(0),      # classifier conv3x3 channels; 0 = the paper's: twice the input's, at most 64
        "cls_stride": _side(0),      # its stride; 0 = the paper's: 2 on maps of under 64 channels, else 1
        "hidden": _width(128, 1),    # classifier MLP hidden width (the paper's feature_dim)
    }),
    HeadType(name="mlp", kinds=KINDS, build=_plain(_mlp_net), options={
        "hidden": _width(256, 1),    # width of each hidden layer
        "depth": _depth(1),          # hidden Linear-ReLU layers
    }, least_params=_mlp_least),
    HeadType(name="momentum", kinds=("feature_map", "sequence"), build=_momentum_head, follows_next=True,
             blocks=BlockUse(depth=lambda c: int(c.get("depth", 1)), verb="follows",
                             way_out="a momentum head needs blocks of a ModuleList or Sequential right after its cut; "
                                     "use another head type"),
             notes=_momentum_notes, options={  # MAN: an EMA of the next stage's first blocks
        "depth": _depth(1, 1),       # blocks of the next stage the trunk follows (not trained by gradient)
        "momentum": fraction(0.99),  # ema = momentum * ema + (1 - momentum) * next stage's weights
        # steps between two weight transfers from the next stage
        "every": bounded(1, 1, MAX_EVERY, "more steps than a training run takes"),
        "pool": choice("mean", "cls", "mean"),  # then pool (CLS token or mean) and one trained linear layer
    }, fixed={"feature_map": {"pool": "mean"}}, derived={
        "mirror_bytes": bounded(0, 0, LARGEST_DEVICE_BYTES, "the largest device's memory")}),
    HeadType(name="token", kinds=("sequence", "channels_last"), build=_plain(_token_net), options={
        "pool": choice("cls", "cls", "mean"),  # CLS token (index 0) or the mean over tokens
    }, fixed={"channels_last": {"pool": "mean"}}),  # a map has no CLS token: LayerNorm(C), mean over H x W
    HeadType(name="transformer", kinds=("sequence",), build=_transformer_head,
             blocks=BlockUse(depth=lambda c: int(c.get("depth", 1)) if c.get("init") == "copy" else 0,
                             verb="copies", detail="init: copy, ", way_out="use init: fresh"),
             least_params=_transformer_least, options={
        "depth": _depth(1),          # transformer blocks before LayerNorm, pool, linear (0 = the 'token' head)
        "init": choice("fresh", "fresh", "copy"),  # fresh pre-norm blocks, or copies of the next stage's first blocks
        "heads": _width(0),          # attention heads of fresh blocks; 0 = D / 64, lowered to a divisor of D
        "mlp_ratio": bounded_number(4.0, 64, "ViT's MLP is 4 x D wide"),  # MLP width of fresh blocks over D
        "pool": choice("cls", "cls", "mean"),  # CLS token (index 0) or the mean over tokens
    }),
    HeadType(name="lm", kinds=("sequence",), build=_plain(_lm_net), per_token=True,
             least_params=lambda o: 2 * o["rank"] + 3 if o["rank"] else 4, options={  # LayerNorm(1), Linear(s)
        "rank": _width(64),          # 0: LayerNorm, Linear(D, C); r > 0: LayerNorm, Linear(D, r), Linear(r, C)
    }),
    HeadType(name="lm_output", kinds=("sequence",), build=_output_head, per_token=True,
             blocks=BlockUse(depth=lambda c: 2, verb="reads", find=output_layers,
                             way_out="use type lm, a fresh projection"), options={
        # the model's own final norm and output projection (e.g. Llama's model.norm, lm_head), frozen copies
        "projection": choice("frozen", "frozen", "shared"),  # frozen: a copy per stage; shared: one per device
        "adapter": choice("linear", "none", "linear", "norm"),  # trained before them: Linear(D, D) initialised to
        #                              the identity (the head starts as the model's own read-out), LayerNorm(D), none
    }),
))
"""The built-in head types' names, in the order registered."""

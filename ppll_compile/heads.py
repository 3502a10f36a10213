"""Auxiliary heads: the modules a head config describes, their local loss, and their counted cost."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cost import OPTIMIZER_STATES, measure_module
from .errors import PolicyError
from .phases import phase
from .plan import HeadSpec, TensorSpec
from .policy import Policy, check_head_config, tensor_kind

__all__ = ["AuxHead", "InfoProHead", "head_loss", "model_loss", "logits_of", "build_head", "make_head", "head_for",
           "head_spec", "model_head", "IGNORE_INDEX"]

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
    """InfoPro head: a classifier plus a ``decoder`` that reconstructs the raw model input from ``h``."""

    needs_input = True

    def __init__(self, net: nn.Module, decoder: nn.Module, loss: Mapping[str, Any]) -> None:
        super().__init__(net, loss)
        self.decoder = decoder
        self.reconstruction_weight = float(loss["reconstruction_weight"])

    def loss(self, h: Tensor, target: Tensor, input: Tensor | None = None) -> Tensor:
        if input is None:
            raise PolicyError("the infopro head reconstructs the raw model input, but loss() got input=None; "
                              "pass the model's first input as input=")
        return self.reconstruction_weight * F.mse_loss(self.decoder(h), input) + super().loss(h, target)


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
    if input_shape is None or len(input_shape) != 4:
        raise PolicyError(f"head type 'infopro' reconstructs the model input, which must be an image batch "
                          f"N x C x H x W, got input shape {None if input_shape is None else tuple(input_shape)}; "
                          f"pass input_shape, or use a policy without infopro heads (e.g. 'dgl')")
    width = o["cls_width"] or shape[1]
    classifier = nn.Sequential(*_conv_bn_relu(shape[1], width, 1), _Pool("feature_map"),
                               *_mlp(width, o["hidden"], 1, num_classes))
    decoder = nn.Sequential(*_conv_bn_relu(shape[1], o["width"], 3),
                            nn.Upsample(size=tuple(input_shape[2:]), mode="bilinear"),
                            nn.Conv2d(o["width"], input_shape[1], 3, padding=1),
                            nn.Sigmoid() if o["output"] == "sigmoid" else nn.Identity())
    return classifier, decoder


_NETS = {"conv": _conv_net, "mlp": _mlp_net, "token": _token_net, "lm": _lm_net}


def build_head(config: Mapping[str, Any], spec: TensorSpec, num_classes: int,
               input_shape: Sequence[int] | None = None, *, per_token: bool = False) -> AuxHead:
    """Build the head a config from :meth:`Policy.config_for` (or a hand-edited plan) describes for ``spec``;
    ``per_token``: the labels are one class per token (N x L), so the config must give N x L x C scores."""
    options, loss = check_head_config(config, spec, per_token)
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise PolicyError(f"num_classes must be an integer >= 1, got {reprlib.repr(num_classes)}")
    if options["type"] == "infopro":
        return InfoProHead(*_infopro_nets(options, spec.shape, num_classes, input_shape), loss)
    return AuxHead(_NETS[options["type"]](options, tensor_kind(spec), spec.shape, num_classes), loss)


def make_head(policy: Policy, spec: TensorSpec, num_classes: int, input_shape: Sequence[int] | None = None, *,
              per_token: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """The head ``policy`` gives boundary ``spec``, and its config (``{"type": "callable", ...}`` for callables);
    ``per_token``: for labels of one class per token (a callable is called as always and must then give
    N x L x C scores)."""
    config = policy.config_for(spec, per_token=per_token)
    if policy.builder is None:
        return build_head(config, spec, num_classes, input_shape, per_token=per_token), config
    head = policy.builder(spec, num_classes)
    if not isinstance(head, nn.Module):
        scores = f"per-token scores N x L x {num_classes}" if per_token else f"logits N x {num_classes}"
        raise PolicyError(f"policy callable {policy.name!r} returned {reprlib.repr(head)} for boundary {spec.name!r}; "
                          f"it must return an nn.Module mapping a tensor of shape {tuple(spec.shape)} to {scores}")
    return head, config


def head_for(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
             input_shape: Sequence[int] | None, *, per_token: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """The head for a boundary: the policy's choice (``config`` None), a callable policy's, or a given config;
    ``per_token``: for labels of one class per token."""
    if config is None or config.get("type") == "callable":
        return make_head(policy, spec, num_classes, input_shape, per_token=per_token)
    return build_head(config, spec, num_classes, input_shape, per_token=per_token), dict(config)


def head_spec(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
              input_shape: Sequence[int] | None, optimizer: str, *, per_token: bool = False) -> HeadSpec:
    """The head for a boundary, built on the meta device and counted like the backbone (FLOPs and memory), its
    loss taken on labels of one class per example, or per token (N x L) with ``per_token``."""
    with phase("heads"):
        return _counted_head(policy, config, spec, num_classes, input_shape, optimizer, per_token)


def _counted_head(policy: Policy, config: Mapping[str, Any] | None, spec: TensorSpec, num_classes: int,
                  input_shape: Sequence[int] | None, optimizer: str, per_token: bool) -> HeadSpec:
    with torch.device("meta"):
        head, config = head_for(policy, config, spec, num_classes, input_shape, per_token=per_token)
        head = head.to("meta")
        h = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
        y = torch.zeros(tuple(spec.shape[:2]) if per_token else spec.shape[0], dtype=torch.long)
        x = torch.empty(input_shape) if input_shape is not None else None
    cost = measure_module(head, lambda: head_loss(head, h, y, x))
    pbytes = sum(p.numel() * p.element_size() for p in head.parameters())
    memory = pbytes * (2 + OPTIMIZER_STATES[optimizer]) + cost.activation_bytes
    return HeadSpec(policy=policy.name, kind=_kind_text(spec), config=dict(config),
                    param_count=cost.param_count, flops_fwd=cost.flops_fwd, flops_bwd=cost.flops_bwd,
                    memory_bytes=memory)


def _kind_text(spec: TensorSpec) -> str:
    """The boundary's tensor kind, or its rank (``5-D``) where only a callable policy's head reads it."""
    try:
        return tensor_kind(spec)
    except PolicyError:
        return f"{len(spec.shape)}-D"


def model_head() -> HeadSpec:
    """The last stage's head: the model's own output under the trainer's loss."""
    return HeadSpec(policy="model", kind="model", config={"type": "model", "loss": "cross_entropy"})

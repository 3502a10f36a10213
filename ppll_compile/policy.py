"""Auxiliary-head policies: the schema of policy files and head configs, reading and validating them."""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from torch import nn

import policies as _policies

from .errors import PolicyError
from .plan import TensorSpec

__all__ = ["KINDS", "HEAD_TYPES", "CIFAR_MEAN", "CIFAR_STD", "tensor_kind", "Policy", "load_policy", "validate_policy",
           "check_head_config"]

KINDS = ("feature_map", "channels_last", "sequence", "vector")
_KIND_OF_RANK = {4: "feature_map", 3: "sequence", 2: "vector"}
_LAYOUT = {"feature_map": "N x C x H x W", "channels_last": "N x H x W x C", "sequence": "N x L x D",
           "vector": "N x D"}
_PER_TOKEN_KIND = "sequence"  # the one kind per-token heads read


@dataclass(frozen=True)
class _Opt:
    """One option of a schema: its default, what it must be (as errors say it) and the check."""

    default: Any
    expected: str
    check: Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(default: int, low: int = 0) -> _Opt:
    return _Opt(default, f"an integer >= {low}", lambda v: _is_int(v) and v >= low)


def _weight(default: float) -> _Opt:
    return _Opt(default, "a number >= 0",
                lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)


def _text(default: str) -> _Opt:
    return _Opt(default, "a string", lambda v: isinstance(v, str))


def _choice(default: str | None, *choices: str) -> _Opt:
    return _Opt(default, "one of " + ", ".join(choices), lambda v: isinstance(v, str) and v in choices)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(default: float) -> _Opt:
    return _Opt(default, "a number > 0", lambda v: _is_number(v) and v > 0)


def _fraction(default: float) -> _Opt:
    return _Opt(default, "a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1)


def _ramp(default: tuple[float, float]) -> _Opt:
    return _Opt(default, "a pair [first, last] of numbers >= 0",
                lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) and x >= 0 for x in v))


def _per_channel(default: tuple[float, ...], positive: bool = False) -> _Opt:
    return _Opt(default, f"a non-empty list of numbers{' > 0' if positive else ''} (one per channel, or one for all)",
                lambda v: isinstance(v, (list, tuple)) and len(v) > 0
                and all(_is_number(x) and (x > 0 or not positive) for x in v))


CIFAR_MEAN = (0.491373, 0.482353, 0.446667)
"""CIFAR's per-channel mean, as InfoPro's code has it (125.3, 123.0, 113.9 over 255): infopro's default ``mean``."""
CIFAR_STD = (0.247059, 0.243529, 0.261569)
"""CIFAR's per-channel standard deviation (63.0, 62.1, 66.7 over 255): infopro's default ``std``."""


class _HeadType(NamedTuple):
    kinds: tuple[str, ...]
    """The boundary tensor kinds the head can read."""
    options: dict[str, _Opt]
    """Option name -> default and check."""
    per_token: bool = False
    """Whether the head gives N x L x C scores for per-token labels (else N x C, one label per example)."""
    fixed: Mapping[str, Mapping[str, Any]] = {}
    """Kind -> options that have one possible value on that kind (the default there, any other an error)."""
    derived: Mapping[str, _Opt] = {}
    """Figures planning computes into the head config (a saved plan carries them; a policy file cannot set them)."""


# The one table that drives validation and defaults of every head config.
_HEADS: dict[str, _HeadType] = {
    "conv": _HeadType(("feature_map", "channels_last"), {  # channels_last: permuted to N x C x H x W first
        "width": _int(128),          # channels of each conv3x3 layer; 0 = the input's channels
        "max_width": _int(0),        # cap on those channels; 0 = no cap
        "depth": _int(1),            # conv3x3-BN-ReLU layers: 0 (pool + linear only), 1, 2 (DGL), 3, 4, ...
        "pool": _int(2, 1),          # adaptive average pool output size
        "hidden": _int(0),           # MLP hidden width after pooling; 0 = one linear layer
    }),
    "infopro": _HeadType(("feature_map",), {  # InfoPro (Wang et al., ICLR 2021), as its code builds it
        "width": _int(12, 1),        # decoder: upsample to the image, conv3x3 to `width`, BN, ReLU, conv3x3 to it
        "upsample": _choice("bilinear", "bilinear", "nearest"),  # the decoder's first layer (bilinear: align_corners)
        "reconstruction": _choice("bce", "bce", "mse"),  # bce: sigmoid + BCE against the de-normalised input;
        #                              mse: MSE of the decoder's raw output against the input as given
        "mean": _per_channel(CIFAR_MEAN),        # the input's normalisation, undone for bce: x * std + mean
        "std": _per_channel(CIFAR_STD, positive=True),
        "lambda1": _ramp((5.0, 0.5)),  # reconstruction weight at the first and the last auxiliary head
        "lambda2": _ramp((0.5, 1.0)),  # classification weight at the first and the last auxiliary head
        "cls_width": _int(0),        # classifier conv3x3 channels; 0 = the paper's: twice the input's, at most 64
        "cls_stride": _int(0),       # its stride; 0 = the paper's: 2 on maps of under 64 channels, else 1
        "hidden": _int(128, 1),      # classifier MLP hidden width (the paper's feature_dim)
    }),
    "mlp": _HeadType(KINDS, {
        "hidden": _int(256, 1),      # width of each hidden layer
        "depth": _int(1),            # hidden Linear-ReLU layers
    }),
    "momentum": _HeadType(("feature_map", "sequence"), {  # MAN: an EMA of the next stage's first blocks
        "depth": _int(1, 1),         # blocks of the next stage the trunk follows (not trained by gradient)
        "momentum": _fraction(0.99),  # ema = momentum * ema + (1 - momentum) * next stage's weights
        "every": _int(1, 1),         # steps between two weight transfers from the next stage
        "pool": _choice("mean", "cls", "mean"),  # then pool (CLS token or mean) and one trained linear layer
    }, fixed={"feature_map": {"pool": "mean"}}, derived={"mirror_bytes": _int(0)}),
    "token": _HeadType(("sequence", "channels_last"), {
        "pool": _choice("cls", "cls", "mean"),  # CLS token (index 0) or the mean over tokens
    }, fixed={"channels_last": {"pool": "mean"}}),  # a map has no CLS token: LayerNorm(C), mean over H x W
    "transformer": _HeadType(("sequence",), {
        "depth": _int(1),            # transformer blocks before LayerNorm, pool, linear (0 = the 'token' head)
        "init": _choice("fresh", "fresh", "copy"),  # fresh pre-norm blocks, or copies of the next stage's first blocks
        "heads": _int(0),            # attention heads of fresh blocks; 0 = D / 64, lowered to a divisor of D
        "mlp_ratio": _positive(4.0),  # MLP width of fresh blocks over D
        "pool": _choice("cls", "cls", "mean"),  # CLS token (index 0) or the mean over tokens
    }),
    "lm": _HeadType(("sequence",), {
        "rank": _int(64),            # 0: LayerNorm, Linear(D, C); r > 0: LayerNorm, Linear(D, r), Linear(r, C)
    }, per_token=True),
}
HEAD_TYPES = tuple(sorted(_HEADS))
_TYPE = _choice(None, *HEAD_TYPES)
_LOSS = {
    "classification": _choice("cross_entropy", "cross_entropy"),
    "classification_weight": _weight(1.0),
    "reconstruction_weight": _weight(0.0),  # InfoPro's lambda1; used by infopro heads only
}
_META = {"name": _text(""), "description": _text("")}
_TOP = (*_META, "heads", "per_token", "loss")


def _join(at: str, key: str) -> str:
    return f"{at}.{key}" if at else key


def _mapping(v: Any, source: str, subject: str) -> Mapping:
    if not isinstance(v, Mapping):
        raise PolicyError(f"{source}: {subject} must be a mapping, got {reprlib.repr(v)}")
    return v


def _check_keys(d: Mapping, allowed: Sequence[str], source: str, at: str) -> None:
    for key in d:
        if key not in allowed:
            raise PolicyError(f"{source}: unknown key {key!r}{f' at {at}' if at else ''} "
                              f"(allowed: {', '.join(sorted(allowed))})")


def _fill(d: Mapping, schema: Mapping[str, _Opt], source: str, at: str) -> dict[str, Any]:
    """Check every option of ``schema`` in ``d`` and fill in the missing ones with their defaults."""
    out = {}
    for key, opt in schema.items():
        value = d.get(key, opt.default)
        if not opt.check(value):
            raise PolicyError(f"{source}: {_join(at, key)} must be {opt.expected}, got {reprlib.repr(value)}")
        out[key] = value
    return out


def _check_loss(loss: Any, source: str, at: str) -> dict[str, Any]:
    loss = _mapping(loss, source, at)
    _check_keys(loss, tuple(_LOSS), source, at)
    return _fill(loss, _LOSS, source, at)


def _labels(per_token: bool) -> str:
    return "labels of one class per token (N x L)" if per_token else "labels of one class per example (N)"


def _check_head(config: Any, source: str, at: str, kind: str, tensors: str, per_token: bool = False,
                extra: tuple[str, ...] = (), hint: str = "", derived: bool = False) -> dict:
    """Validate one head config for ``kind`` tensors (described as ``tensors``) and per-example or per-token
    labels; return it with defaults filled in. ``hint`` ends the error of a head that gives the other scores;
    ``derived``: the config comes from a plan, which may carry the figures planning computed into it."""
    config = _mapping(config, source, at or "a head config")
    head_type = _fill(config, {"type": _TYPE}, source, at)["type"]
    spec = _HEADS[head_type]
    fitting = " or ".join(t for t in HEAD_TYPES if kind in _HEADS[t].kinds and _HEADS[t].per_token == per_token)
    if kind not in spec.kinds:
        raise PolicyError(f"{source}: {_join(at, 'type')} {head_type!r} cannot read {tensors} "
                          f"(it reads {', '.join(spec.kinds)}); use type {fitting}")
    if spec.per_token != per_token:
        scores = "per-token scores (N x L x C)" if spec.per_token else "one score vector per example (N x C)"
        raise PolicyError(f"{source}: {_join(at, 'type')} {head_type!r} gives {scores}, but {at or tensors} serves "
                          f"{_labels(per_token)}; use type {fitting}{hint}")
    computed = spec.derived if derived else {}
    _check_keys(config, ("type", *spec.options, *computed, *extra), source, at)
    fixed = spec.fixed.get(kind, {})
    options = {**spec.options, **{k: _Opt(v, f"{v!r} on {tensors}", lambda x, v=v: x == v) for k, v in fixed.items()}}
    given = {k: o for k, o in computed.items() if k in config}
    return {"type": head_type, **_fill(config, options, source, at), **_fill(config, given, source, at)}


def _rank_kind(spec: TensorSpec) -> str | None:
    """The kind of ``spec`` (see :func:`tensor_kind`), or None where no policy head reads it."""
    try:
        rank = len(spec.shape)
    except TypeError:
        return None
    if spec.layout == "channels_last":
        return "channels_last" if rank == 4 else None
    return _KIND_OF_RANK.get(rank) if not spec.layout else None


def tensor_kind(spec: TensorSpec) -> str:
    """The kind of a boundary tensor from its rank and layout: ``feature_map`` (4-D N x C x H x W),
    ``channels_last`` (4-D N x H x W x C, layout ``channels_last``), ``sequence`` (3-D) or ``vector`` (2-D)."""
    kind = _rank_kind(spec)
    if kind is None:
        shape = tuple(spec.shape)
        layout = f" with layout {spec.layout!r}" if spec.layout else ""
        raise PolicyError(f"boundary {spec.name!r}: a tensor of shape {shape}{layout} is {len(shape)}-D, but policy "
                          f"heads read 4-D feature maps (N x C x H x W, or N x H x W x C with layout "
                          f"'channels_last'), 3-D sequences (N x L x D) or 2-D vectors (N x D); pass a policy "
                          f"callable fn(spec, num_classes) -> nn.Module that builds a head for it, or cut elsewhere")
    return kind


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How to build the auxiliary head of every stage, by the kind of the stage's boundary tensor."""

    name: str
    """Shipped policy name, path of the user's policy file, or qualified name of a policy callable."""
    heads: Mapping[str, Mapping[str, Any]]
    """Tensor kind -> validated head config (``type`` and every option, defaults filled in)."""
    loss: Mapping[str, Any]
    """Validated loss section (weights of the classification and reconstruction terms)."""
    source: str
    """File the policy was read from (``""`` for callables)."""
    builder: Callable[[TensorSpec, int], nn.Module] | None = None
    """For a callable policy: ``fn(spec, num_classes) -> nn.Module`` mapping the boundary to class scores,
    N x C for per-example labels, N x L x C for per-token labels (the same call serves both)."""
    description: str = ""
    """One line saying what the policy does."""
    per_token: Mapping[str, Any] | None = None
    """Validated head config (type ``lm``) for every sequence boundary when the labels are per token; None if none."""

    def fits(self, spec: TensorSpec, per_token: bool = False) -> bool:
        """Whether the policy has a head for the boundary ``spec`` (exactly when :meth:`config_for` accepts it);
        never raises, whatever the rank (a callable policy fits every boundary)."""
        if self.builder is not None:
            return True
        kind = _rank_kind(spec)
        if per_token:
            return kind == _PER_TOKEN_KIND and self.per_token is not None
        return kind in self.heads

    def config_for(self, spec: TensorSpec, per_token: bool = False) -> dict[str, Any]:
        """The head config for the boundary ``spec``: type, options and the loss section under ``loss``;
        with ``per_token``, the ``per_token:`` head, for labels of one class per token."""
        if self.builder is not None:
            return {"type": "callable", "name": self.name}
        kind = tensor_kind(spec)
        where = f"boundary {spec.name!r} of shape {tuple(spec.shape)}"
        if per_token:
            if kind != _PER_TOKEN_KIND:
                raise PolicyError(
                    f"{where} is a {kind} tensor ({_LAYOUT[kind]}), but the labels are per token (N x L) and "
                    f"per-token heads read sequences (N x L x D); cut where the boundary is a sequence, or pass a "
                    f"policy callable fn(spec, num_classes) -> nn.Module giving N x L x C scores")
            if self.per_token is None:
                raise PolicyError(
                    f"policy {self.name!r} has no per-token head, needed for {where}, a sequence (N x L x D) whose "
                    f"labels are per token (N x L); use policy='lm', or add a 'per_token:' entry (type lm) to "
                    f"{self.source or 'the policy file'}")
            return {**self.per_token, "loss": dict(self.loss)}
        if kind not in self.heads:
            raise PolicyError(
                f"policy {self.name!r} has no head for {kind} tensors ({_LAYOUT[kind]}), needed for {where}; "
                f"it has heads for: {', '.join(self.heads)}. "
                f"Use policy='auto', or add a '{kind}:' entry under 'heads:' in {self.source or 'the policy file'}")
        config = {**self.heads[kind], "loss": dict(self.loss)}
        if config["type"] == "infopro":  # weighted by lambda1 and lambda2: here at the first head, in a plan per stage
            config["loss"].update(reconstruction_weight=config["lambda1"][0],
                                  classification_weight=config["lambda2"][0])
        return config


def validate_policy(data: Any, source: str) -> Policy:
    """Check parsed policy ``data`` against the schema; return the :class:`Policy` with defaults filled in."""
    data = _mapping(data, source, "a policy")
    _check_keys(data, _TOP, source, "")
    meta = _fill(data, _META, source, "")
    if "heads" not in data:
        raise PolicyError(f"{source}: missing key 'heads' (a mapping from tensor kind - "
                          f"{', '.join(KINDS)} - to a head config)")
    heads = _mapping(data["heads"], source, "heads")
    if not heads:
        raise PolicyError(f"{source}: heads is empty; give a head config for at least one of {', '.join(KINDS)}")
    _check_keys(heads, KINDS, source, "heads")
    per_token = data.get("per_token")
    return Policy(
        name=meta["name"] or source,
        heads={kind: _check_head(cfg, source, f"heads.{kind}", kind, f"{kind} tensors ({_LAYOUT[kind]})",
                                 hint=" (a per-token head goes under per_token:)")
               for kind, cfg in heads.items()},
        loss=_check_loss(data.get("loss", {}), source, "loss"),
        source=source,
        description=meta["description"],
        per_token=None if per_token is None else _check_head(
            per_token, source, "per_token", _PER_TOKEN_KIND, f"{_PER_TOKEN_KIND} tensors ({_LAYOUT['sequence']})",
            per_token=True),
    )


def read_yaml(path: Path, kind: str = "policy") -> Any:
    """The YAML document of the policy file ``path`` (a ``kind``); a PolicyError naming the file when it cannot be
    read."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise PolicyError(f"{path}: cannot read the policy file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path}: not a policy file (byte {e.object[e.start]:#04x} at offset {e.start} is not "
                          f"UTF-8 text); a {kind} is a YAML text file saved as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PolicyError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}; "
                          f"fix the file's syntax") from None


def _read_policy(path: Path, name: str) -> Policy:
    return dataclasses.replace(validate_policy(read_yaml(path), str(path)), name=name)


def load_policy(policy: str | os.PathLike | Policy | Callable[[TensorSpec, int], nn.Module]) -> Policy:
    """A :class:`Policy` from a shipped name, a policy YAML file, an existing policy, or a head-building callable
    ``fn(spec, num_classes) -> nn.Module`` (giving N x C scores, or N x L x C where the labels are per token)."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        if isinstance(policy, str) and policy in _policies.names():
            return _read_policy(_policies.path(policy), policy)
        if Path(policy).is_file():
            return _read_policy(Path(policy), os.fspath(policy))
        if Path(policy).is_dir():
            raise PolicyError(f"policy {os.fspath(policy)!r} is a directory; pass a shipped policy name "
                              f"({', '.join(_policies.names())}) or the path to a policy YAML file")
        raise PolicyError(f"unknown policy {os.fspath(policy)!r}: not a shipped policy "
                          f"({', '.join(_policies.names())}) nor a file; pass a shipped name, the path to a "
                          f"policy YAML file, or a callable fn(spec, num_classes) -> nn.Module")
    if callable(policy):  # called as fn(spec, num_classes) for per-example and per-token labels alike
        return Policy(name=getattr(policy, "__qualname__", type(policy).__qualname__), heads={},
                      loss={k: o.default for k, o in _LOSS.items()}, source="", builder=policy)
    raise PolicyError(f"a policy must be a shipped name, a policy file path, a Policy or a callable "
                      f"fn(spec, num_classes) -> nn.Module, got {reprlib.repr(policy)}")


def check_head_config(config: Mapping[str, Any], spec: TensorSpec,
                      per_token: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """A head config (from :meth:`Policy.config_for` or a hand-edited plan) checked against the boundary ``spec``
    and the labels (one class per example, or per token): its type and options, and its loss section, each with
    defaults filled in."""
    kind = tensor_kind(spec)
    source = "head config"
    if per_token and kind != _PER_TOKEN_KIND:
        raise PolicyError(f"{source}: the {kind} boundary {spec.name!r} of shape {tuple(spec.shape)} "
                          f"({_LAYOUT[kind]}) cannot serve labels per token (N x L): per-token heads read sequences "
                          f"(N x L x D); cut where the boundary is a sequence, or pass a policy callable")
    options = _check_head(config, source, "", kind, f"the {kind} boundary {spec.name!r} of shape {tuple(spec.shape)}",
                          per_token=per_token, extra=("loss",), derived=True)
    return options, _check_loss(config.get("loss", {}), source, "loss")

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

__all__ = ["KINDS", "HEAD_TYPES", "tensor_kind", "Policy", "load_policy", "validate_policy", "check_head_config"]

KINDS = ("feature_map", "sequence", "vector")
_KIND_OF_RANK = {4: "feature_map", 3: "sequence", 2: "vector"}
_LAYOUT = {"feature_map": "N x C x H x W", "sequence": "N x L x D", "vector": "N x D"}


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


class _HeadType(NamedTuple):
    kinds: tuple[str, ...]
    """The boundary tensor kinds the head can read."""
    options: dict[str, _Opt]
    """Option name -> default and check."""


# The one table that drives validation and defaults of every head config.
_HEADS: dict[str, _HeadType] = {
    "conv": _HeadType(("feature_map",), {
        "width": _int(128),          # channels of each conv3x3 layer; 0 = the input's channels
        "max_width": _int(0),        # cap on those channels; 0 = no cap
        "depth": _int(1),            # conv3x3-BN-ReLU layers
        "pool": _int(2, 1),          # adaptive average pool output size
        "hidden": _int(0),           # MLP hidden width after pooling; 0 = one linear layer
    }),
    "infopro": _HeadType(("feature_map",), {
        "width": _int(12, 1),        # decoder channels
        "output": _choice("identity", "identity", "sigmoid"),  # decoder output activation
        "cls_width": _int(64),       # classifier conv1x1 channels; 0 = the input's channels
        "hidden": _int(128, 1),      # classifier MLP hidden width
    }),
    "mlp": _HeadType(KINDS, {
        "hidden": _int(256, 1),      # width of each hidden layer
        "depth": _int(1),            # hidden Linear-ReLU layers
    }),
    "token": _HeadType(("sequence",), {
        "pool": _choice("cls", "cls", "mean"),  # CLS token (index 0) or the mean over tokens
    }),
}
HEAD_TYPES = tuple(sorted(_HEADS))
_TYPE = _choice(None, *HEAD_TYPES)
_LOSS = {
    "classification": _choice("cross_entropy", "cross_entropy"),
    "classification_weight": _weight(1.0),
    "reconstruction_weight": _weight(0.0),  # InfoPro's lambda1; used by infopro heads only
}
_META = {"name": _text(""), "description": _text("")}
_TOP = (*_META, "heads", "loss")


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


def _check_head(config: Any, source: str, at: str, kind: str, tensors: str, extra: tuple[str, ...] = ()) -> dict:
    """Validate one head config for ``kind`` tensors (described as ``tensors``); return it with defaults."""
    config = _mapping(config, source, at or "a head config")
    head_type = _fill(config, {"type": _TYPE}, source, at)["type"]
    spec = _HEADS[head_type]
    if kind not in spec.kinds:
        fitting = [t for t in HEAD_TYPES if kind in _HEADS[t].kinds]
        raise PolicyError(f"{source}: {_join(at, 'type')} {head_type!r} cannot read {tensors} "
                          f"(it reads {', '.join(spec.kinds)}); use type {' or '.join(fitting)}")
    _check_keys(config, ("type", *spec.options, *extra), source, at)
    return {"type": head_type, **_fill(config, spec.options, source, at)}


def tensor_kind(shape: Sequence[int]) -> str:
    """The kind of a boundary tensor from its rank: ``feature_map`` (4-D), ``sequence`` (3-D) or ``vector`` (2-D)."""
    kind = _KIND_OF_RANK.get(len(shape))
    if kind is None:
        raise PolicyError(f"a boundary tensor of shape {tuple(shape)} is {len(shape)}-D, but policy heads read "
                          f"4-D feature maps (N x C x H x W), 3-D sequences (N x L x D) or 2-D vectors (N x D); "
                          f"pass a policy callable fn(spec, num_classes) -> nn.Module that builds a head for it, "
                          f"or cut elsewhere")
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
    """For a callable policy: ``fn(spec, num_classes) -> nn.Module`` mapping the boundary to logits."""
    description: str = ""
    """One line saying what the policy does."""

    def config_for(self, spec: TensorSpec) -> dict[str, Any]:
        """The head config for the boundary ``spec``: type, options and the loss section under ``loss``."""
        if self.builder is not None:
            return {"type": "callable", "name": self.name}
        kind = tensor_kind(spec.shape)
        if kind not in self.heads:
            raise PolicyError(
                f"policy {self.name!r} has no head for {kind} tensors ({_LAYOUT[kind]}), needed for boundary "
                f"{spec.name!r} of shape {tuple(spec.shape)}; it has heads for: {', '.join(self.heads)}. "
                f"Use policy='auto', or add a '{kind}:' entry under 'heads:' in {self.source or 'the policy file'}")
        return {**self.heads[kind], "loss": dict(self.loss)}


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
    return Policy(
        name=meta["name"] or source,
        heads={kind: _check_head(cfg, source, f"heads.{kind}", kind, f"{kind} tensors ({_LAYOUT[kind]})")
               for kind, cfg in heads.items()},
        loss=_check_loss(data.get("loss", {}), source, "loss"),
        source=source,
        description=meta["description"],
    )


def _read_policy(path: Path, name: str) -> Policy:
    source = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise PolicyError(f"{source}: cannot read the policy file ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PolicyError(f"{source}: not valid YAML{at}: {getattr(e, 'problem', None) or e}; "
                          f"fix the file's syntax") from None
    return dataclasses.replace(validate_policy(data, source), name=name)


def load_policy(policy: str | os.PathLike | Policy | Callable[[TensorSpec, int], nn.Module]) -> Policy:
    """A :class:`Policy` from a shipped name, a policy YAML file, an existing policy, or a head-building callable."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        if isinstance(policy, str) and policy in _policies.names():
            return _read_policy(_policies.path(policy), policy)
        if Path(policy).is_file():
            return _read_policy(Path(policy), os.fspath(policy))
        raise PolicyError(f"unknown policy {os.fspath(policy)!r}: not a shipped policy "
                          f"({', '.join(_policies.names())}) nor a file; pass a shipped name, the path to a "
                          f"policy YAML file, or a callable fn(spec, num_classes) -> nn.Module")
    if callable(policy):
        return Policy(name=getattr(policy, "__qualname__", type(policy).__qualname__), heads={},
                      loss={k: o.default for k, o in _LOSS.items()}, source="", builder=policy)
    raise PolicyError(f"a policy must be a shipped name, a policy file path, a Policy or a callable "
                      f"fn(spec, num_classes) -> nn.Module, got {reprlib.repr(policy)}")


def check_head_config(config: Mapping[str, Any], spec: TensorSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """A head config (from :meth:`Policy.config_for` or a hand-edited plan) checked against the boundary ``spec``:
    its type and options, and its loss section, each with defaults filled in."""
    kind = tensor_kind(spec.shape)
    source = "head config"
    options = _check_head(config, source, "", kind,
                          f"the {kind} boundary {spec.name!r} of shape {tuple(spec.shape)}", extra=("loss",))
    return options, _check_loss(config.get("loss", {}), source, "loss")

"""Auxiliary-head policies: the schema of policy files and head configs, reading and validating them."""

from __future__ import annotations

import dataclasses
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from ppll_compile import policies as _policies

from ..cost.hardware import LARGEST_DEVICE, LARGEST_DEVICE_BYTES
from ..documents import described, load_yaml, not_utf8, yaml_error
from ..errors import PolicyError
from ..plans.plan import TensorSpec
from ..plans.units import format_bytes
from .schema import Opt, choice, text, weight
from .types import BUILT_IN, KINDS, head_type, head_type_names

__all__ = ["Policy", "load_policy", "validate_policy"]

_KIND_OF_RANK = {4: "feature_map", 3: "sequence", 2: "vector"}
_LAYOUT = {"feature_map": "N x C x H x W", "channels_last": "N x H x W x C", "sequence": "N x L x D",
           "vector": "N x D"}
_PER_TOKEN_KIND = "sequence"  # the one kind per-token heads read

HEAD_TYPES = tuple(sorted(BUILT_IN))
"""The built-in head types, sorted (the table is :mod:`ppll_compile.heads.types`; more may be registered there)."""
_LOSS = {
    "classification": choice("cross_entropy", "cross_entropy"),
    "classification_weight": weight(1.0),
    "reconstruction_weight": weight(0.0),  # InfoPro's lambda1; used by infopro heads only
}
_META = {"name": text(""), "description": text("")}
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


def _fill(d: Mapping, schema: Mapping[str, Opt], source: str, at: str) -> dict[str, Any]:
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
    types = {name: head_type(name) for name in head_type_names()}
    name = _fill(config, {"type": choice(None, *types)}, source, at)["type"]
    spec = types[name]
    fitting = " or ".join(t for t, s in types.items() if kind in s.kinds and s.per_token == per_token)
    if kind not in spec.kinds:
        raise PolicyError(f"{source}: {_join(at, 'type')} {name!r} cannot read {tensors} "
                          f"(it reads {', '.join(spec.kinds)}); use type {fitting}")
    if spec.per_token != per_token:
        scores = "per-token scores (N x L x C)" if spec.per_token else "one score vector per example (N x C)"
        raise PolicyError(f"{source}: {_join(at, 'type')} {name!r} gives {scores}, but {at or tensors} serves "
                          f"{_labels(per_token)}; use type {fitting}{hint}")
    computed = spec.derived if derived else {}
    _check_keys(config, ("type", *spec.options, *computed, *extra), source, at)
    fixed = spec.fixed.get(kind, {})
    options = {**spec.options, **{k: Opt(v, f"{v!r} on {tensors}", lambda x, v=v: x == v) for k, v in fixed.items()}}
    given = {k: o for k, o in computed.items() if k in config}
    checked = {"type": name, **_fill(config, options, source, at), **_fill(config, given, source, at)}
    _check_size(checked, spec.least_params, source, at)
    return checked


def _check_size(config: Mapping[str, Any], least: Callable[[Mapping[str, Any]], int] | None, source: str,
                at: str) -> None:
    """Refuse a head config whose float32 parameters exceed the largest device's memory on any boundary."""
    count = least(config) if least is not None else 0
    if 4 * count <= LARGEST_DEVICE_BYTES:
        return
    sizes = ", ".join(f"{k} {config[k]}" for k, v in config.items() if k != "type" and isinstance(v, int)
                      and not isinstance(v, bool))
    where = f"{source}: {at}:" if at else f"{source}:"
    raise PolicyError(f"{where} a head of type {config['type']} with {sizes} has at least {count:,} "
                      f"parameters on any boundary, {format_bytes(4 * count)} in float32, more than the "
                      f"{format_bytes(LARGEST_DEVICE_BYTES)} of the largest device ({LARGEST_DEVICE}); make it "
                      f"narrower or shallower")


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
        weights = head_type(config["type"]).stage_loss  # infopro's lambda1 and lambda2: the first head's weights
        if weights is not None:                          # here, in a plan every stage's (heads.stage_head)
            config["loss"].update(weights(config, 0, 2) or {})
        return config


def validate_policy(data: Any, source: str) -> Policy:
    """Check parsed policy ``data`` against the schema; return the :class:`Policy` with defaults filled in. Until
    ``data`` is a mapping with a ``heads`` key (a policy at all), the errors quote nothing of it."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: a policy must be a mapping with the key 'heads', got {described(data)}")
    if "heads" not in data:
        raise PolicyError(f"{source}: missing key 'heads' (a mapping from tensor kind - "
                          f"{', '.join(KINDS)} - to a head config)")
    _check_keys(data, _TOP, source, "")
    meta = _fill(data, _META, source, "")
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


MAX_POLICY_BYTES = 2**20
"""The largest policy file read (1 MiB): a policy is a few head configs (the shipped ones are under 4 KiB), and the
YAML reader takes about a second per MiB; a bigger file is not a policy."""


def read_yaml(path: Path, kind: str = "policy") -> Any:
    """The YAML document of the policy file ``path`` (a ``kind``; :func:`load_yaml`); a PolicyError naming the file
    when it cannot be read, is over :data:`MAX_POLICY_BYTES`, or is nested deeper than the YAML reader can follow.
    The errors quote nothing of the file (a plan's ``policy`` path may name any file)."""
    try:
        size = path.stat().st_size
        if size > MAX_POLICY_BYTES:
            raise PolicyError(f"{path}: the {kind} file is {format_bytes(size)}, over the "
                              f"{format_bytes(MAX_POLICY_BYTES)} a {kind} may take (a {kind} is a few configs; "
                              f"the shipped ones are under 4 KiB); pass the right file, or trim it")
        return load_yaml(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise PolicyError(f"{path}: the {kind} is nested deeper than the YAML reader can follow (a {kind} nests a "
                          f"few levels: section, entry, option); pass the right file, or flatten it") from None
    except OSError as e:
        raise PolicyError(f"{path}: cannot read the {kind} file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path}: not a policy file ({not_utf8(e)}); a {kind} is a YAML text file saved as "
                          f"UTF-8") from None
    except yaml.YAMLError as e:
        raise PolicyError(f"{path}: {yaml_error(e)}; fix the file's syntax") from None


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


def check_plan_heads(d: Any, source: str) -> None:
    """The sizes of the head configs of a plan document ``d`` (read from ``source``): every option a config gives
    within its type's bounds, and no head that would exceed the largest device's memory on any boundary; a
    PolicyError names the file and the field (``stages[0].head.config.depth``). Other problems are left to the
    checks made when the plan is applied."""
    stages = d.get("stages") if isinstance(d, Mapping) else None
    for i, stage in enumerate(stages if isinstance(stages, list) else ()):
        head = stage.get("head") if isinstance(stage, Mapping) else None
        config = head.get("config") if isinstance(head, Mapping) else None
        if not isinstance(config, Mapping) or config.get("type") not in head_type_names():
            continue
        spec, at = head_type(config["type"]), f"stages[{i}].head.config"
        options = {**spec.options, **spec.derived}
        _fill(config, {k: o for k, o in options.items() if k in config}, source, at)
        _check_size({**{k: o.default for k, o in spec.options.items()}, **config}, spec.least_params, source, at)

"""Pipe-BD's loss policy: the distillation loss of every block (``mse``, ``smooth_l1``) and of the last (``kl`` and
``soft_ce`` too)."""

from __future__ import annotations

import os
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.nn import functional as F

from ppll_compile import policies as _policies

from ..documents import described
from ..errors import PolicyError
from ..heads.policy import read_yaml

LOSSES: dict[str, dict[str, float]] = {"mse": {}, "smooth_l1": {"beta": 1.0}, "kl": {"temperature": 1.0},
                                       "soft_ce": {"temperature": 1.0}}
"""Distillation losses by type, with their options and defaults; ``kl`` and ``soft_ce`` compare N x C logits.

``kl`` is the KL divergence from the teacher's to the student's class distribution, ``soft_ce`` the cross-entropy
with the teacher's class distribution as soft targets (what Pipe-BD's and DNA's code train the last block on:
``nn.CrossEntropyLoss()(student, teacher.softmax(1))``). They differ by the teacher's entropy, a constant for the
student, so at the same temperature they give the same gradients; both are scaled by ``temperature ** 2``."""

LOGIT_LOSSES = ("kl", "soft_ce")
"""The losses that compare class logits (N x C): they fit only the last block."""


@dataclass(frozen=True, kw_only=True)
class DistillPolicy:
    """The loss every student block is trained on to match its teacher block."""

    name: str
    """Shipped policy name or file path."""
    loss: Mapping[str, Any]
    """Loss of every block but the last: ``type`` plus options."""
    last: Mapping[str, Any]
    """Loss of the last block (on the model outputs)."""


def _check_loss(d: Any, source: str, at: str) -> dict[str, Any]:
    if not isinstance(d, Mapping) or "type" not in d:
        got = described(d) if not isinstance(d, Mapping) else f"{described(d)} without 'type'"
        raise PolicyError(f"{source}: {at} must be a mapping with a 'type' ({', '.join(LOSSES)}), got {got}")
    kind = d["type"]
    if kind not in LOSSES:
        raise PolicyError(f"{source}: {at}.type is {reprlib.repr(kind)}; known distillation losses: "
                          f"{', '.join(LOSSES)}")
    unknown = sorted(set(d) - {"type"} - set(LOSSES[kind]))
    if unknown:
        raise PolicyError(f"{source}: {at} has unknown option(s) {unknown}; {kind} takes "
                          f"{sorted(LOSSES[kind]) or 'no options'}")
    out = {"type": kind, **LOSSES[kind]}
    for k, v in d.items():
        if k != "type":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise PolicyError(f"{source}: {at}.{k} must be a positive number, got {reprlib.repr(v)}")
            out[k] = float(v)
    return out


_KEYS = ("name", "description", "loss", "last")
_ALLOWED = "name, description, loss and last"


def _check_keys(data: Any, source: str) -> None:
    """Refuse what is no distillation policy, quoting none of it (a path may name any file), and a policy's unknown
    keys, naming them only in a document with 'loss' or 'last' (a policy being written)."""
    way_out = f"pass a shipped name ({', '.join(_policies.distill_names())}) or a distillation policy file"
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: a distillation policy is a mapping with 'loss:' and 'last:', got "
                          f"{described(data)}; {way_out}")
    unknown = sorted(map(str, set(data) - set(_KEYS)))
    if unknown and not {"loss", "last"} & set(data):
        raise PolicyError(f"{source}: not a distillation policy: {described(data)} with neither 'loss' nor 'last' "
                          f"and keys other than {_ALLOWED}; {way_out}")
    if unknown:
        raise PolicyError(f"{source}: unknown key(s) {reprlib.repr(unknown)}; a distillation policy has {_ALLOWED}")


def load_distill_policy(policy: str | os.PathLike | Mapping[str, Any] | DistillPolicy) -> DistillPolicy:
    """A :class:`DistillPolicy` from a shipped name (``pipebd``, ``mse``, ``kl``), a YAML file, or a mapping."""
    if isinstance(policy, DistillPolicy):
        return policy
    if isinstance(policy, Mapping):
        data, source = policy, "distillation policy"
    elif isinstance(policy, (str, os.PathLike)):
        if isinstance(policy, str) and policy in _policies.distill_names():
            path = _policies.distill_path(policy)
        elif Path(policy).is_file():
            path = Path(policy)
        elif Path(policy).is_dir():
            raise PolicyError(f"distillation policy {os.fspath(policy)!r} is a directory; pass a shipped name "
                              f"({', '.join(_policies.distill_names())}) or the path to a YAML file")
        else:
            raise PolicyError(f"unknown distillation policy {os.fspath(policy)!r}: not a shipped one "
                              f"({', '.join(_policies.distill_names())}) nor a file; pass a shipped name or the "
                              f"path to a YAML file with 'loss:' and 'last:'")
        source = str(path)
        data = read_yaml(path, "distillation policy")
    else:
        raise PolicyError(f"a distillation policy is a shipped name, a YAML path or a mapping; got "
                          f"{reprlib.repr(policy)}")
    _check_keys(data, source)
    loss = _check_loss(data.get("loss", {"type": "mse"}), source, "loss")
    if loss["type"] in LOGIT_LOSSES:
        raise PolicyError(f"{source}: loss.type {loss['type']} compares class logits and fits only the last block; "
                          f"use mse or smooth_l1 for 'loss' and put {loss['type']} under 'last'")
    last = _check_loss(data.get("last", loss), source, "last")
    name = policy if isinstance(policy, str) and policy in _policies.distill_names() else str(data.get("name", source))
    return DistillPolicy(name=name, loss=loss, last=last)


def distill_loss(config: Mapping[str, Any]) -> Callable[[Tensor, Tensor], Tensor]:
    """``fn(student_out, teacher_out) -> loss``, a mean over the batch, for a loss config of a policy.

    With temperature ``T``, ``kl`` is ``KL(softmax(t/T) || softmax(s/T)) * T**2`` and ``soft_ce`` is
    ``-(softmax(t/T) * log_softmax(s/T)).sum(1).mean() * T**2``, both averaged over the N rows of N x C logits.
    """
    kind = config["type"]
    if kind == "mse":
        return F.mse_loss
    if kind == "smooth_l1":
        beta = float(config["beta"])
        return lambda s, t: F.smooth_l1_loss(s, t, beta=beta)
    temperature = float(config["temperature"])
    if kind == "soft_ce":
        def soft_ce(s: Tensor, t: Tensor) -> Tensor:
            return F.cross_entropy(s / temperature, F.softmax(t / temperature, dim=1)) * temperature ** 2
        return soft_ce

    def kl(s: Tensor, t: Tensor) -> Tensor:
        return F.kl_div(F.log_softmax(s / temperature, dim=1), F.log_softmax(t / temperature, dim=1),
                        reduction="batchmean", log_target=True) * temperature ** 2
    return kl

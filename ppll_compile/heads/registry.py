"""The registry of head types: per type, its options, how it is built, and what it needs from planning, lowering and
the runtime (the built-in types are registered by :mod:`ppll_compile.heads.types`, which every reader imports)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import PolicyError
from .modules import AuxHead
from .schema import Opt

MAX_DEPTH = 1024
"""The most layers (or blocks) a head option may ask for: more than the deepest trunks trained (ResNet-1001); every
layer is built and measured while planning, so a deeper head would take minutes to plan before failing."""
MAX_WIDTH = 2**20
"""The most channels (hidden units, rank) a head option may ask for: one width x width layer this wide holds 2**40
parameters, 4 TiB in float32, more than any device holds."""
MAX_SIDE = 256
"""The largest pool output side or stride a head option may ask for: more than the side of any map a head reads
(ImageNet's first map is 112 x 112)."""
MAX_EVERY = 10**6
"""The most steps between two weight transfers: more steps than a training run takes (the head would never follow)."""


def bounded(default: int, low: int, high: int, why: str) -> Opt:
    """An integer option from ``low`` to ``high``; ``why`` says what the ceiling guards against (in its errors)."""
    return Opt(default, f"an integer from {low} to {high} ({why})",
               lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high)


def bounded_number(default: float, high: float, why: str) -> Opt:
    """A finite number > 0 and at most ``high``; ``why`` says what the ceiling guards against."""
    return Opt(default, f"a number > 0 and at most {high:g} ({why})",
               lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= high)


@dataclass(frozen=True, kw_only=True)
class HeadRequest:
    """What a head type's builder gets: the checked config, and the boundary and model the head is built for."""

    options: Mapping[str, Any]
    """The head config checked against the type's options, defaults filled in (``type`` and every option)."""
    loss: Mapping[str, Any]
    """The checked loss section: ``classification_weight``, ``reconstruction_weight``."""
    kind: str
    """The boundary tensor's kind (``feature_map``, ``channels_last``, ``sequence``, ``vector``)."""
    shape: tuple[int, ...]
    """The boundary tensor's shape at the planned batch size."""
    num_classes: int
    """Classes the head scores."""
    input_shape: tuple[int, ...] | None
    """The model's first input's shape (what a head that reads the raw input sees), if known."""
    blocks: Sequence[nn.Module] | None
    """For a type with :attr:`HeadType.blocks`: the model's blocks after the cut, to copy (``None``: not at hand,
    build stand-ins of the usual shape); ``None`` for every other type."""


@dataclass(frozen=True, kw_only=True)
class BlockUse:
    """How a head type uses the model's blocks after its cut, or other modules of the model (found by
    :func:`ppll_compile.lower.split.next_blocks`)."""

    depth: Callable[[Mapping[str, Any]], int]
    """How many blocks a config of the type uses (0: none, the head stands alone); called on configs as written."""
    verb: str
    """What the head does with them, as errors say it: ``copies``, ``follows``."""
    way_out: str
    """The way out an error offers when the blocks are not there (``...; use init: fresh``)."""
    detail: str = ""
    """How errors name the options that make it use them, before its depth (``init: copy, ``)."""
    find: Callable[[nn.Module, Sequence[Any], str], list[tuple[str, nn.Module]]] | None = None
    """Where the modules come from, ``find(model, captured nodes, cut node)`` giving (path, module) pairs, as many as
    :attr:`depth` says; ``None``: the blocks right after the cut."""


@dataclass(frozen=True, kw_only=True)
class HeadType:
    """One head type: the one place that says how it is checked, built and measured, and what it needs."""

    name: str
    """The ``type`` of a head config."""
    kinds: tuple[str, ...]
    """The boundary tensor kinds the head can read."""
    options: Mapping[str, Opt]
    """Option name -> default and check."""
    build: Callable[[HeadRequest], AuxHead]
    """The head for a request; planning calls it under ``torch.device("meta")`` to measure it."""
    per_token: bool = False
    """Whether the head gives N x L x C scores for per-token labels (else N x C, one label per example)."""
    fixed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Kind -> options that have one possible value on that kind (the default there, any other an error)."""
    derived: Mapping[str, Opt] = field(default_factory=dict)
    """Figures planning computes into the head config (a saved plan carries them; a policy file cannot set them)."""
    needs_input: bool = False
    """Whether the head's loss reads the model's raw input (InfoPro's reconstruction): the built head says so
    (``needs_input``), and the runtime carries the input along to its stage."""
    blocks: BlockUse | None = None
    """Whether and how the head copies or follows the model's blocks after its cut (planning costs meta copies of
    them, lowering hands it deep copies); ``None``: it stands alone."""
    follows_next: bool = False
    """Whether the head needs the runtime's help: it follows the next stage's weights, which that stage publishes
    every ``every`` steps and the head pulls (MAN). Its builder returns a
    :class:`~ppll_compile.heads.modules.MomentumHead`; lowering tells it which parameters it follows, planning
    counts what it keeps (``mirror_bytes``), and a pipeline with such a head cannot move its cuts."""
    stage_loss: Callable[[Mapping[str, Any], int, int], Mapping[str, float] | None] | None = None
    """Its loss weights at stage ``i`` of ``n`` (InfoPro's ramps), written into the config's loss section; ``None``
    (or a call that returns ``None``): the loss section as it is."""
    notes: Callable[[Mapping[str, Any], int, float], list[str]] | None = None
    """What the plan says about such a head at stage ``i`` (its config, ``i``, the link bandwidth)."""
    least_params: Callable[[Mapping[str, Any]], int] | None = None
    """The fewest parameters a checked config of the type has on any boundary (one channel, one class): a config
    whose float32 parameters would exceed :data:`~ppll_compile.cost.hardware.LARGEST_DEVICE_BYTES` anyway is refused when the policy or plan is
    read, before anything is built. ``None``: no such floor (the head's size follows the model's blocks)."""


_TYPES: dict[str, HeadType] = {}


def register_head_type(head_type: HeadType, *, replace: bool = False) -> HeadType:
    """Make ``head_type`` usable by its name in policies and plans; an existing name is an error unless ``replace``."""
    if not isinstance(head_type, HeadType):
        raise TypeError(f"register_head_type takes a HeadType, got {type(head_type).__name__}")
    if head_type.name in _TYPES and not replace:
        raise PolicyError(f"head type {head_type.name!r} is registered already; pick another name, or pass "
                          f"replace=True to replace it")
    if head_type.name in ("callable", "model"):
        raise PolicyError(f"head type name {head_type.name!r} is reserved (a policy callable's heads, the last "
                          f"stage's own output); pick another name")
    _TYPES[head_type.name] = head_type
    return head_type


def unregister_head_type(name: str) -> None:
    """Forget the head type ``name`` (one registered with :func:`register_head_type`)."""
    head_type(name)
    del _TYPES[name]


def head_type_names() -> tuple[str, ...]:
    """The names of every registered head type, sorted."""
    return tuple(sorted(_TYPES))


def head_type(name: Any) -> HeadType:
    """The registered head type ``name``; a PolicyError listing the known ones for any other."""
    if not isinstance(name, str) or name not in _TYPES:
        raise PolicyError(f"unknown head type {name!r}; known head types: {', '.join(head_type_names())} (or "
                          f"register one with ppll_compile.heads.types.register_head_type)")
    return _TYPES[name]


def head_type_for(config: Mapping[str, Any] | None) -> HeadType | None:
    """The registered type a head config names; ``None`` for a config of no registered type (a policy callable's
    head, the last stage's ``model`` head, an empty config)."""
    name = (config or {}).get("type")
    return _TYPES.get(name) if isinstance(name, str) else None

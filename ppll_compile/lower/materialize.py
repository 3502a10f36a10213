"""Give the stages of a model built on the meta device their tensors, each stage on its own device only.

``compile()`` of a meta model allocates every stage this process runs with ``empty_like`` on the stage's device
(the ``to_empty`` of the stage's own tensors), then fills them: by default with the model's own initialisation
(Hugging Face's ``_init_weights`` where the model has it, else ``reset_parameters()`` of every module the stage
holds), or by the user's ``materialize=fn(stage_module, stage_index, device)`` hook, or from ``state_dict=``
(a callable ``load(stage_index, names) -> {name: tensor}``, or one mapping for every stage). Under ``torchrun``
only the stage of this ``RANK`` is materialised; every other stage stays on meta.

Whatever draws random numbers while a stage is filled, or while an auxiliary head is built, draws them from torch's
default generators seeded by (the seed, the stage, which of the two) (:func:`seeded_init`; the seed is
``torch.initial_seed()``, rank 0's under ``torchrun``), and the caller's generator states are restored afterwards: a
stage's tensors and its head get the same values whichever process builds them and whichever other stages it builds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor, nn

from ..capture.meta import MATERIALIZE_HELP
from ..errors import PPLLError
from ..plans.plan import Plan
from .stages import Stage

MaterializeHook = Callable[[Stage, int, torch.device], None]
"""``fn(stage_module, stage_index, device)``: fills the stage's tensors, already allocated (uninitialised) on
``device``; ``stage_module.module.named_parameters()`` and ``named_buffers()`` carry the model's own names."""

StateDictSource = Union[Callable[[int, list[str]], Mapping[str, Tensor]], Mapping[str, Tensor]]
"""``load(stage_index, names) -> {name: tensor}`` for the names (the model's ``state_dict`` keys) a stage holds, or
one mapping (a whole state dict) that every stage takes its names from."""


@dataclass(frozen=True, kw_only=True)
class Materialization:
    """How ``compile()`` gives a meta model's stages their values, and which stages this process materialises."""

    hook: MaterializeHook | None = None
    """The user's ``materialize=`` hook; ``None``: the model's own initialisation (and ``state_dict``)."""
    state_dict: StateDictSource | None = None
    """The user's ``state_dict=``, loaded over the model's own initialisation."""
    stages: frozenset[int] | None = None
    """The stages materialised here; ``None``: every stage (see :func:`local_stages`)."""
    seed: int | None = None
    """The seed a stage's values are drawn from, by stage (:func:`seeded_init`); ``None``: the caller's generators."""

    def __post_init__(self) -> None:
        if self.hook is not None and self.state_dict is not None:
            raise ValueError("compile() takes materialize= or state_dict=, not both: the hook fills every tensor of "
                             "a stage itself (it may load a state dict); drop one of them")
        if self.hook is not None and not callable(self.hook):
            raise TypeError(f"materialize must be a callable fn(stage_module, stage_index, device), got "
                            f"{type(self.hook).__name__}")
        if self.state_dict is not None and not (callable(self.state_dict) or isinstance(self.state_dict, Mapping)):
            raise TypeError(f"state_dict must be a mapping name -> tensor or a callable load(stage_index, names), "
                            f"got {type(self.state_dict).__name__}")

    def how(self) -> str:
        """How the stages get their values, as the plan's note says it."""
        if self.hook is not None:
            return f"filled by the materialize= hook {getattr(self.hook, '__name__', type(self.hook).__name__)}"
        if self.state_dict is not None:
            return "loaded from state_dict= over the model's own initialisation"
        return "initialised by the model's own _init_weights/reset_parameters()"


def local_stages(plan: Plan, given: Iterable[int] | None) -> frozenset[int] | None:
    """The stages this process materialises: ``given``; else under ``torchrun`` (``WORLD_SIZE`` equal to the
    plan's world size, more than one) the stage that rank ``RANK`` runs; else ``None`` (every stage)."""
    if given is not None:
        stages = frozenset(int(i) for i in given)
        wrong = sorted(i for i in stages if not 0 <= i < plan.num_stages)
        if wrong:
            raise ValueError(f"local_stages names stage(s) {wrong}, but the plan has stages 0 to "
                             f"{plan.num_stages - 1}")
        return stages
    world, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if world is None or rank is None or int(world) != plan.world_size or plan.world_size < 2:
        return None
    first = 0
    for j, s in enumerate(plan.stages):  # ranks go to the stages in order, ``replicas`` each
        if first <= int(rank) < first + s.replicas:
            return frozenset({j})
        first += s.replicas
    return None


def materialize_stage(model: nn.Module, stage: Stage, index: int, device: torch.device,
                      how: Materialization, tied: Sequence[str] = ()) -> None:
    """Allocate ``stage``'s meta tensors on ``device`` (the model then holds the same new tensors) and fill them.

    ``tied``: the plan's untied parameters (``Plan.untied``: each tensor's names joined by `` = ``). Each stage that
    holds one (the model's tensor, or a later stage's copy of it) gets the same values in every process: the state
    dict's under any of its names, else the draw of :func:`_tied_values`, so that every copy starts equal to the
    model's tensor as it does in a model built normally.
    """
    names = _model_names(model)
    fresh = _allocate(stage, device)
    _repoint(model, fresh)
    with seeded_init(how.seed, index, "stage", device):
        if how.hook is not None:  # the hook fills every tensor of the stage, tied copies included
            try:
                how.hook(stage, index, device)
            except Exception as e:  # the user's code: named by stage, its error kept as the cause
                raise PPLLError(f"the materialize= hook{_called(how.hook)} raised for stage {index} "
                                f"({type(e).__name__}: {e}); fix the hook (it is called as fn(stage_module, "
                                f"stage_index, device) for every stage this process runs)") from e
        else:
            given = _fetch(model, stage, index, names, fresh, how.state_dict) if how.state_dict is not None else {}
            copies = set() if how.state_dict is not None else _tied_names(tied)
            _initialise(model, stage, index, fresh, set(given), copies)
            with torch.no_grad():
                if copies:
                    _fill_tied(model, stage, {id(n) for _, n in fresh.values()}, tied, device, how.seed)
                for key, (new, value) in given.items():  # the loaded values win over the initialisation
                    new.copy_(value)
    stage.to(device)  # any tensor that was not on meta


def _fill_tied(model: nn.Module, stage: Stage, allocated: set[int], tied: Sequence[str], device: torch.device,
               seed: int | None) -> None:
    """Give every tensor of ``stage`` just allocated under a name of an untied parameter its :func:`_tied_values`."""
    group = _tied_names(tied)
    for name, t in (*stage.module.named_parameters(remove_duplicate=False),
                    *stage.module.named_buffers(remove_duplicate=False)):
        if id(t) in allocated and name in group:
            t.copy_(_tied_values(model, group[name][0], device, seed))


def _tied_names(tied: Sequence[str]) -> dict[str, list[str]]:
    """Each name of an untied parameter (``Plan.untied`` entries) -> all the names of its tensor, the model's first."""
    return {name: names for names in (entry.split(" = ") for entry in tied) for name in names}


def _tied_values(model: nn.Module, name: str, device: torch.device, seed: int | None) -> Tensor:
    """The initial values of the model's tensor ``name`` drawn by its own module's initialisation on a fresh copy of
    that module, from the generators seeded by (``seed``, ``name``): the same whichever stage or process asks, so a
    stage's untied copy equals the model's tensor that another process holds."""
    path, _, attr = name.rpartition(".")
    owner = model.get_submodule(path)
    fresh = copy.deepcopy(owner).to_empty(device=device, recurse=False)
    hf_init = getattr(model, "_init_weights", None)
    with seeded_init(seed, 0, f"tied/{name}", device):
        if callable(hf_init):
            hf_init(fresh)
        elif callable(getattr(fresh, "reset_parameters", None)):
            fresh.reset_parameters()
        else:
            raise PPLLError(f"the meta-built model's tied tensor {name} has no initialisation to draw its untied "
                            f"copies from ({type(owner).__name__} has no reset_parameters()); give it values: "
                            f"{MATERIALIZE_HELP}")
    return getattr(fresh, attr).detach()


def init_seed(seed: int, stage: int, part: str) -> int:
    """The 63-bit seed of stage ``stage``'s ``part`` (``"stage"``: its meta-built tensors; ``"head"``: its auxiliary
    head) from ``seed``: the same in every process, on every platform (no salted ``hash``)."""
    digest = hashlib.sha256(f"ppll-init/{seed}/{stage}/{part}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded_init(seed: int | None, stage: int, part: str, device: torch.device | None = None) -> Iterator[None]:
    """Run the body with torch's default CPU generator (and ``device``'s, a CUDA device) seeded by
    :func:`init_seed`, the caller's generator states restored afterwards; ``seed=None``: the caller's generators."""
    if seed is None:
        yield
        return
    value = init_seed(seed, stage, part)
    cuda = [torch.cuda.current_device() if device.index is None else device.index] \
        if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(value)
        for i in cuda:
            with torch.cuda.device(i):
                torch.cuda.manual_seed(value)
        yield


def _model_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each of the model's tensors (tied ones have several), by the tensor's id."""
    names: dict[int, list[str]] = {}
    for k, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(k)
    return names


def _allocate(stage: Stage, device: torch.device) -> dict[int, tuple[Tensor, Tensor]]:
    """Replace every meta tensor of ``stage`` by an uninitialised one on ``device``: id of the old -> (old, new)."""
    fresh: dict[int, tuple[Tensor, Tensor]] = {}
    for m in stage.modules():
        for slots in (m._parameters, m._buffers):
            for k, t in slots.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in fresh:
                    new = torch.empty_like(t, device=device)
                    fresh[id(t)] = (t, nn.Parameter(new, requires_grad=t.requires_grad)
                                    if isinstance(t, nn.Parameter) else new)
                slots[k] = fresh[id(t)][1]
    return fresh


def _repoint(model: nn.Module, fresh: dict[int, tuple[Tensor, Tensor]]) -> None:
    """Point the model's modules at the stage's new tensors, so that the model and the stage share them."""
    for m in model.modules():
        for slots in (m._parameters, m._buffers):
            for k, t in slots.items():
                if t is not None and id(t) in fresh:
                    slots[k] = fresh[id(t)][1]


def _initialise(model: nn.Module, stage: Stage, index: int, fresh: dict[int, tuple[Tensor, Tensor]],
                loaded: set[int], copies: Collection[str] = ()) -> None:
    """The model's own initialisation of every module whose tensors the stage just allocated; a tensor no module
    initialises (and no state dict gave, and that is not one of the untied ``copies`` :func:`_fill_tied` fills) is an
    error."""
    new = {id(n): old for old, n in fresh.values()}
    hf_init = getattr(model, "_init_weights", None)
    covered: set[int] = set()
    with torch.no_grad():
        for path, m in model.named_modules():
            own = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None and id(t) in new]
            if not own:
                continue
            if callable(hf_init):
                hf_init(m)
            elif callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
            else:
                continue
            covered.update(id(t) for t in own)
    if callable(hf_init):
        return  # Hugging Face initialises what its models hold, unknown modules included
    left = [k for k, t in (*stage.module.named_parameters(), *stage.module.named_buffers())
            if id(t) in new and id(t) not in covered and id(new[id(t)]) not in loaded and k not in copies]
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        raise PPLLError(f"stage {index} of the meta-built model holds {len(left)} tensor(s) that no module "
                        f"initialises ({shown}: their module has no reset_parameters()); give them values: "
                        f"{MATERIALIZE_HELP}")


def _fetch(model: nn.Module, stage: Stage, index: int, names: dict[int, list[str]],
           fresh: dict[int, tuple[Tensor, Tensor]], source: StateDictSource) -> dict[int, tuple[Tensor, Tensor]]:
    """The state dict's value for each of the stage's new tensors, by the id of the old one: (new, value). A
    parameter or persistent buffer it lacks, or a value of another shape, is an error. A stage's own copy of an
    untied parameter (not the model's tensor) is asked for by the name the stage reads it under."""
    in_stage = _model_names(stage.module)
    wanted = {id(old): names.get(id(old)) or in_stage.get(id(new), []) for old, new in fresh.values()}
    keys = sorted(k for ks in wanted.values() for k in ks)
    values = _loaded(source, index, keys) if callable(source) else {k: source[k] for k in keys if k in source}
    persistent = _persistent(model)
    given: dict[int, tuple[Tensor, Tensor]] = {}
    missing = []
    for old, new in fresh.values():
        key = next((k for k in wanted[id(old)] if k in values), None)
        if key is None:
            if any(k in persistent for k in wanted[id(old)]):
                missing.extend(wanted[id(old)][:1])
            continue
        value = values[key]
        _check_value(value, key, index, new)
        if tuple(value.shape) != tuple(new.shape):
            raise PPLLError(f"state_dict gives {key!r} of shape {tuple(value.shape)} for stage {index}, whose tensor "
                            f"has shape {tuple(new.shape)}; load the checkpoint of this model's configuration")
        given[id(old)] = (new, value)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise PPLLError(f"state_dict gives no value for {len(missing)} tensor(s) of stage {index} ({shown}); "
                        f"return every name asked for (load(stage_index, names) gets them), or use materialize= "
                        f"to fill them otherwise")
    return given


def _called(fn: object) -> str:
    """`` name`` of the user's function ``fn`` for a message (nothing for a lambda)."""
    name = getattr(fn, "__name__", "")
    return f" {name}" if name.isidentifier() else ""


def _found(value: object) -> str:
    """What ``value`` is, by its type (never its content): ``None``, ``a float``, ``an int``."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _loaded(load: Callable[[int, list[str]], Mapping[str, Tensor]], index: int, keys: list[str]) -> Mapping:
    """``load(index, keys)``, the user's ``state_dict=`` loader, whose error or odd result is named by stage."""
    try:
        values = load(index, keys)
    except Exception as e:  # the user's code: named by stage, its error kept as the cause
        raise PPLLError(f"the state_dict= loader{_called(load)} raised for stage {index} ({type(e).__name__}: {e}); "
                        f"fix the loader (it is called as load(stage_index, names) with the stage's state_dict "
                        f"keys)") from e
    if not isinstance(values, Mapping):
        raise PPLLError(f"the state_dict= loader{_called(load)} returned {_found(values)} for stage {index}, not a "
                        f"mapping name -> tensor; return a dict holding the names it is asked for "
                        f"(load(stage_index, names) -> {{name: tensor}})")
    return values


def _check_value(value: object, key: str, index: int, new: Tensor) -> None:
    """Refuse a ``state_dict=`` value for ``key`` of stage ``index`` that is no tensor, or one without values."""
    if not isinstance(value, Tensor):
        raise PPLLError(f"state_dict= gives {_found(value)} for {key!r} of stage {index}, not a tensor; give a tensor "
                        f"of shape {tuple(new.shape)} (e.g. from torch.load(path, map_location='cpu') or "
                        f"safetensors.torch.load_file(path))")
    if value.is_meta:
        raise PPLLError(f"state_dict= gives a tensor on the meta device for {key!r} of stage {index}, which holds no "
                        f"values; give real values (load the checkpoint with torch.load(path, map_location='cpu') or "
                        f"safetensors.torch.load_file(path), not on the meta device)")


def _persistent(model: nn.Module) -> set[str]:
    """The names of the model's parameters and persistent buffers: what a state dict holds."""
    out = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    for path, m in model.named_modules(remove_duplicate=False):
        out.update(f"{path}.{k}" if path else k for k in m._buffers if k not in m._non_persistent_buffers_set)
    return out


def meta_note(how: Materialization, plan: Plan, here: Sequence[int]) -> str:
    """The plan's note on a meta-built model compiled: which stages were materialised here, and how."""
    where = "every stage" if len(here) == plan.num_stages else \
        f"stage(s) {', '.join(map(str, here))} (this rank's; the others stay on meta)" if here else "no stage"
    return f"the model was built on the meta device: {where} allocated on its own device and {how.how()}"


def planned(how: Materialization, plan: Plan, given: Iterable[int] | None, seed: int) -> tuple[Materialization, Plan]:
    """``how`` for ``plan``: the stages this process materialises (``given``, see :func:`local_stages`) and the seed
    of their initialisation; and ``plan`` with its note on them (:func:`meta_note`)."""
    how = dataclasses.replace(how, stages=local_stages(plan, given), seed=seed)
    here = sorted(range(plan.num_stages) if how.stages is None else how.stages)
    return how, dataclasses.replace(plan, notes=(*plan.notes, meta_note(how, plan, here)))

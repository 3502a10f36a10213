"""A plan as a file: JSON and YAML, written and read back, with plan files from before a field existed."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ppll_compile.partitioners.batch import most_replicas, split_refusal

# upward (plans -> cost): a plan file's sizes are bounded by the largest device of the hardware presets
from ..cost.hardware import LARGEST_DEVICE, LARGEST_DEVICE_BYTES
from ..documents import (
    LongNumber,
    described,
    json_error,
    load_json,
    load_yaml,
    long_number,
    not_utf8,
    yaml_error,
)
from ..errors import PlanError
from .specs import BlockPlan, FrozenDict, StagePlan, TensorSpec, required
from .units import format_bytes

PLAN_VERSION = 1
"""The plan file format's version."""

EXPORT_NOTE = "captured with torch.export"
"""How the notes of a plan file written before the ``tracer`` field begin when ``torch.export`` captured the model."""
_UNTIED_NOTE = re.compile(r"^tied parameter\(s\) (.*) used by stages \d+ to \d+: untied")
"""The note that listed untied parameters in a plan file written before the ``untied`` field."""

_P = TypeVar("_P", bound="PlanFile")

MAX_PLAN_BYTES = 64 * 2**20
"""The largest plan file read (64 MiB): a plan lists each traced node once or twice, about 50 MiB for a graph of a
million nodes; the YAML reader takes about a second per MiB."""
MAX_DEVICES = 4096
"""The most devices a plan may use, every stage's replicas together (and so the most stages, replicas per stage and
devices per node): the runtime starts one process per device, and more than 4096 is beyond the jobs its process
groups are made for; a plan asking for more is a typing error."""
MAX_CLASSES = 2**24
"""The most classes a plan's heads may score: 64 times the largest vocabulary of today's language models (256,000)."""
MAX_BATCH = 2**31 - 1
"""The largest planned batch: torch indexes a batch with 32-bit integers in many kernels."""


def _from_old_notes(d: dict[str, Any]) -> dict[str, Any]:
    """The ``tracer`` and ``untied`` fields of a plan file written before they existed, read from its notes once."""
    notes = [str(n) for n in d.get("notes") or ()]
    old: dict[str, Any] = {}
    if "tracer" not in d:
        old["tracer"] = "export" if any(n.startswith(EXPORT_NOTE) for n in notes) else "fx"
    if "untied" not in d:
        old["untied"] = [name for n in notes if (m := _UNTIED_NOTE.match(n)) for name in m.group(1).split(", ")]
    return {**d, **old}


class PlanFile:
    """How :class:`~ppll_compile.plans.plan.Plan` is written and read (a base class, so the plan's own class stays about
    its data)."""

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON/YAML values, and the plan's totals."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("inputs", "stages", "blocks"):
                v = [t.to_dict() for t in v]
            elif isinstance(v, FrozenDict):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            d[f.name] = v
        if d.get("gpus_per_node") is None:  # one node: the file reads as it did before nodes existed
            d.pop("gpus_per_node", None)
            d.pop("inter_node_bandwidth", None)
            if d.get("intra_node_bandwidth") is None:
                d.pop("intra_node_bandwidth", None)
            for stage in d["stages"]:
                stage.pop("crosses_nodes", None)
        for name in ("checkpoint_activations", "frozen"):  # unused: the file reads as it did before they existed
            if not d.get(name):
                d.pop(name, None)
        d["totals"] = self.totals()
        return d

    @classmethod
    def from_dict(cls: type[_P], d: dict[str, Any]) -> _P:
        """The plan a :meth:`to_dict` mapping describes, validated; a plan file from before the ``tracer`` and
        ``untied`` fields gets them from its notes."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a mapping, got {described(d)}; {_WAY_OUT}")
        version = d.get("version")
        if version != PLAN_VERSION:
            given = repr(version) if _is_int(version) or isinstance(version, LongNumber) else described(version)
            raise PlanError(f"plan version {given} is not supported; this ppll-compile reads version "
                            f"{PLAN_VERSION} (re-create the plan with `ppll-plan MODEL.py --yaml plan.yaml`)")
        check_plan_sizes(d)
        d = _from_old_notes(d)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"totals"})
        if unknown:
            raise PlanError(f"unknown plan field(s) {unknown}; known fields: {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in d and required(f))
        if missing:
            raise PlanError(f"plan is missing field(s) {missing}")
        kw: dict[str, Any] = {}
        for k in names & set(d):
            v = d[k]
            if k in ("inputs", "stages", "blocks"):
                item = {"inputs": TensorSpec, "stages": StagePlan, "blocks": BlockPlan}[k]
                try:
                    v = tuple(item.from_dict(s) for s in v)
                except KeyError as e:
                    raise PlanError(f"an entry of the plan's {k} is missing field {e.args[0]!r}") from None
            elif isinstance(v, list):
                v = tuple(v)
            kw[k] = v
        plan = cls(**kw)
        plan.validate()
        return plan

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls: type[_P], text: str) -> _P:
        return cls.from_dict(parse_plan_text(text, json_text=True))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)

    @classmethod
    def from_yaml(cls: type[_P], text: str) -> _P:
        return cls.from_dict(parse_plan_text(text))

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON or YAML, chosen by the file suffix."""
        path = Path(path)
        text = self.to_json() if path.suffix == ".json" else self.to_yaml()
        path.write_text(text)
        return path

    @classmethod
    def load(cls: type[_P], path: str | Path) -> _P:
        """Read a plan written by :meth:`save` (JSON or YAML)."""
        path = Path(path)
        text = read_plan_text(path)
        try:
            return cls.from_json(text) if path.suffix == ".json" else cls.from_yaml(text)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None
        except (ValueError, TypeError, OverflowError) as e:  # a field of a version-1 plan of the wrong type
            raise PlanError(f"{path}: malformed plan field ({e}); fix the plan file, or re-create it with "
                            f"`ppll-plan MODEL.py --yaml plan.yaml`") from None


def read_plan_text(path: Path) -> str:
    """The text of the plan file ``path``; a :class:`PlanError` says why it cannot be read."""
    if path.is_dir():
        raise PlanError(f"plan file {str(path)!r} is a directory; pass the path of a plan file written by "
                        f"`ppll-plan MODEL.py --yaml plan.yaml` (or --json)")
    if not path.is_file():
        raise PlanError(f"plan file {str(path)!r} does not exist")
    try:
        size = path.stat().st_size
        if size > MAX_PLAN_BYTES:
            raise PlanError(f"{path}: the plan file is {format_bytes(size)}, over the {format_bytes(MAX_PLAN_BYTES)} a "
                            f"plan may take (a plan lists each traced node once or twice: about 50 MiB for a million "
                            f"nodes); pass a plan written by `ppll-plan MODEL.py --yaml plan.yaml` (or --json)")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{path}: not a plan file ({not_utf8(e)}); {_WAY_OUT}") from None
    except OSError as e:
        raise PlanError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None


def parse_plan_text(text: str, json_text: bool = False) -> Any:
    """The document of a plan file's text (YAML, or JSON with ``json_text``); a :class:`PlanError` when it is not
    valid YAML or JSON, is nested deeper than the reader can follow, or holds an integer longer than Python reads
    from text. The errors quote nothing of the text (a file that is no plan may be passed as one)."""
    try:
        d = load_json(text) if json_text else load_yaml(text)
    except RecursionError:
        raise PlanError("the plan is nested deeper than the reader can follow (a plan nests a few levels: stages, "
                        "a stage's head, its config); pass a plan written by `ppll-plan MODEL.py --yaml plan.yaml`"
                        ) from None
    except yaml.YAMLError as e:
        raise PlanError(f"{yaml_error(e)}; fix the file's syntax, or {_WAY_OUT}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{json_error(e)}; fix the file's syntax, or {_WAY_OUT}") from None
    _check_long_numbers(d)
    return d


_WAY_OUT = "pass a plan written by `ppll-plan MODEL.py --yaml plan.yaml` (or --json)"


def _check_long_numbers(d: Any) -> None:
    """Refuse an integer longer than Python reads from text, naming its field: no plan value is that long. Only in a
    plan of this version (what is not a plan is refused by the version check, quoting none of its keys)."""
    if not isinstance(d, dict) or d.get("version") != PLAN_VERSION or (found := long_number(d)) is None:
        return
    at, number = found
    raise PlanError(f"{at} is {number!r}, more than the {sys.get_int_max_str_digits():,} digits Python reads from "
                    f"text, and no plan value is that long; fix the plan file, or re-create it with "
                    f"`ppll-plan MODEL.py --yaml plan.yaml`")


def read_plan_document(path: str | Path) -> Any:
    """The parsed plan file ``path`` (JSON by its suffix ``.json``, else YAML), its sizes checked (:func:`check_plan_sizes`); a
    :class:`PlanError` naming the file when it cannot be read, is too big or too deeply nested, or asks for more
    than a device could hold."""
    path = Path(path)
    text = read_plan_text(path)
    try:
        d = parse_plan_text(text, json_text=path.suffix == ".json")  # YAML 1.1 reads 1e-06 as text
        check_plan_sizes(d)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    return d


def unrunnable_stage(index: int, replicas: int, batch: int) -> str | None:
    """Why stage ``index`` on ``replicas`` replicas cannot run at ``batch`` examples a step (the runtime splits a
    batch by rows, :func:`~ppll_compile.partitioners.batch.split_refusal`), with the way out; ``None`` when it can."""
    why = split_refusal(batch, replicas)
    if why is None:
        return None
    return (f"stage {index} runs on {replicas} replicas, but {why} (each replica trains on examples of its own), "
            f"so the plan cannot run; set stages[{index}].replicas to at most {most_replicas(batch)}, or re-create "
            f"the plan (`ppll-plan MODEL.py --yaml plan.yaml`: replicas never exceed the batch)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any, field: str, low: int, high: int, why: str) -> int:
    if not _is_int(value) or not low <= value <= high:
        got = repr(value) if _is_int(value) or isinstance(value, (LongNumber, float)) else described(value)
        raise PlanError(f"{field} must be an integer from {low} to {high} ({why}), got {got}; fix the plan "
                        f"file, or re-create it with `ppll-plan MODEL.py --yaml plan.yaml`")
    return value


def _check_tensor(t: Any, field: str) -> None:
    """A tensor's shape and bytes: integers, and no more bytes than the largest device holds."""
    if not isinstance(t, dict):
        return  # the plan's own checks name a malformed entry
    shape = t.get("shape")
    if isinstance(shape, list):
        for i, n in enumerate(shape):
            _count(n, f"{field}.shape[{i}]", 0, 2**62, "a dimension's length")
    if "bytes" in t:
        _count(t["bytes"], f"{field}.bytes", 0, LARGEST_DEVICE_BYTES,
               f"{format_bytes(LARGEST_DEVICE_BYTES)}, the memory of the largest device, {LARGEST_DEVICE}")


def check_plan_sizes(d: Any) -> None:
    """Check every count and size a user may write in a plan document before anything is built from it: the batch
    size, classes, devices per node, stages and their replicas (:data:`MAX_DEVICES` devices together), the inputs'
    and boundaries' shapes and bytes; a :class:`PlanError` names the field, its value, the bound and why."""
    if not isinstance(d, dict):
        return  # from_dict and read_saved_plan say what a plan must be
    inputs = d.get("inputs") if isinstance(d.get("inputs"), list) else []
    for i, t in enumerate(inputs):
        _check_tensor(t, f"inputs[{i}]")
    for i, block in enumerate(d.get("blocks") if isinstance(d.get("blocks"), list) else ()):
        _check_tensor(block.get("output") if isinstance(block, dict) else None, f"blocks[{i}].output")
    # a value that is no integer at all is named by PlanOptions and Plan.validate
    given = {k: d[k] for k in ("batch_size", "num_classes", "gpus_per_node") if _is_int(d.get(k))}
    if "batch_size" in given:
        batch = _count(d["batch_size"], "batch_size", 1, MAX_BATCH, "torch indexes a batch with 32-bit integers")
        per_example = sum(t["bytes"] // t["shape"][0] for t in inputs if isinstance(t, dict) and t.get("shape")
                          and isinstance(t.get("bytes"), int) and t["shape"][0])
        if per_example * batch > LARGEST_DEVICE_BYTES:
            raise PlanError(f"batch_size {batch} makes the inputs alone {format_bytes(per_example * batch)} "
                            f"({per_example:,} bytes an example), more than the {format_bytes(LARGEST_DEVICE_BYTES)} "
                            f"of the largest device ({LARGEST_DEVICE}); plan a smaller batch")
    if "num_classes" in given:
        _count(d["num_classes"], "num_classes", 1, MAX_CLASSES, "64 x the largest vocabulary of today's models")
    if "gpus_per_node" in given:
        _count(d["gpus_per_node"], "gpus_per_node", 1, MAX_DEVICES, "the most devices a plan may use")
    stages = d.get("stages")
    if not isinstance(stages, list):
        return
    if len(stages) > MAX_DEVICES:
        raise PlanError(f"stages lists {len(stages)} stages, more than {MAX_DEVICES}, the most devices a plan may "
                        f"use (one device a stage); merge stages")
    replicas = {}
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            continue
        replicas[i] = _count(s.get("replicas", 1), f"stages[{i}].replicas", 1, MAX_DEVICES,
                             "the most devices a plan may use")
        for j, t in enumerate(s.get("boundary") or ()):
            _check_tensor(t, f"stages[{i}].boundary[{j}]")
    if (devices := sum(replicas.values())) > MAX_DEVICES:
        raise PlanError(f"the stages' replicas add up to {devices} devices, more than {MAX_DEVICES}, the most a "
                        f"plan may use; lower stages[*].replicas")
    for i, r in replicas.items():
        if "batch_size" in given and (why := unrunnable_stage(i, r, d["batch_size"])) is not None:
            raise PlanError(why)

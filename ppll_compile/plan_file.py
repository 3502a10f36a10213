"""A plan as a file: JSON and YAML, written and read back, with plan files from before a field existed."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import PlanError
from .plan_specs import BlockPlan, FrozenDict, StagePlan, TensorSpec, required

PLAN_VERSION = 1
"""The plan file format's version."""

EXPORT_NOTE = "captured with torch.export"
"""How the notes of a plan file written before the ``tracer`` field begin when ``torch.export`` captured the model."""
_UNTIED_NOTE = re.compile(r"^tied parameter\(s\) (.*) used by stages \d+ to \d+: untied")
"""The note that listed untied parameters in a plan file written before the ``untied`` field."""

_P = TypeVar("_P", bound="PlanFile")


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
    """How :class:`~ppll_compile.plan.Plan` is written and read (a base class, so the plan's own class stays about
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
        d["totals"] = self.totals()
        return d

    @classmethod
    def from_dict(cls: type[_P], d: dict[str, Any]) -> _P:
        """The plan a :meth:`to_dict` mapping describes, validated; a plan file from before the ``tracer`` and
        ``untied`` fields gets them from its notes."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a mapping, got {type(d).__name__}")
        version = d.get("version")
        if version != PLAN_VERSION:
            raise PlanError(f"plan version {version!r} is not supported; this ppll-compile reads version "
                            f"{PLAN_VERSION} (re-create the plan with `ppll-plan MODEL.py --yaml plan.yaml`)")
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
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)

    @classmethod
    def from_yaml(cls: type[_P], text: str) -> _P:
        return cls.from_dict(yaml.safe_load(text))

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
        except (ValueError, TypeError, OverflowError, yaml.YAMLError) as e:
            raise PlanError(f"{path}: not a readable plan ({e})") from None


def read_plan_text(path: Path) -> str:
    """The text of the plan file ``path``; a :class:`PlanError` says why it cannot be read."""
    if path.is_dir():
        raise PlanError(f"plan file {str(path)!r} is a directory; pass the path of a plan file written by "
                        f"`ppll-plan MODEL.py --yaml plan.yaml` (or --json)")
    if not path.is_file():
        raise PlanError(f"plan file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{path}: not a plan file (byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8 "
                        f"text); pass a plan written by `ppll-plan MODEL.py --yaml plan.yaml` (or --json)") from None
    except OSError as e:
        raise PlanError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None

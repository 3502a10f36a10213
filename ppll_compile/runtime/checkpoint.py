"""Checkpoints of a pipeline: one file per stage plus a manifest written last, every file replaced atomically."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..errors import PPLLError
from ..plan import Plan

__all__ = ["CheckpointError", "identity", "remove_manifest", "save_stage", "write_manifest", "read", "MANIFEST"]

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(PPLLError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or was saved for another model or plan."""


def identity(plan: Plan, parameters: Sequence[Sequence[Tensor]], optimizers: Iterable[Optimizer]) -> dict[str, Any]:
    """What a checkpoint must match to be loaded: model class, cuts, heads, every stage's parameter shapes, and
    the classes of ``optimizers`` (those of the stages one process runs: one factory builds them all, so every
    process agrees)."""
    return {
        "model": plan.model,
        "stages": plan.num_stages,
        "cuts": list(plan.cuts),
        "heads": [s.head.to_dict()["config"] for s in plan.stages],
        "parameters": [[list(p.shape) for p in stage] for stage in parameters],
        "optimizer": sorted({type(o).__name__ for o in optimizers}),
    }


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stage_file(index: int) -> str:
    return f"stage-{index}.pt"


def remove_manifest(path: str | os.PathLike) -> None:
    """First step of a save: without a manifest, a save cut short leaves nothing that :func:`read` accepts."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path {str(root)!r} is a file; a checkpoint is a directory "
                              f"(one file per stage plus {MANIFEST}); pass a directory path")
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)


def save_stage(path: str | os.PathLike, state: dict[str, Any]) -> dict[str, Any]:
    """Write one stage's state atomically; its entry for the manifest (file name, bytes, sha256)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = _stage_file(state["stage"])
    _atomic_write(Path(path) / name, data)
    return {"stage": state["stage"], "file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(path: str | os.PathLike, ident: dict[str, Any], files: list[dict[str, Any]],
                   trainer: dict[str, Any]) -> None:
    """Last step of a save: the manifest that makes the checkpoint complete."""
    manifest = {"format": FORMAT, "identity": ident, "files": sorted(files, key=lambda f: f["stage"]),
                "trainer": trainer}
    _atomic_write(Path(path) / MANIFEST, json.dumps(manifest, indent=1).encode())


def _differences(saved: dict[str, Any], ours: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, what differs) for every part of the identity the checkpoint does not match."""
    out = []
    for key in ours:
        if saved.get(key) != ours[key]:
            if key == "parameters":
                for i, (a, b) in enumerate(zip(saved.get(key, []), ours[key])):
                    if a != b:
                        out.append((key, f"stage {i} parameter shapes differ ({len(a)} tensors saved, {len(b)} here)"))
            else:
                out.append((key, f"{key}: checkpoint has {saved.get(key)!r}, this pipeline has {ours[key]!r}"))
    return out


def read(path: str | os.PathLike, ident: dict[str, Any], stages: list[int]) -> tuple[dict[str, Any],
                                                                                      dict[int, dict[str, Any]]]:
    """The manifest's trainer state and the states of ``stages``, after checking completeness, integrity and match."""
    root = Path(path)
    man_path = root / MANIFEST
    if not man_path.is_file():
        raise CheckpointError(f"no {MANIFEST} in {str(root)!r}: not a checkpoint, or a save that did not "
                              f"finish; load an earlier checkpoint")
    try:
        manifest = json.loads(man_path.read_text())
        files = {f["stage"]: f for f in manifest["files"]}
        saved_ident = manifest["identity"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{str(man_path)!r} is corrupt ({e}); load an earlier checkpoint") from None
    diffs = _differences(saved_ident, ident)
    if diffs:
        ways = []
        if any(key != "optimizer" for key, _ in diffs):
            ways.append(" Compile the same model with the plan it was trained with (compile(model, plan=...)) "
                        "to load it.")
        if any(key == "optimizer" for key, _ in diffs):
            ways.append(" Build the trainer with the optimizer class it was trained with (trainer(optimizer=...)) "
                        "to load it.")
        raise CheckpointError(f"checkpoint {str(root)!r} was saved for another pipeline: "
                              + "; ".join(text for _, text in diffs) + "." + "".join(ways))
    states = {}
    for i in stages:
        entry = files.get(i)
        if entry is None:
            raise CheckpointError(f"{MANIFEST} in {str(root)!r} lists no file for stage {i}")
        file = root / entry["file"]
        data = file.read_bytes() if file.is_file() else None
        if data is None or len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            found = "is missing" if data is None else f"has {len(data)} bytes and another sha256"
            raise CheckpointError(f"{str(file)!r} {found}; {MANIFEST} expects {entry['bytes']} bytes, sha256 "
                                  f"{entry['sha256'][:12]}...: the checkpoint is corrupt or was partly "
                                  f"overwritten; load an earlier checkpoint")
        states[i] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return manifest["trainer"], states

"""Checkpoints of a pipeline: complete checkpoint directories under one root, switched to by an atomic pointer.

A checkpoint root ``path`` holds::

    path/latest          the name of the newest complete checkpoint (a small file, replaced atomically)
    path/ckpt-000007/    a complete checkpoint: stage-0.pt ... stage-{K-1}.pt and manifest.json
    path/ckpt-000006/    an older one, kept with ``save(path, keep=2)``

A save writes into ``path/.ckpt-000008.tmp-HOST-PID/`` (every process its stages' files, each fsynced), the
manifest last, renames that directory to ``ckpt-000008``, and only then replaces ``latest`` (write, fsync,
rename, fsync of the root). Checkpoints beyond ``keep`` are removed after that. So at every instant ``latest``
names a complete checkpoint: the old one until the pointer moves, the new one after. What an interrupted save
leaves (``.*.tmp-*`` entries, a complete directory newer than ``latest``) is never loaded; the next save
removes it, and a load removes the entries of processes on this host that are gone.

A directory holding ``manifest.json`` itself (one checkpoint, e.g. ``path/ckpt-000006``) loads as it is.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..errors import CheckpointError
from ..plan import Plan

MANIFEST = "manifest.json"
POINTER = "latest"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_TEMP = re.compile(r"^\.(?:ckpt-\d+|latest)\.tmp-(?P<host>.+)-(?P<pid>\d+)$")


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


# ---- files and directories ---------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _temp_name(name: str) -> str:
    return f".{name}.tmp-{socket.gethostname()}-{os.getpid()}"


def _root(path: str | os.PathLike) -> Path:
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path {str(root)!r} is a file; a checkpoint is a directory "
                              f"(one file per stage plus {MANIFEST}); pass a directory path")
    return root


def _pointed(root: Path) -> str | None:
    """The checkpoint name ``root/latest`` holds (``None`` without one)."""
    file = root / POINTER
    if not file.is_file():
        return None
    name = file.read_text(errors="replace").strip()
    if not _NAME.match(name):
        raise CheckpointError(f"{str(file)!r} holds {name[:40]!r}, not a checkpoint name like ckpt-000001; "
                              f"write the name of a complete checkpoint directory into it, or load that "
                              f"directory itself")
    return name


def _seq(name: str) -> int:
    m = _NAME.match(name)
    return int(m.group(1)) if m else -1


def _alive(host: str, pid: int) -> bool:
    """Whether the process ``pid`` on ``host`` may still be running (any other host's: assume so)."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _clean(root: Path, *, saving: bool) -> None:
    """Remove what interrupted saves left in ``root``: before a save all of it, before a load what dead
    processes on this host left (a live process may be saving)."""
    if not root.is_dir():
        return
    pointed = _pointed(root)
    for entry in root.iterdir():
        m = _TEMP.match(entry.name)
        if m is not None and (saving or not _alive(m.group("host"), int(m.group("pid")))):
            _remove(entry)
        elif saving and pointed is not None and _seq(entry.name) > _seq(pointed):  # the pointer never moved to it
            _remove(entry)


def latest(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint ``path`` stands for: the one ``path/latest`` names, or ``path`` itself when it
    holds a manifest; ``None`` when there is none (no checkpoint was completed there)."""
    root = _root(path)
    name = _pointed(root) if root.is_dir() else None
    if name is not None:
        target = root / name
        if not (target / MANIFEST).is_file():
            raise CheckpointError(f"{str(root / POINTER)!r} names {name}, but {str(target)!r} holds no "
                                  f"{MANIFEST} (removed by hand?); load an older checkpoint directory "
                                  f"in {str(root)!r} directly")
        return target
    return root if (root / MANIFEST).is_file() else None


# ---- saving ------------------------------------------------------------------------------------
def begin(path: str | os.PathLike) -> str:
    """First step of a save (one process): clean up leftovers, make the directory the stages write into;
    its name relative to ``path``."""
    root = _root(path)
    root.mkdir(parents=True, exist_ok=True)
    _clean(root, saving=True)
    taken = [_seq(e.name) for e in root.iterdir()] + [_seq(_pointed(root) or "")]
    temp = _temp_name(f"ckpt-{max(taken, default=-1) + 1:06d}")
    (root / temp).mkdir()
    return temp


def final_name(temp: str) -> str:
    """The name the directory ``temp`` (from :func:`begin`) gets once complete."""
    return temp[1:].split(".tmp-")[0]


def save_stage(path: str | os.PathLike, state: dict[str, Any]) -> dict[str, Any]:
    """Write one stage's state into the directory ``path`` (fsynced); its entry for the manifest."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = f"stage-{state['stage']}.pt"
    _write(Path(path) / name, data)
    return {"stage": state["stage"], "file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit(path: str | os.PathLike, temp: str, ident: dict[str, Any], files: list[dict[str, Any]],
           trainer: dict[str, Any], keep: int) -> Path:
    """Last step of a save (one process, once every stage file is written): the manifest, the rename of the
    directory, the pointer; then older checkpoints beyond ``keep`` go. The new checkpoint's directory."""
    root = Path(path)
    work = root / temp
    manifest = {"format": FORMAT, "identity": ident, "files": sorted(files, key=lambda f: f["stage"]),
                "trainer": trainer}
    _write(work / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(work)
    name = final_name(temp)
    os.replace(work, root / name)
    _fsync_dir(root)
    pointer = root / _temp_name(POINTER)
    _write(pointer, (name + "\n").encode())
    os.replace(pointer, root / POINTER)
    _fsync_dir(root)
    complete = sorted((e for e in root.iterdir() if _NAME.match(e.name)), key=lambda e: _seq(e.name), reverse=True)
    for old in complete[keep:]:
        doomed = root / _temp_name(old.name)
        os.replace(old, doomed)  # out of sight first: a removal cut short leaves only a leftover
        _remove(doomed)
    return root / name


# ---- loading -----------------------------------------------------------------------------------
def _identity_differences(saved: dict[str, Any], ours: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, what differs) for every part of the identity the checkpoint does not match."""
    out = []
    for key in ours:
        if saved.get(key) == ours[key]:
            continue
        if key == "parameters" and isinstance(saved.get(key), list):
            for i, (a, b) in enumerate(zip(saved[key], ours[key])):
                if len(a) != len(b):
                    out.append((key, f"stage {i} has {len(a)} parameter tensors in the checkpoint and {len(b)} here"))
                    continue
                j = next((j for j, (s, t) in enumerate(zip(a, b)) if s != t), None)
                if j is not None:
                    out.append((key, f"stage {i} parameter {j} has shape {a[j]} in the checkpoint and {b[j]} here "
                                     f"(the model was built with other sizes)"))
        else:
            out.append((key, f"{key}: checkpoint has {saved.get(key)!r}, this pipeline has {ours[key]!r}"))
    return out


def _manifest(root: Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``root``, after checking that every entry is there."""
    file = root / MANIFEST
    try:
        manifest = json.loads(file.read_bytes())
        assert isinstance(manifest, dict), "not a JSON object"
        for key in ("identity", "files", "trainer"):
            assert key in manifest, f"no {key!r} entry"
        assert isinstance(manifest["identity"], dict), "'identity' is not an object"
        assert isinstance(manifest["files"], list), "'files' is not a list"
        for f in manifest["files"]:
            assert isinstance(f, dict) and {"stage", "file", "bytes", "sha256"} <= set(f), \
                f"a 'files' entry lacks stage, file, bytes or sha256: {f!r}"
            assert "/" not in str(f["file"]) and "\\" not in str(f["file"]), f"file {f['file']!r} is not a plain name"
        assert isinstance(manifest["trainer"], dict) and isinstance(manifest["trainer"].get("batches"), int), \
            "'trainer' lacks the batch count"
    except (ValueError, AssertionError, OSError) as e:
        raise CheckpointError(f"{str(file)!r} is not a valid manifest ({e}); the checkpoint is corrupt: load an "
                              f"earlier one") from None
    return manifest


def read(path: str | os.PathLike, ident: dict[str, Any],
         stages: list[int]) -> tuple[Path, dict[str, Any], dict[int, dict[str, Any]]]:
    """The checkpoint directory read, its manifest's trainer state and the states of ``stages``, after checking
    completeness, integrity and match.

    Leftovers of saves whose process is gone are removed first; they are never read.
    """
    root = _root(path)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {str(root)!r}: the directory does not exist")
    _clean(root, saving=False)
    found = latest(root)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {str(root)!r} (neither {POINTER} nor {MANIFEST}): not a "
                              f"checkpoint, or no save there finished; load an earlier checkpoint")
    manifest = _manifest(found)
    diffs = _identity_differences(manifest["identity"], ident)
    if diffs:
        ways = []
        if any(key != "optimizer" for key, _ in diffs):
            ways.append(" Compile the same model with the plan it was trained with (compile(model, plan=...)) "
                        "to load it.")
        if any(key == "optimizer" for key, _ in diffs):
            ways.append(" Build the trainer with the optimizer class it was trained with (trainer(optimizer=...)) "
                        "to load it.")
        raise CheckpointError(f"checkpoint {str(found)!r} was saved for another pipeline: "
                              + "; ".join(text for _, text in diffs) + "." + "".join(ways))
    files = {f["stage"]: f for f in manifest["files"]}
    states = {}
    for i in stages:
        entry = files.get(i)
        if entry is None:
            raise CheckpointError(f"{MANIFEST} in {str(found)!r} lists no file for stage {i}")
        file = found / entry["file"]
        data = file.read_bytes() if file.is_file() else None
        if data is None or len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            what = "is missing" if data is None else f"has {len(data)} bytes and another sha256"
            raise CheckpointError(f"{str(file)!r} {what}; {MANIFEST} expects {entry['bytes']} bytes, sha256 "
                                  f"{str(entry['sha256'])[:12]}...: the checkpoint is corrupt or was partly "
                                  f"overwritten; load an earlier checkpoint")
        try:
            states[i] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - the digest matched, yet torch cannot read it
            raise CheckpointError(f"{str(file)!r} cannot be read by torch.load ({type(e).__name__}: {e}); load an "
                                  f"earlier checkpoint") from None
    return found, manifest["trainer"], states


# ---- checking a stage's state against the stage ------------------------------------------------
def _describe(t: Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _tensors(saved: Any, ours: Any, where: str, out: list[str]) -> None:
    """Append to ``out`` how the tensors of ``saved`` differ from ``ours`` (names, shapes, dtypes)."""
    if isinstance(ours, dict):
        if not isinstance(saved, dict):
            out.append(f"{where} is {type(saved).__name__} in the checkpoint, a mapping here")
            return
        missing, extra = [k for k in ours if k not in saved], [k for k in saved if k not in ours]
        if missing:
            out.append(f"{where} lacks {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''} "
                       f"in the checkpoint")
        if extra:
            out.append(f"{where} has {', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''} in the "
                       f"checkpoint, which this stage does not")
        for k in ours:
            if k in saved:
                _tensors(saved[k], ours[k], f"{where}[{k!r}]", out)
    elif isinstance(ours, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(ours):
            count = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            out.append(f"{where} has {count} entries in the checkpoint and {len(ours)} here")
            return
        for j, (s, o) in enumerate(zip(saved, ours)):
            _tensors(s, o, f"{where}[{j}]", out)
    elif isinstance(ours, Tensor):
        if not isinstance(saved, Tensor):
            out.append(f"{where} is {type(saved).__name__} in the checkpoint, a tensor here")
        elif saved.shape != ours.shape or saved.dtype != ours.dtype:
            out.append(f"{where} is {_describe(saved)} in the checkpoint and {_describe(ours)} here")
    elif ours is None and saved is not None:
        out.append(f"{where} is saved in the checkpoint, and this stage has none")


def _optimizer(saved: Any, ours: dict[str, Any], where: str, out: list[str]) -> None:
    """Append to ``out`` how a saved optimizer state cannot be loaded into one with state ``ours``."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        out.append(f"{where} is not an optimizer state (no 'state' and 'param_groups')")
        return
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
    mine = [len(g["params"]) for g in ours["param_groups"]]
    if sizes != mine:
        out.append(f"{where} has parameter groups of sizes {sizes} in the checkpoint and {mine} here")
        return
    for pid, state in ours["state"].items():  # this optimizer has stepped: its state tensors must match
        if pid in saved["state"]:
            _tensors(saved["state"][pid], state, f"{where} state of parameter {pid}", out)


def check_state(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """What keeps the saved state of a stage from loading into the stage whose state is ``ours`` (both as
    :meth:`Runner.state_dict` gives them): every tensor's name, shape and dtype, the optimizers' parameter
    groups, the schedulers and counters. Empty when it loads."""
    out: list[str] = []
    stage = ours["stage"]
    counters = ("steps", "reused", "dropped", "updates")
    modules = [k for k in ours if k not in ("stage", "optimizers", "schedulers", "scaler", *counters)]
    for key in modules:
        if key not in saved:
            out.append(f"stage {stage}: the checkpoint has no {key!r} state")
        else:
            _tensors(saved[key], ours[key], f"stage {stage} {key}", out)
    opts = saved.get("optimizers")
    if not isinstance(opts, list) or len(opts) != len(ours["optimizers"]):
        out.append(f"stage {stage}: the checkpoint has {len(opts) if isinstance(opts, list) else 'no'} optimizer "
                   f"states and this stage {len(ours['optimizers'])}")
    else:
        for j, (s, o) in enumerate(zip(opts, ours["optimizers"])):
            _optimizer(s, o, f"stage {stage} optimizer {j}", out)
    scheds = saved.get("schedulers")
    if not isinstance(scheds, list) or len(scheds) != len(ours["schedulers"]):
        have = "a learning-rate scheduler" if ours["schedulers"] else "no scheduler"
        had = "scheduler states" if scheds else "no scheduler state"
        out.append(f"stage {stage}: the checkpoint has {had} and this trainer has {have}; build the trainer with "
                   f"the scheduler= it was trained with")
    for key in counters:
        if key in ("dropped", "updates") and key not in saved:  # written before the counter existed
            continue
        if not isinstance(saved.get(key), int):
            out.append(f"stage {stage}: the checkpoint's {key!r} counter is {saved.get(key)!r}, not an integer")
    scaler = saved.get("scaler")  # absent before float16 scalers were saved (or without one): a fresh scale
    if scaler is not None and not (isinstance(scaler, dict) and isinstance(scaler.get("scale"), float)):
        out.append(f"stage {stage}: the checkpoint's gradient scaler state is {scaler!r}, not a GradScaler's")
    return out

"""Checkpoints of a pipeline: complete checkpoint directories under one root, switched to by an atomic pointer.

A checkpoint root ``path`` holds::

    path/latest          the name of the newest complete checkpoint (a small file, replaced atomically)
    path/ckpt-000007/    a complete checkpoint: stage-0.pt ... stage-{K-1}.pt and manifest.json
    path/ckpt-000006/    an older one, kept with ``save(path, keep=2)``

A save holds the root's lock (``path/.lock``, see :class:`.files.RootLock`): one writer at a time, a
second one is refused at once. It writes into ``path/.ckpt-000008.tmp-RANDOM/`` (every process its stages' files,
each created exclusively and fsynced), the manifest last, renames that directory to ``ckpt-000008``, and only then
replaces ``latest`` (a new file under a random name, fsync, rename, fsync of the root). Checkpoints beyond
``keep`` are removed after that. So at every instant ``latest`` names a complete checkpoint: the old one until the
pointer moves, the new one after. What an interrupted save leaves (``.*.tmp-*`` entries, a complete directory
newer than ``latest``) is never loaded; the next save removes it (where the directory allows). A load writes
nothing, so a read-only directory loads; when a save removes the checkpoint a load is reading (``keep=1``), the
load reads ``latest`` again and loads the new one.

A directory holding ``manifest.json`` itself (one checkpoint, e.g. ``path/ckpt-000006``) loads as it is.

Whoever can write into the root cannot make a load block, read without end or quote a file: ``latest``, manifests and
stage files are read by :func:`.files.read_regular` (special files and links out of the root refused unopened, sizes
checked first), ``latest``'s text is never quoted, a broken ``latest`` names the newest complete checkpoint found by
its name (:func:`newest_complete`), and counts below zero in a stage file are refused by file and field.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ...errors import CheckpointError
from ...plans.plan import Plan
from . import files
from .state_check import negative_counter

MANIFEST = "manifest.json"
POINTER = "latest"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_TEMP = re.compile(r"^\.(?:ckpt-\d+|latest)\.tmp-.+$")  # also the HOST-PID names of earlier versions
RETRIES = 5
"""How often a load reads ``latest`` again when the checkpoint it named was removed under it by a save."""
MOST_BATCHES = 2**62
"""The largest batch count a manifest may hold."""
MOST_BYTES = 2**48
"""The largest stage file a manifest may list (256 TiB)."""
MOST_POINTER = 4096
"""The largest ``latest`` file read (it holds one checkpoint name)."""
MOST_MANIFEST = 2**28
"""The largest manifest read (256 MiB; one holds a few numbers per parameter tensor)."""


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
def _root(path: str | os.PathLike) -> Path:
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path {str(root)!r} is a file; a checkpoint is a directory "
                              f"(one file per stage plus {MANIFEST}); pass a directory path")
    return root


def _pointed(root: Path) -> str | None:
    """The checkpoint name ``root/latest`` holds (``None`` without one). What it holds is never quoted: a pointer
    that is not a small regular file in ``root`` is refused unread (:func:`.files.read_regular`)."""
    file = root / POINTER
    try:
        data = files.read_regular(file, root, MOST_POINTER)
    except FileNotFoundError:
        return None
    except files.RefusedFile as e:
        found = newest_complete(root)
        where = f"The newest complete checkpoint directory there is {str(found)!r}: load it by that path, and" \
            if found is not None else "No complete checkpoint directory is there:"
        raise CheckpointError(f"{e}; it should be the small file that names the newest complete checkpoint. "
                              f"{where} remove {str(file)!r} to save into or load {str(root)!r} again") from None
    except OSError as e:
        raise CheckpointError(f"{str(file)!r} cannot be read ({e.strerror}); load a checkpoint directory "
                              f"in {str(root)!r} directly") from None
    name = data.decode(errors="replace").strip()
    if not _NAME.match(name):
        found = newest_complete(root)
        way = f"The newest complete checkpoint directory there is {str(found)!r}: write its name into it, or load " \
            f"that directory itself" if found is not None else "No complete checkpoint directory is there: write " \
            "the name of one into it, or load a checkpoint directory itself"
        raise CheckpointError(f"{str(file)!r} does not hold the name of a checkpoint like ckpt-000001 (it holds "
                              f"{len(data)} bytes of other text). {way}")
    return name


def newest_complete(root: Path) -> Path | None:
    """The complete checkpoint directory of ``root`` with the highest number (a ``ckpt-N`` directory, not a link,
    holding a manifest), found by name without ``latest``; ``None`` when there is none."""
    try:
        named = [e for e in root.iterdir() if _NAME.match(e.name) and e.is_dir() and not e.is_symlink()]
    except OSError:
        return None
    complete = [e for e in named if (e / MANIFEST).is_file() and not (e / MANIFEST).is_symlink()]
    return max(complete, key=lambda e: _seq(e.name), default=None)


def _seq(name: str) -> int:
    m = _NAME.match(name)
    return int(m.group(1)) if m else -1


def _clean(root: Path) -> None:
    """Remove what interrupted saves left in ``root`` (under the root's lock: no other save runs); what the
    directory does not allow to remove stays, never read."""
    pointed = _pointed(root)
    for entry in root.iterdir():
        if _TEMP.match(entry.name) or (pointed is not None and _seq(entry.name) > _seq(pointed)):
            files.remove_quietly(entry)  # the second kind: complete, but the pointer never moved to it


def latest(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint ``path`` stands for: the one ``path/latest`` names, or ``path`` itself when it
    holds a manifest; ``None`` when there is none (no checkpoint was completed there)."""
    root = _root(path)
    name = _pointed(root) if root.is_dir() else None
    if name is not None:
        target = root / name
        if not os.path.lexists(target / MANIFEST):  # one that is there but no regular file: refused when read
            raise CheckpointError(f"{str(root / POINTER)!r} names {name}, but {str(target)!r} holds no "
                                  f"{MANIFEST} (removed by hand?); load an older checkpoint directory "
                                  f"in {str(root)!r} directly")
        return target
    return root if os.path.lexists(root / MANIFEST) else None


# ---- saving ------------------------------------------------------------------------------------
def lock(path: str | os.PathLike) -> files.RootLock:
    """The first step of a save (the process that writes the manifest): the root ``path`` made where missing,
    and its lock taken (``BlockingIOError`` while another save holds it). Odd paths raise ``ValueError``, a file
    ``NotADirectoryError``; :func:`save_failure` words them."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"the path is a {type(path).__name__}, not a str or os.PathLike")
    text = os.fsdecode(os.fspath(path))
    if not text.strip():
        raise ValueError("the path is empty (it would save into the working directory)")
    if "\0" in text:
        raise ValueError("the path holds a NUL character")
    root = Path(text)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(root))
    root.mkdir(parents=True, exist_ok=True)
    return files.RootLock(root)


def begin(path: str | os.PathLike) -> str:
    """Second step of a save (one process, holding :func:`lock`): leftovers cleaned up, the directory the stages
    write into made; its name relative to ``path``."""
    root = _root(path)
    _clean(root)
    taken = [_seq(e.name) for e in root.iterdir()] + [_seq(_pointed(root) or "")]
    temp = files.temp_name(f"ckpt-{max(taken, default=-1) + 1:06d}")
    (root / temp).mkdir()
    return temp


def final_name(temp: str) -> str:
    """The name the directory ``temp`` (from :func:`begin`) gets once complete."""
    return temp[1:].split(files.TEMP_MARK)[0]


def save_stage(path: str | os.PathLike, state: dict[str, Any]) -> dict[str, Any]:
    """Write one stage's state into the directory ``path`` (a new file, fsynced); its entry for the manifest."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = f"stage-{state['stage']}.pt"
    files.write_new(Path(path) / name, data)
    return {"stage": state["stage"], "file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit(path: str | os.PathLike, temp: str, ident: dict[str, Any], entries: list[dict[str, Any]],
           trainer: dict[str, Any], keep: int) -> Path:
    """Last step of a save (one process, once every stage file is written): the manifest, the rename of the
    directory, the pointer; then older checkpoints beyond ``keep`` go (where the directory allows). The new
    checkpoint's directory."""
    root = Path(path)
    work = root / temp
    manifest = {"format": FORMAT, "identity": ident, "files": sorted(entries, key=lambda f: f["stage"]),
                "trainer": trainer}
    files.write_new(work / MANIFEST, json.dumps(manifest, indent=1).encode())
    files.fsync_dir(work)
    name = final_name(temp)
    os.replace(work, root / name)
    files.fsync_dir(root)
    files.replace_with(root / POINTER, (name + "\n").encode())
    complete = sorted((e for e in root.iterdir() if _NAME.match(e.name)), key=lambda e: _seq(e.name), reverse=True)
    for old in complete[keep:]:
        doomed = root / files.temp_name(old.name)
        try:
            os.replace(old, doomed)  # out of sight first: a removal cut short leaves only a leftover
        except OSError:
            continue  # the next save tries again
        files.remove_quietly(doomed)
    return root / name


def _newest(root: Path) -> tuple[Path | None, bool]:
    """:func:`latest`, read again while another save moves the pointer on; else the newest complete checkpoint
    directory found by name (:func:`newest_complete`) when ``latest`` cannot be read; ``None`` where nothing loads.
    Whether it was found by name."""
    for _ in range(RETRIES):
        pointed = None
        try:
            pointed = _pointed(root)
            return latest(root), False
        except (CheckpointError, OSError):
            try:
                moved = _pointed(root) != pointed
            except (CheckpointError, OSError):
                return newest_complete(root), True
            if not moved:
                return None, False
    return None, False


def save_failure(path: Any, rank: int, error: BaseException) -> CheckpointError:
    """The error of a save into ``path`` that failed on ``rank`` with ``error``: the cause in words, the last
    complete checkpoint (which still loads) and what to do."""
    if isinstance(path, (str, os.PathLike)):
        text = os.fsdecode(os.fspath(path))
        root, text = Path(text), repr(text)
    else:
        root, text = Path("."), repr(path)
    words, way = files.cause(error, root)
    found, by_name = (None, False) if isinstance(error, ValueError) else _newest(root)  # an odd path: none there
    if found is None:
        last = "Last complete checkpoint: none yet"
    else:
        named = " (found by its name, as 'latest' cannot be used)" if by_name \
            else " (the one 'latest' names)" if found != root else ""
        last = f"Last complete checkpoint: {str(found)!r}{named}; it still loads"
    return CheckpointError(f"rank {rank} could not save a checkpoint into {text}: {words}. {last}. {way[0].upper()}"
                           f"{way[1:]}.")


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


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_manifest(manifest: Any) -> str | None:
    """What makes ``manifest`` (parsed JSON) unusable, in words; ``None`` when it is a valid manifest."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    for key in ("identity", "files", "trainer"):
        if key not in manifest:
            return f"no {key!r} entry"
    if manifest.get("format", FORMAT) != FORMAT:
        return f"format {manifest['format']!r}, and this version reads format {FORMAT}"
    if not isinstance(manifest["identity"], dict):
        return "'identity' is not an object"
    if not isinstance(manifest["files"], list):
        return "'files' is not a list"
    for f in manifest["files"]:
        if not (isinstance(f, dict) and {"stage", "file", "bytes", "sha256"} <= set(f)):
            return f"'files' entry {manifest['files'].index(f)} lacks stage, file, bytes or sha256"
        name = f["file"]
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            return f"file {name!r} is not a plain name"[:300]
        if not _whole(f["stage"], 0, 2**31):
            return f"file {name!r} has stage {f['stage']!r}, not a whole number from 0"[:300]
        if not _whole(f["bytes"], 0, MOST_BYTES):
            return f"file {name!r} has bytes {f['bytes']!r}, not a whole number from 0 to 2**48"[:300]
        if not (isinstance(f["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", f["sha256"])):
            return f"file {name!r} has sha256 {f['sha256']!r}, not 64 hex digits"[:300]
    trainer = manifest["trainer"]
    if not isinstance(trainer, dict) or "batches" not in trainer:
        return "'trainer' lacks the batch count"
    if not _whole(trainer["batches"], 0, MOST_BATCHES):
        return f"the batch count is {trainer['batches']!r}, not a whole number from 0 to 2**62"[:300]
    if trainer.get("seed") is not None and not _whole(trainer["seed"], -2**63, 2**64 - 1):
        return f"the seed is {trainer['seed']!r}, not a whole number (or null)"[:300]
    return None


def _manifest(found: Path, root: Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``found`` (in the checkpoint root ``root``), after checking that
    every entry is there and every count and size is in range."""
    file = found / MANIFEST
    try:
        manifest = json.loads(files.read_regular(file, root, MOST_MANIFEST))
        problem = _check_manifest(manifest)
    except files.RefusedFile as e:
        raise CheckpointError(f"{e}; it should be the checkpoint's {MANIFEST}: the checkpoint is corrupt or was "
                              f"tampered with; load an earlier one") from None
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except (ValueError, RecursionError) as e:
        problem = str(e)
    except OSError as e:
        problem = f"{type(e).__name__}: {e.strerror}"
    if problem is not None:
        raise CheckpointError(f"{str(file)!r} is not a valid manifest ({problem}); the checkpoint is corrupt: load "
                              f"an earlier one")
    return manifest


def read(path: str | os.PathLike, ident: dict[str, Any],
         stages: list[int]) -> tuple[Path, dict[str, Any], dict[int, dict[str, Any]]]:
    """The checkpoint directory read, its manifest's trainer state and the states of ``stages``, after checking
    completeness, integrity and match. Writes nothing: leftovers of interrupted saves are never read, and only
    saves remove them.

    When a save moves ``latest`` on and removes the checkpoint being read (``keep=1``), the newer one is read,
    up to :data:`RETRIES` times.
    """
    root = _root(path)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {str(root)!r}: the directory does not exist")
    for _ in range(RETRIES):
        pointed = _pointed(root)
        try:
            return _read_once(root, ident, stages)
        except (CheckpointError, OSError) as e:
            if pointed is None or _pointed(root) == pointed:  # nothing moved: the checkpoint itself is wrong
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(f"the checkpoint under {str(root)!r} cannot be read ({type(e).__name__}: "
                                      f"{e}); load an earlier checkpoint") from None
    raise CheckpointError(f"the newest checkpoint under {str(root)!r} was replaced {RETRIES} times while it was "
                          f"being read (another trainer or process keeps saving into it); load again once it "
                          f"paused, or let it save with keep=2 or more")


def _read_once(root: Path, ident: dict[str, Any],
               stages: list[int]) -> tuple[Path, dict[str, Any], dict[int, dict[str, Any]]]:
    found = latest(root)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {str(root)!r} (neither {POINTER} nor {MANIFEST}): not a "
                              f"checkpoint, or no save there finished; load an earlier checkpoint")
    manifest = _manifest(found, root)
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
    entries = {f["stage"]: f for f in manifest["files"]}
    states = {}
    for i in stages:
        entry = entries.get(i)
        if entry is None:
            raise CheckpointError(f"{MANIFEST} in {str(found)!r} lists no file for stage {i}")
        file = found / entry["file"]
        try:
            data = files.read_regular(file, root, entry["bytes"])
        except FileNotFoundError:
            data = None
        except files.RefusedFile as e:
            raise CheckpointError(f"{e}; {MANIFEST} lists a regular file of {entry['bytes']} bytes: the checkpoint "
                                  f"is corrupt or was tampered with; load an earlier checkpoint") from None
        if data is None or len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            what = "is missing" if data is None else f"has {len(data)} bytes and another sha256"
            raise CheckpointError(f"{str(file)!r} {what}; {MANIFEST} expects {entry['bytes']} bytes, sha256 "
                                  f"{str(entry['sha256'])[:12]}...: the checkpoint is corrupt or was partly "
                                  f"overwritten; load an earlier checkpoint")
        try:
            states[i] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - the digest matched, yet torch cannot read it
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(f"{str(file)!r} cannot be read by torch.load ({type(e).__name__}: {first}); load "
                                  f"an earlier checkpoint") from None
        negative = negative_counter(states[i])
        if negative is not None:
            raise CheckpointError(f"{str(file)!r}: {negative}, not a whole number from 0 (a count of batches, steps "
                                  f"or epochs); the file was edited or is corrupt: load an earlier checkpoint")
    return found, manifest["trainer"], states

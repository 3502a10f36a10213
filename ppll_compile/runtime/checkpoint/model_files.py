"""The trained model's files, written as the gather hands on its stages (see :mod:`.gather`): a safetensors file
streamed (its header first, then every tensor at its place as its stage arrives), a ``torch.save`` file, or a
directory of one safetensors file per stage with the index Hugging Face ``transformers`` reads.

The safetensors package writes a file from a whole dict in one call (``save_file``), which would hold the whole
model at once; the format is simple enough to stream (https://github.com/huggingface/safetensors#format): 8 bytes
(little-endian) giving the header's length, the header (JSON: per name its dtype, shape and ``data_offsets`` into
the data, plus ``__metadata__``), padded with spaces to a multiple of 8 bytes, then the data, with no gaps. The
tensors are laid out largest element first (as the package does), so every tensor starts at a multiple of its
element size. Every file is created exclusively under a temporary name beside its target and renamed into place
once complete and flushed (see :mod:`.files`); a write removes the temporary files that killed writes of its
target left (:class:`TempFile`).
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...errors import PPLLError
from .files import clean_dead_temps, fsync_dir, open_held, remove_quietly
from .gather import TensorInfo

INDEX = "model.safetensors.index.json"
"""The index of a sharded save, by the name ``transformers``' ``from_pretrained`` looks for."""
SINGLE = "model.safetensors"
"""The single file ``from_pretrained`` reads before an index: a sharded save refuses a directory holding it."""
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
           torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
"""Torch dtypes by their safetensors names (the format's list: https://github.com/huggingface/safetensors)."""


def _dtype_name(info: TensorInfo) -> str:
    name = _DTYPES.get(info.dtype)
    if name is None:
        raise PPLLError(f"the model's state holds {info.key!r} of dtype {info.dtype}, which safetensors cannot store; "
                        f"save to a .pt path to write it with torch.save")
    return name


class TempFile:
    """A file written under a fresh temporary name beside ``path`` and renamed over it by :meth:`commit`. It holds
    the file's lock (:func:`.files.open_held`) until then, and first removes what killed writes of ``path`` left
    (:func:`.files.clean_dead_temps`): temporary files of ``path`` that no live writer holds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        clean_dead_temps(path.parent, lambda name: name == path.name)
        self.temp, fd = open_held(path)
        self.fd: int | None = fd

    def pwrite(self, data: Any, offset: int) -> None:
        """Write ``data`` (a buffer) at byte ``offset``."""
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def commit(self) -> None:
        """Flush to disk, rename over the target (the lock still held) and make the rename durable."""
        assert self.fd is not None
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        os.replace(self.temp, self.path)
        os.close(self.fd)
        self.fd = None
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Remove the temporary file (nothing of the target changes)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        remove_quietly(self.temp)


class SafetensorsFile:
    """One safetensors file of the tensors ``infos``, whose header is written at once and each tensor when
    :meth:`write` gets it; :meth:`commit` once all are written."""

    def __init__(self, path: Path, infos: list[TensorInfo], metadata: dict[str, str]) -> None:
        if sys.byteorder != "little":
            raise PPLLError("safetensors files are little-endian and this machine is not: save to a .pt path to "
                            "write the model with torch.save")
        names = [_dtype_name(i) for i in infos]
        size = {i.key: torch.empty((), dtype=i.dtype).element_size() for i in infos}
        placed = sorted(range(len(infos)), key=lambda n: (-size[infos[n].key], infos[n].key))  # as the package does
        header: dict[str, Any] = {"__metadata__": metadata}
        self.offsets: dict[str, int] = {}
        at = 0
        for n in placed:
            info = infos[n]
            header[info.key] = {"dtype": names[n], "shape": list(info.shape), "data_offsets": [at, at + info.nbytes]}
            self.offsets[info.key] = at
            at += info.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.start = 8 + len(text)
        self.nbytes = at
        self.file = TempFile(path)
        self.file.pwrite(struct.pack("<Q", len(text)) + text, 0)

    def write(self, key: str, tensor: Tensor) -> None:
        """Write the data of ``key`` (a CPU tensor of the announced shape and dtype)."""
        if tensor.numel():
            self.file.pwrite(tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), self.start + self.offsets[key])


def _file_metadata() -> dict[str, str]:
    return {"format": "pt"}


class StreamedSafetensors:
    """A sink of :func:`.gather.gather_stages` writing one safetensors file as the stages arrive."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: SafetensorsFile | None = None

    def begin(self, layout: list[list[TensorInfo]], others: OrderedDict[str, Any]) -> None:
        _refuse_others(others)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = SafetensorsFile(self.path, [i for part in layout for i in part], _file_metadata())

    def take(self, stage: int, part: OrderedDict[str, Tensor]) -> None:
        assert self.file is not None
        for key, t in part.items():
            self.file.write(key, t)

    def commit(self) -> None:
        assert self.file is not None
        self.file.file.commit()

    def discard(self) -> None:
        if self.file is not None:
            self.file.file.discard()


class TorchFile:
    """A sink collecting the whole state (``collector``: a :class:`.model_state.StateCollector`), then written with
    ``torch.save``, which takes one dict."""

    def __init__(self, path: Path, collector: Any) -> None:
        self.path = path
        self.collector = collector
        self.begin, self.take = collector.begin, collector.take

    def commit(self) -> None:
        state = self.collector.state()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = TempFile(self.path)
        try:
            with os.fdopen(os.dup(file.fd), "wb") as f:  # type: ignore[arg-type]
                torch.save(state, f)
            file.commit()
        except BaseException:
            file.discard()
            raise

    def discard(self) -> None:
        self.collector.parts.clear()


def _refuse_others(others: OrderedDict[str, Any]) -> None:
    if others:
        odd = list(others)
        raise PPLLError(f"the model's state holds {len(odd)} entries that are not tensors ({', '.join(odd[:3])}), "
                        f"which safetensors cannot store; save to a .pt path to write them with torch.save")


def check_shard_dir(path: Path) -> None:
    """Refuse a target of ``save_model(path, sharded=True)`` that is not a directory to write shards into."""
    if path.suffix in (".safetensors", ".pt", ".pth", ".bin") or (path.exists() and not path.is_dir()):
        what = "an existing file" if path.exists() and not path.is_dir() else "a file name"
        raise PPLLError(f"save_model({str(path)!r}, sharded=True) writes a directory (one safetensors file per stage "
                        f"and {INDEX}), but {str(path)!r} is {what}; pass a directory path, or sharded=False to "
                        f"write one file")
    if (path / SINGLE).exists():
        raise PPLLError(f"{str(path)!r} already holds {SINGLE}, which from_pretrained reads instead of a sharded "
                        f"save's {INDEX}; remove it, or save the shards into another directory")


class ShardedSafetensors:
    """A sink writing one safetensors file per stage that holds tensors (``model-00001-of-0000N.safetensors``) into
    a directory, then the index ``model.safetensors.index.json`` naming every tensor's file.

    Each shard is written under a temporary name; once all are complete, a previous save's index is removed, the
    shards renamed into place, the new index written (atomically) and shards of a previous save that the new index
    does not name removed. A process killed midway leaves the previous save whole, or no index (``from_pretrained``
    then refuses the directory), never an index naming a mix of two saves. Other files (``config.json``, a
    tokenizer) are left as they are.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shards: dict[int, tuple[str, SafetensorsFile]] = {}
        self.weight_map: dict[str, str] = {}

    def begin(self, layout: list[list[TensorInfo]], others: OrderedDict[str, Any]) -> None:
        _refuse_others(others)
        self.path.mkdir(parents=True, exist_ok=True)
        clean_dead_temps(self.path, lambda name: bool(_SHARD.fullmatch(name)) or name == INDEX)
        kept = [(s, infos) for s, infos in enumerate(layout) if infos]
        for n, (s, infos) in enumerate(kept):
            name = f"model-{n + 1:05d}-of-{len(kept):05d}.safetensors"
            self.shards[s] = (name, SafetensorsFile(self.path / name, infos, _file_metadata()))
            self.weight_map.update((i.key, name) for i in infos)
        self.total = sum(f.nbytes for _, f in self.shards.values())

    def take(self, stage: int, part: OrderedDict[str, Tensor]) -> None:
        if stage in self.shards:
            file = self.shards[stage][1]
            for key, t in part.items():
                file.write(key, t)

    def commit(self) -> None:
        old = self.path / INDEX
        old.unlink(missing_ok=True)
        for _, file in self.shards.values():
            file.file.commit()
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        out = TempFile(old)
        try:
            out.pwrite(json.dumps(index, indent=2, sort_keys=True).encode() + b"\n", 0)
            out.commit()
        except BaseException:
            out.discard()
            raise
        names = {name for name, _ in self.shards.values()}
        for stale in self.path.iterdir():
            if _SHARD.fullmatch(stale.name) and stale.name not in names:
                remove_quietly(stale)

    def discard(self) -> None:
        for _, file in self.shards.values():
            file.file.discard()

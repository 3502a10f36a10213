"""Checkpoint saves that others cannot subvert and that fail in words: exclusive temporary files, one writer per root,
loads that write nothing, clear failed-save messages, manifest ranges, and the hyperparameters a load restores."""
import json
import re
import threading
import time

import pytest

from ppll_compile import CheckpointError
from tests import ckpt_worker as w
from tests.helpers import sgd
import errno
import os
import torch

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _trained(steps: int = 1, seed: int = 0, optimizer=sgd, **options):
    compiled = w.pipeline(seed)
    trainer = compiled.trainer(optimizer=optimizer, **options)
    for i in range(steps):
        trainer.step(*w.batch(i))
    return compiled, trainer


def _loads(root, batches: int, name: str = "ckpt-000000") -> None:
    """A fresh trainer loads ``root``: the checkpoint ``name``, saved after ``batches`` batches."""
    loaded = w.pipeline(seed=7).trainer(optimizer=sgd)
    assert loaded.load(root) == root / name and loaded.batches == batches


# ---- 2. one writer per root; readers never see a half state -----------------------------------------------------
def _lock_message(root) -> str:
    return (rf"rank 0 could not save a checkpoint into {re.escape(repr(str(root)))}: another save into this directory "
            rf"is in progress \(another trainer or process holds its lock\) \(EAGAIN: another save holds the lock on "
            rf"'\.lock'\)\. Last complete checkpoint: {re.escape(repr(str(root / 'ckpt-')))[:-1]}\d{{6}}' \(the one "
            rf"'latest' names\); it still loads\. Wait until that save has finished and save again, or save into "
            rf"another directory\.")


TOKEN = "0" * 16  # every temporary name's random part, where a test fixes it


def _failing(monkeypatch, name: str, code: int, on_call: int) -> None:
    """``os.NAME`` raises OSError(code) on its ``on_call``-th call (counting from 1); temporary names are fixed."""
    real, calls = getattr(os, name), [0]

    def fake(first, *args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call:
            raise OSError(code, os.strerror(code), None if name == "write" else os.fsdecode(first))
        return real(first, *args, **kwargs)
    monkeypatch.setattr(os, name, fake)
    monkeypatch.setattr("secrets.token_hex", lambda n: TOKEN)


FAILURES = {  # (os function, errno, which call fails) -> the cause in words, the file, the way out
    ("write", errno.ENOSPC, 1): ("the disk is full (ENOSPC: No space left on device on "
                                 f"'.ckpt-000001.tmp-{TOKEN}/stage-0.pt')",
                                 "Free space on that disk or save into another directory."),
    ("write", errno.EFBIG, 3): ("a file would grow larger than the file system or the process's file-size limit "
                                f"allows (file too large) (EFBIG: File too large on '.ckpt-000001.tmp-{TOKEN}/"
                                "manifest.json')",
                                "Save onto a file system that takes larger files, or raise the limit (ulimit -f)."),
    ("write", errno.ENOSPC, 4): (f"the disk is full (ENOSPC: No space left on device on '.latest.tmp-{TOKEN}')",
                                 "Free space on that disk or save into another directory."),
    ("mkdir", errno.EROFS, 2): ("the directory is on a read-only file system (EROFS: Read-only file system on "
                                f"'.ckpt-000001.tmp-{TOKEN}')", "Save into a writable directory."),
    ("mkdir", errno.EACCES, 2): ("this process may not write there (permission denied) (EACCES: Permission denied "
                                 f"on '.ckpt-000001.tmp-{TOKEN}')",
                                 "Save into a directory this user may write, or change its permissions."),
}


BAD_MANIFESTS = {
    "negative batches": (("trainer", "batches"), -3, "the batch count is -3, not a whole number from 0 to 2**62"),
    "fractional batches": (("trainer", "batches"), 2.5, "the batch count is 2.5, not a whole number from 0 to 2**62"),
    "boolean batches": (("trainer", "batches"), True, "the batch count is True, not a whole number from 0 to 2**62"),
    "absurd batches": (("trainer", "batches"), 2**70,
                       f"the batch count is {2**70}, not a whole number from 0 to 2**62"),
    "text seed": (("trainer", "seed"), "0", "the seed is '0', not a whole number (or null)"),
    "negative size": (("files", 0, "bytes"), -1, "file 'stage-0.pt' has bytes -1, not a whole number from 0 to 2**48"),
    "absurd size": (("files", 0, "bytes"), 2**60,
                    f"file 'stage-0.pt' has bytes {2**60}, not a whole number from 0 to 2**48"),
    "negative stage": (("files", 0, "stage"), -1, "file 'stage-0.pt' has stage -1, not a whole number from 0"),
    "odd digest": (("files", 0, "sha256"), "zz", "file 'stage-0.pt' has sha256 'zz', not 64 hex digits"),
    "newer format": (("format",), 2, "format 2, and this version reads format 1"),
}


@pytest.mark.slow
def test_two_writers_and_a_reader_hammering_one_root_never_see_a_raw_error(tmp_path):
    """Two trainers save into one root (keep=1) and a third loads from it, for two seconds: every save succeeds
    or is refused by the lock in words; every load succeeds (a checkpoint removed under it is read again)."""
    root = tmp_path / "root"
    writers = [_trained(1)[1], _trained(2)[1]]
    reader = w.pipeline(seed=7).trainer(optimizer=sgd)
    writers[0].save(root)
    saved, refused, loaded, wrong = [0, 0], [0, 0], [], []
    deadline = time.monotonic() + 2.0

    def save(k):
        while time.monotonic() < deadline:
            try:
                writers[k].save(root, keep=1)
                saved[k] += 1
                time.sleep(0.01)  # training between saves
            except CheckpointError as e:
                refused[k] += 1
                time.sleep(0.01)  # wait, then try again
                if not re.fullmatch(_lock_message(root), str(e)):
                    wrong.append(e)
            except Exception as e:  # noqa: BLE001 - what the test is about
                wrong.append(e)

    def load():
        while time.monotonic() < deadline:
            try:
                loaded.append((reader.load(root).name, reader.batches))
            except Exception as e:  # noqa: BLE001
                if not (isinstance(e, CheckpointError) and str(e).startswith(
                        f"the newest checkpoint under {str(root)!r} was replaced 5 times while it was being read")):
                    wrong.append(e)
    threads = [threading.Thread(target=save, args=(0,)), threading.Thread(target=save, args=(1,)),
               threading.Thread(target=load)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert wrong == [], [f"{type(e).__name__}: {e}" for e in wrong[:5]]
    assert min(saved) >= 1 and len(loaded) >= 1 and {b for _, b in loaded} <= {1, 2}, (saved, refused, loaded)
    names = sorted(p.name for p in root.iterdir())
    assert len(names) == 2 and names[1] == "latest" and (root / "latest").read_text() == names[0] + "\n"
    _loads(root, json.loads((root / names[0] / "manifest.json").read_text())["trainer"]["batches"], names[0])


@pytest.mark.parametrize("failure", list(FAILURES), ids=lambda f: f"{f[0]}-{errno.errorcode[f[1]]}-{f[2]}")
def test_a_failed_save_names_rank_cause_and_the_checkpoint_that_still_loads(tmp_path, monkeypatch, failure):
    root = tmp_path / "root"
    compiled, trainer = _trained(1)
    trainer.save(root)
    trainer.step(*w.batch(1))
    words, way = FAILURES[failure]
    with monkeypatch.context() as m:
        _failing(m, *failure)
        with pytest.raises(CheckpointError) as info:
            trainer.save(root)
    assert str(info.value) == (
        f"rank 0 could not save a checkpoint into {str(root)!r}: {words}. Last complete checkpoint: "
        f"{str(root / 'ckpt-000000')!r} (the one 'latest' names); it still loads. {way}")
    # the failed save's directory went; one completed before the pointer failed stays until the next save
    unpointed = ["ckpt-000001"] if failure[2] == 4 else []
    assert sorted(p.name for p in root.iterdir()) == sorted(["ckpt-000000", "latest", *unpointed])
    _loads(root, 1)
    assert trainer.save(root) == root / "ckpt-000001"
    _loads(root, 2, "ckpt-000001")


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_out_of_range_manifest_values_are_refused_and_nothing_loads(tmp_path, case):
    compiled, trainer = _trained(1)
    path = trainer.save(tmp_path)
    keys, value, problem = BAD_MANIFESTS[case]
    manifest = json.loads((path / "manifest.json").read_text())
    part = manifest
    for key in keys[:-1]:
        part = part[key]
    part[keys[-1]] = value
    (path / "manifest.json").write_text(json.dumps(manifest))
    other = w.pipeline(seed=7)
    fresh = other.trainer(optimizer=sgd)
    before = w.parameters(other)
    with pytest.raises(CheckpointError) as info:
        fresh.load(tmp_path)
    assert str(info.value) == (f"{str(path / 'manifest.json')!r} is not a valid manifest ({problem}); the checkpoint "
                               f"is corrupt: load an earlier one")
    assert fresh.batches == 0 and all(torch.equal(p, q) for p, q in zip(before, w.parameters(other), strict=True))

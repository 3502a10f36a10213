"""Checkpoint saves that others cannot subvert and that fail in words: exclusive temporary files, one writer per root,
loads that write nothing, clear failed-save messages, manifest ranges, and the hyperparameters a load restores."""

import errno
import os
import re
import shutil
import socket
import warnings

import pytest
import torch

from ppll_compile import CheckpointError
from ppll_compile.runtime.checkpoint import store as checkpoint
from tests import ckpt_worker as w
from tests.helpers import sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")
TOKEN = "0" * 16  # every temporary name's random part, where a test fixes it


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


def _during_save(monkeypatch, action) -> None:
    """Run ``action(work)`` after the stage files of a save are written (``work``: the save's temporary directory)."""
    real = checkpoint.save_stage

    def save_stage(path, state):
        entry = real(path, state)
        action(path)
        return entry
    monkeypatch.setattr(checkpoint, "save_stage", save_stage)


# ---- 1. temporary files: unpredictable names, created exclusively, links never followed -------------------------
def test_links_planted_at_the_former_predictable_names_are_never_followed(tmp_path, monkeypatch):
    """The pointer's temporary file used to be ``.latest.tmp-HOST-PID``, opened with open('wb'): a link planted there
    (after the save's cleanup) made the save overwrite the file it points to. Now no such name is used."""
    root, victim = tmp_path / "root", tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    compiled, trainer = _trained(1)
    trainer.save(root)
    tail = f".tmp-{socket.gethostname()}-{os.getpid()}"
    link = root / f".latest{tail}"
    _during_save(monkeypatch, lambda work: link.is_symlink() or link.symlink_to(victim))
    trainer.step(*w.batch(1))
    assert trainer.save(root) == root / "ckpt-000001"
    assert victim.read_bytes() == b"precious" and link.is_symlink()
    assert (root / "latest").read_text() == "ckpt-000001\n" and not (root / "latest").is_symlink()
    assert (root / "latest").stat().st_mode & 0o777 == 0o644 & ~_umask()
    _loads(root, 2, "ckpt-000001")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_link_at_the_very_temporary_name_is_refused_and_not_followed(tmp_path, monkeypatch):
    """Even where the random name were guessed, the file is created exclusively (O_EXCL, O_NOFOLLOW): the save
    fails in words and the file the link points to is untouched."""
    root, victim = tmp_path / "root", tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    compiled, trainer = _trained(1)
    trainer.save(root)
    monkeypatch.setattr("secrets.token_hex", lambda n: TOKEN)
    link = root / f".latest.tmp-{TOKEN}"
    _during_save(monkeypatch, lambda work: link.is_symlink() or link.symlink_to(victim))
    with pytest.raises(CheckpointError) as info:
        trainer.save(root)
    assert str(info.value) == (
        f"rank 0 could not save a checkpoint into {str(root)!r}: something already stands where the save creates a "
        f"file (it is never overwritten) (EEXIST: File exists on '.latest.tmp-{TOKEN}'). Last complete checkpoint: "
        f"{str(root / 'ckpt-000000')!r} (the one 'latest' names); it still loads. Remove it, or save into a "
        f"directory only you can write.")
    assert victim.read_bytes() == b"precious"
    _loads(root, 1)


def test_a_link_at_the_lock_file_is_refused_and_not_followed(tmp_path):
    root, victim = tmp_path / "root", tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    root.mkdir()
    (root / ".lock").symlink_to(victim)
    compiled, trainer = _trained(1)
    with pytest.raises(CheckpointError) as info:
        trainer.save(root)
    assert str(info.value) == (
        f"rank 0 could not save a checkpoint into {str(root)!r}: a symbolic link stands where the save creates a "
        f"file (links are never followed there) (ELOOP: Too many levels of symbolic links on '.lock'). Last "
        f"complete checkpoint: none yet. Remove that link, or save into a directory only you can write.")
    assert victim.read_bytes() == b"precious" and sorted(p.name for p in root.iterdir()) == [".lock"]


# ---- 2. one writer per root; readers never see a half state -----------------------------------------------------
def _lock_message(root) -> str:
    return (rf"rank 0 could not save a checkpoint into {re.escape(repr(str(root)))}: another save into this directory "
            rf"is in progress \(another trainer or process holds its lock\) \(EAGAIN: another save holds the lock on "
            rf"'\.lock'\)\. Last complete checkpoint: {re.escape(repr(str(root / 'ckpt-')))[:-1]}\d{{6}}' \(the one "
            rf"'latest' names\); it still loads\. Wait until that save has finished and save again, or save into "
            rf"another directory\.")


def test_a_second_writer_is_refused_in_words_while_a_save_holds_the_root(tmp_path, monkeypatch):
    root = tmp_path / "root"
    compiled, first = _trained(1)
    other, second = _trained(2)
    first.save(root)
    seen = []

    def interleave(work):  # the second trainer saves while the first one is inside its save (once)
        if seen:
            return
        with pytest.raises(CheckpointError) as info:
            second.save(root)
        seen.append(str(info.value))
    _during_save(monkeypatch, interleave)
    assert first.save(root) == root / "ckpt-000001"
    assert len(seen) == 1 and re.fullmatch(_lock_message(root), seen[0]), seen
    monkeypatch.undo()
    assert second.save(root) == root / "ckpt-000002"  # the lock went with the first save
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000002", "latest"]
    _loads(root, 2, "ckpt-000002")


# ---- 3. a load writes nothing: a read-only directory with a dead process's leftovers loads ----------------------
def _read_only(monkeypatch) -> None:
    """Make every write to the file system fail as on a read-only mount (EROFS). The tests run as root, where
    chmod 0o555 does not stop writes, so the operations a save or a load could write with are replaced."""
    def refuse(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_open(path, flags, *args, **kwargs)
    for name in ("unlink", "remove", "rmdir", "mkdir", "replace", "rename"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(shutil, "rmtree",  # as the real one on a read-only mount: ignore_errors hides the error
                        lambda path, ignore_errors=False, **kw: None if ignore_errors else refuse(path))
    monkeypatch.setattr(os, "open", open_)


def _leftovers(root):
    """What dead processes' interrupted saves left (names of this and of earlier versions)."""
    host = socket.gethostname()
    pointer = root / f".latest.tmp-{host}-999999999"
    pointer.write_text("ckpt-000007\n")
    work = root / f".ckpt-000003.tmp-{host}-999999999"
    work.mkdir()
    (work / "stage-0.pt").write_bytes(os.urandom(100))
    fresh = root / f".ckpt-000004.tmp-{'ab' * 8}"
    fresh.mkdir()
    return [pointer, work, fresh]


def test_a_read_only_directory_with_leftovers_loads_and_refuses_saves_in_words(tmp_path, monkeypatch):
    root = tmp_path / "root"
    compiled, trainer = _trained(1)
    trainer.save(root)
    left = _leftovers(root)
    loaded = w.pipeline(seed=7).trainer(optimizer=sgd)
    with monkeypatch.context() as m:
        _read_only(m)
        assert loaded.load(root) == root / "ckpt-000000" and loaded.batches == 1
        with pytest.raises(CheckpointError) as info:
            trainer.save(root)
    assert all(p.exists() for p in left)  # a load removes nothing
    assert str(info.value) == (
        f"rank 0 could not save a checkpoint into {str(root)!r}: the directory is on a read-only file system (EROFS: "
        f"Read-only file system on '.lock'). Last complete checkpoint: {str(root / 'ckpt-000000')!r} (the one "
        f"'latest' names); it still loads. Save into a writable directory.")
    trainer.step(*w.batch(1))
    assert trainer.save(root) == root / "ckpt-000001"  # writable again: the next save removes the leftovers
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000001", "latest"]


def test_a_chmod_555_directory_with_leftovers_loads(tmp_path):
    """The same on a real read-only directory, where this process is subject to permissions (not root, or root
    without CAP_DAC_OVERRIDE)."""
    root = tmp_path / "root"
    compiled, trainer = _trained(1)
    trainer.save(root)
    left = _leftovers(root)
    root.chmod(0o555)
    try:
        try:
            (root / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("this process writes into a chmod 0o555 directory (root)")
        _loads(root, 1)
        assert all(p.exists() for p in left)
        with pytest.raises(CheckpointError, match=r"this process may not write there \(permission denied\) "):
            trainer.save(root)
    finally:
        root.chmod(0o755)


# ---- 4. failed saves: rank, cause in words, the last complete checkpoint ----------------------------------------
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


def test_a_failed_first_save_says_none_yet(tmp_path, monkeypatch):
    root = tmp_path / "root"
    compiled, trainer = _trained(1)
    _failing(monkeypatch, "write", errno.ENOSPC, 1)
    with pytest.raises(CheckpointError) as info:
        trainer.save(root)
    assert str(info.value) == (
        f"rank 0 could not save a checkpoint into {str(root)!r}: the disk is full (ENOSPC: No space left on device "
        f"on '.ckpt-000000.tmp-{TOKEN}/stage-0.pt'). Last complete checkpoint: none yet. Free space on that disk or "
        f"save into another directory.")
    assert sorted(p.name for p in root.iterdir()) == []


def test_odd_paths_are_refused_in_words(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" must not save into the working directory
    compiled, trainer = _trained(1)
    file = tmp_path / "a-file"
    file.write_text("x")
    way = "Last complete checkpoint: none yet. Pass the path of a directory."
    cases = {
        "": "'': the path is empty (it would save into the working directory)",
        "a\0b": "'a\\x00b': the path holds a NUL character",
        None: "None: the path is a NoneType, not a str or os.PathLike",
        file: f"{str(file)!r}: the path is a file; a checkpoint is a directory (one file per stage plus "
              f"manifest.json) (ENOTDIR: Not a directory on {str(file)!r})",
        file / "sub": f"{str(file / 'sub')!r}: a part of the path is a file, not a directory (ENOTDIR: Not a "
                      f"directory on {str(file / 'sub')!r})",
    }
    for path, text in cases.items():
        with pytest.raises(CheckpointError) as info:
            trainer.save(path)
        assert str(info.value) == f"rank 0 could not save a checkpoint into {text}. {way}", path
    with pytest.raises(CheckpointError, match=r"^rank 0 could not save a checkpoint into '.*': the path is too long "
                                              r"for the file system \(ENAMETOOLONG: File name too long on "):
        trainer.save(tmp_path / ("x" * 300))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and file.read_text() == "x"


# ---- 5. the hyperparameters a load restores ---------------------------------------------------------------------
def _loaded_with(tmp_path, factory, **options) -> tuple[list[str], list]:
    """Warnings of loading the checkpoint in ``tmp_path`` into a trainer built with ``factory``; its optimizers."""
    trainer = w.pipeline(seed=7).trainer(optimizer=factory, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.load(tmp_path)
    return [str(c.message) for c in caught], [o for r in trainer.runners for o in r.optimizers]


def test_a_load_that_changes_hyperparameters_warns_once_naming_each(tmp_path):
    compiled, trainer = _trained(1)  # lr 0.05, momentum 0.9
    trainer.save(tmp_path)
    texts, optimizers = _loaded_with(tmp_path, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4))
    changes = "; ".join(f"stage {i}: {c}" for i in (0, 1)
                        for c in ("lr 0.1 -> 0.05 (from the checkpoint)",
                                  "weight_decay 0.0001 -> 0 (from the checkpoint)"))
    assert texts == [
        f"checkpoint {str(tmp_path / 'ckpt-000000')!r} replaced optimizer hyperparameters the optimizer factory gave: "
        f"{changes}. The checkpoint's values are kept (they resume the run exactly); to train with the factory's, set "
        f"them again after load, e.g. for g in opt.param_groups: g['lr'] = ... for every opt in "
        f"trainer.runners[i].optimizers"]
    assert [(g["lr"], g["weight_decay"]) for o in optimizers for g in o.param_groups] == [(0.05, 0)] * 2


def test_a_normal_resume_warns_nothing_with_or_without_a_scheduler(tmp_path):
    compiled, trainer = _trained(1)
    trainer.save(tmp_path / "plain")
    assert _loaded_with(tmp_path / "plain", sgd)[0] == []

    def step_lr(o):
        return torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)
    compiled, scheduled = _trained(2, scheduler=step_lr)
    scheduled.save(tmp_path / "scheduled")
    texts, optimizers = _loaded_with(tmp_path / "scheduled", sgd, scheduler=step_lr)
    assert texts == [] and {g["lr"] for o in optimizers for g in o.param_groups} == {0.05 * 0.25}


def test_a_file_system_without_locks_still_saves_and_says_so(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr("fcntl.flock", no_locks)
    compiled, trainer = _trained(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer.save(tmp_path) == tmp_path / "ckpt-000000"
    assert [str(c.message) for c in caught] == [
        f"{str(tmp_path)!r} is on a file system without file locks (No locks available): a second trainer saving "
        f"into it at the same time is not detected; give every trainer its own checkpoint directory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000", "latest"]
    _loads(tmp_path, 1)

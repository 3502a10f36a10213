"""Checkpoint roots that others planted things in, or edited by hand: special files (a FIFO, a device, a link out of
the root) are refused without being opened for reading, sizes are checked before reading, a broken ``latest`` names
the newest complete checkpoint, negative counters are refused by file and field, and no file's content is quoted.
A refused load leaves the trainer as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from ppll_compile import CheckpointError
from ppll_compile.runtime.checkpoint.model_files import TempFile
from tests import ckpt_worker as w
from tests.helpers import sgd

pytestmark = [pytest.mark.usefixtures("one_thread_quietly"), pytest.mark.timeout(20, method="thread")]


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint root saved after one batch (``ckpt-000000``) and two (``ckpt-000001``, which ``latest``
    names), the trainer that saved it, and a fresh pipeline's trainer that loads."""
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = w.pipeline(0)
        trainer = compiled.trainer(optimizer=sgd, scheduler=_step_lr)
        root = tmp_path_factory.mktemp("hostile") / "root"
        for i in range(2):
            trainer.step(*w.batch(i))
            trainer.save(root, keep=2)
        fresh = w.pipeline(seed=7)
        return root, trainer, fresh, fresh.trainer(optimizer=sgd, scheduler=_step_lr)


@pytest.fixture
def root(saved, tmp_path) -> Path:
    """A copy of the saved root, to plant things in."""
    copy = tmp_path / "root"
    shutil.copytree(saved[0], copy, symlinks=True)
    return copy


def _refused_load(saved, path) -> str:
    """The error of loading ``path`` into the fresh trainer, after checking that it is exactly as before."""
    _, _, fresh, trainer = saved
    before = w.parameters(fresh)
    with pytest.raises(CheckpointError) as info:
        trainer.load(path)
    assert all(torch.equal(p, q) for p, q in zip(before, w.parameters(fresh), strict=True))
    assert trainer.batches == 0 and set(trainer.steps.values()) == {0}
    return str(info.value)


def _refused_save(saved, path) -> str:
    with pytest.raises(CheckpointError) as info:
        saved[1].save(path)
    return str(info.value)


def _plant(path: Path, kind: str, target: str | None = None) -> None:
    """Replace ``path`` by a FIFO, a directory or a symbolic link to ``target``."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    {"fifo": lambda: os.mkfifo(path), "dir": lambda: path.mkdir(),
     "link": lambda: path.symlink_to(target)}[kind]()


# ---- special files: refused without opening them for reading ----------------------------------------------------
def test_a_fifo_as_latest_is_refused_by_load_and_save_without_blocking(saved, root):
    _plant(root / "latest", "fifo")
    text = (f"{str(root / 'latest')!r} is a FIFO (named pipe), not a regular file; it should be the small file that "
            f"names the newest complete checkpoint. The newest complete checkpoint directory there is "
            f"{str(root / 'ckpt-000001')!r}: load it by that path, and remove {str(root / 'latest')!r} to save into "
            f"or load {str(root)!r} again")
    assert _refused_load(saved, root) == text
    assert _refused_save(saved, root) == text
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000", "ckpt-000001", "latest"]


def test_a_fifo_as_the_lock_is_refused_without_blocking(saved, root):
    _plant(root / ".lock", "fifo")
    assert _refused_save(saved, root) == (
        f"rank 0 could not save a checkpoint into {str(root)!r}: something already stands where the save creates a "
        f"file (it is never overwritten) (EEXIST: a FIFO (named pipe) stands there, not a regular file on '.lock'). "
        f"Last complete checkpoint: {str(root / 'ckpt-000001')!r} (the one 'latest' names); it still loads. Remove "
        f"it, or save into a directory only you can write.")
    assert sorted(p.name for p in root.iterdir()) == [".lock", "ckpt-000000", "ckpt-000001", "latest"]


@pytest.mark.parametrize("name", ["latest", "ckpt-000001/stage-0.pt", "ckpt-000001/manifest.json"])
def test_a_file_linked_to_dev_zero_is_refused_unread(saved, root, name):
    _plant(root / name, "link", "/dev/zero")
    text = _refused_load(saved, root)
    assert f"{str(root / name)!r} resolves to '/dev/zero', outside the checkpoint root {str(root)!r}" in text, text


@pytest.mark.parametrize("name", ["ckpt-000001/stage-1.pt", "ckpt-000001/manifest.json"])
def test_a_fifo_inside_a_checkpoint_is_refused_without_blocking(saved, root, name):
    _plant(root / name, "fifo")
    assert f"{str(root / name)!r} is a FIFO (named pipe), not a regular file" in _refused_load(saved, root)


def test_a_stage_file_larger_than_its_manifest_says_is_refused_before_it_is_read(saved, root, monkeypatch):
    stage = root / "ckpt-000001" / "stage-0.pt"
    listed = stage.stat().st_size
    os.truncate(stage, 2**40)  # sparse: a terabyte that reading would try to hold
    read = []
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(n) or real(fd, n))
    text = _refused_load(saved, root)
    assert f"{str(stage)!r} has {2**40} bytes, more than the {listed} expected" in text, text
    assert sum(read) <= 64 * 1024  # the pointer and the manifest, never the stage file


def test_a_link_out_of_the_root_is_refused_and_its_content_never_quoted(saved, root, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("ckpt-hunter2-password\n")
    _plant(root / "latest", "link", str(secret))
    text = _refused_load(saved, root)
    assert text.startswith(f"{str(root / 'latest')!r} resolves to {str(secret)!r}, outside the checkpoint root "
                           f"{str(root)!r} (a symbolic link); it should be the small file that names the newest complete checkpoint")
    assert "hunter2" not in text


def test_a_pointer_holding_other_text_is_refused_without_quoting_it(saved, root):
    (root / "latest").write_text("hunter2 and more secret words\n")
    text = _refused_load(saved, root)
    assert text == (f"{str(root / 'latest')!r} does not hold the name of a checkpoint like ckpt-000001 (it holds 30 "
                    f"bytes of other text). The newest complete checkpoint directory there is "
                    f"{str(root / 'ckpt-000001')!r}: write its name into it, or load that directory itself")
    assert "hunter2" not in _refused_save(saved, root)


# ---- a pointer that is a directory ------------------------------------------------------------------------------
def test_latest_as_a_directory_names_the_newest_complete_checkpoint(saved, root):
    _plant(root / "latest", "dir")
    text = (f"{str(root / 'latest')!r} is a directory, not a regular file; it should be the small file that names "
            f"the newest complete checkpoint. The newest complete checkpoint directory there is "
            f"{str(root / 'ckpt-000001')!r}: load it by that path, and remove {str(root / 'latest')!r} to save into "
            f"or load {str(root)!r} again")
    assert _refused_load(saved, root) == text
    assert _refused_save(saved, root) == text
    (root / ".lock").symlink_to(root / "nowhere")  # a save that fails before it reads the pointer
    assert f"Last complete checkpoint: {str(root / 'ckpt-000001')!r} (found by its name, as 'latest' cannot " \
           f"be used); it still loads." in _refused_save(saved, root)


# ---- counters edited by hand ------------------------------------------------------------------------------------
def _edit_stage(root: Path, stage: int, edit) -> Path:
    """Apply ``edit`` to the state in ``ckpt-000001/stage-N.pt`` and write it back with a matching manifest."""
    folder = root / "ckpt-000001"
    file = folder / f"stage-{stage}.pt"
    state = torch.load(file, weights_only=True)
    edit(state)
    torch.save(state, file)
    data = file.read_bytes()
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = next(f for f in manifest["files"] if f["stage"] == stage)
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return file


NEGATIVE = {
    "steps": (lambda s: s.update(steps=-3), "'steps' is -3"),
    "reused": (lambda s: s.update(reused=-1), "'reused' is -1"),
    "dropped": (lambda s: s.update(dropped=-2), "'dropped' is -2"),
    "updates": (lambda s: s.update(updates=-5), "'updates' is -5"),
    "scheduler epoch": (lambda s: s["schedulers"][0].update(last_epoch=-4), "scheduler 0's 'last_epoch' is -4"),
    "scheduler count": (lambda s: s["schedulers"][0].update(_step_count=-1), "scheduler 0's '_step_count' is -1"),
}


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_negative_counters_are_refused_by_file_and_field(saved, root, case):
    edit, field = NEGATIVE[case]
    file = _edit_stage(root, 1, edit)
    assert _refused_load(saved, root) == (
        f"{str(file)!r}: {field}, not a whole number from 0 (a count of batches, steps or epochs); the file was "
        f"edited or is corrupt: load an earlier checkpoint")


def test_a_negative_optimizer_step_is_refused_by_file_and_field(saved, root):
    def edit(state):
        state["optimizers"][0]["state"][0]["step"] = torch.tensor(-2.0)
    file = _edit_stage(root, 0, edit)
    assert _refused_load(saved, root) == (
        f"{str(file)!r}: optimizer 0's 'step' of parameter 0 is -2.0, not a whole number from 0 (a count of "
        f"batches, steps or epochs); the file was edited or is corrupt: load an earlier checkpoint")


# ---- temporary files of killed model writes ---------------------------------------------------------------------
def _killed(*targets: Path) -> list[Path]:
    """What writes of ``targets`` killed midway leave: their temporary files, which no process holds any more."""
    writes = [TempFile(target) for target in targets]
    for file in writes:
        os.close(file.fd)  # the process is gone: its descriptors (and the lock on them) with it
    return [file.temp for file in writes]


def test_the_next_model_write_removes_the_temporary_files_of_killed_writes_only(saved, tmp_path):
    target = tmp_path / "model.pt"
    live = TempFile(target)  # a write still going on (in this process): its file stays
    dead = _killed(target, target)
    other = tmp_path / f".notes.txt.tmp-{'0' * 16}"  # not a temporary file of this target
    other.write_text("x")
    fifo = tmp_path / f".model.pt.tmp-{'f' * 16}"  # not a writer's (writers create regular files): left unopened
    os.mkfifo(fifo)
    assert all(p.is_file() for p in dead)
    assert saved[1].save_model(target) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.pt", live.temp.name, other.name, fifo.name])
    live.discard()
    assert set(torch.load(target, weights_only=True)) == set(saved[1].model.state_dict())


def test_a_sharded_model_write_removes_the_shards_of_a_killed_write(saved, tmp_path):
    pytest.importorskip("safetensors")
    folder = tmp_path / "model"
    folder.mkdir()
    dead = _killed(folder / "model-00001-of-00003.safetensors", folder / "model.safetensors.index.json")
    assert all(p.is_file() for p in dead)
    saved[1].save_model(folder, sharded=True)
    assert sorted(p.name for p in folder.iterdir()) == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors",
                                                        "model.safetensors.index.json"]

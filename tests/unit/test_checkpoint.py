"""Checkpoints: a kill at any moment leaves one that loads; a load either restores everything or changes nothing."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch

import ppll_compile
from ppll_compile import CheckpointError
from ppll_compile.runtime.checkpoint import store as checkpoint
from tests import ckpt_worker as w
from tests.helpers import sgd
pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _trained(steps: int = 2, seed: int = 0, **options):
    compiled = w.pipeline(seed)
    trainer = compiled.trainer(optimizer=sgd, **options)
    for i in range(steps):
        trainer.step(*w.batch(i))
    return compiled, trainer


def _refused(trainer, compiled, path) -> str:
    """The error of loading ``path``, after checking that the trainer is exactly as before."""
    before = w.parameters(compiled)
    momentum = [dict(o.state) for r in trainer.runners for o in r.optimizers]
    batches, steps = trainer.batches, trainer.steps
    with pytest.raises(CheckpointError) as info:
        trainer.load(path)
    assert all(torch.equal(p, q) for p, q in zip(before, w.parameters(compiled), strict=True))
    assert [dict(o.state) for r in trainer.runners for o in r.optimizers] == momentum
    assert (trainer.batches, trainer.steps) == (batches, steps)
    return str(info.value)


# ---- the layout: pointer, keep, leftovers -------------------------------------------------------------------
def test_keep_holds_the_newest_checkpoints_and_an_older_one_loads_by_its_directory(tmp_path):
    compiled, trainer = _trained(1)
    saved = []
    for i in range(1, 5):
        saved.append(trainer.save(tmp_path, keep=2))
        trainer.step(*w.batch(i))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000002", "ckpt-000003", "latest"]
    assert (tmp_path / "latest").read_text() == "ckpt-000003\n" and saved[-1] == tmp_path / "ckpt-000003"
    older = w.pipeline(seed=7).trainer(optimizer=sgd)
    assert older.load(saved[-2]) == saved[-2] and older.batches == 3
    with pytest.raises(ValueError, match="^keep must be an integer >= 1"):
        trainer.save(tmp_path, keep=0)


def test_leftovers_are_never_loaded_and_are_removed_by_the_next_save(tmp_path):
    """A load writes nothing (a read-only directory loads): only the next save, holding the root's lock, removes
    what interrupted saves left, whatever process left it."""
    compiled, trainer = _trained(1)
    trainer.save(tmp_path)
    host = socket.gethostname()
    dead = tmp_path / f".ckpt-000005.tmp-{host}-999999999"  # a save whose process is gone
    live = tmp_path / f".ckpt-000006.tmp-{host}-{os.getpid()}"  # a save still running (this process)
    unpointed = tmp_path / "ckpt-000004"  # complete, but killed before the pointer moved to it
    trainer.step(*w.batch(1))
    trainer.save(tmp_path / "elsewhere")
    os.replace(tmp_path / "elsewhere" / "ckpt-000000", unpointed)
    for d in (dead, live):
        d.mkdir()
        (d / "stage-0.pt").write_bytes(os.urandom(1000))
    loaded = w.pipeline(seed=7).trainer(optimizer=sgd)
    assert loaded.load(tmp_path) == tmp_path / "ckpt-000000" and loaded.batches == 1
    assert dead.exists() and live.exists() and unpointed.exists()  # a load removes nothing
    assert trainer.save(tmp_path) == tmp_path / "ckpt-000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "elsewhere", "latest"]


def test_a_checkpoint_of_the_earlier_layout_still_loads(tmp_path):
    """A directory holding the manifest itself (one checkpoint) loads as it is."""
    compiled, trainer = _trained(2)
    one = trainer.save(tmp_path / "root")
    loaded = w.pipeline(seed=7).trainer(optimizer=sgd)
    assert loaded.load(one) == one and loaded.batches == 2


def test_a_pointer_to_nothing_is_named(tmp_path):
    compiled, trainer = _trained(1)
    trainer.save(tmp_path)
    (tmp_path / "latest").write_text("ckpt-000009\n")
    with pytest.raises(CheckpointError, match=r"latest' names ckpt-000009, but .*ckpt-000009' holds no "
                                              r"manifest.json \(removed by hand\?\); load an older checkpoint"):
        w.pipeline(seed=7).trainer(optimizer=sgd).load(tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match=r"latest' does not hold the name of a checkpoint like ckpt-000001 \(it holds "
                                              r"10 bytes of other text\)\. The newest complete checkpoint directory there is "):
        trainer.save(tmp_path)


# ---- all or nothing -----------------------------------------------------------------------------------------
def test_a_manifest_without_its_entries_is_named_and_nothing_loads(tmp_path):
    compiled, trainer = _trained(1)
    path = trainer.save(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["trainer"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    other, fresh = _trained(0, seed=7)
    assert _refused(fresh, other, tmp_path) == (
        f"{str(path / 'manifest.json')!r} is not a valid manifest (no 'trainer' entry); the checkpoint is "
        f"corrupt: load an earlier one")


def test_another_width_names_the_parameter_and_its_shapes(tmp_path):
    compiled, trainer = _trained(1)
    trainer.save(tmp_path)
    torch.manual_seed(0)
    wide = ppll_compile.compile(w.Residual(c=24), 2, example_inputs=(torch.randn(w.BATCH, 3, 8, 8),), policy="dgl",
                                plan=compiled.plan)
    text = _refused(wide.trainer(optimizer=sgd), wide, tmp_path)
    assert "stage 0 parameter 0 has shape [16, 3, 3, 3] in the checkpoint and [24, 3, 3, 3] here (the model was " \
           "built with other sizes)" in text


def test_another_dtype_is_named_and_nothing_loads(tmp_path):
    compiled, trainer = _trained(1)
    trainer.save(tmp_path)
    torch.manual_seed(3)
    model = w.Residual(c=16).double()
    double = ppll_compile.compile(model, 2, example_inputs=(torch.randn(w.BATCH, 3, 8, 8, dtype=torch.float64),),
                                  policy="dgl", plan=compiled.plan)
    text = _refused(double.trainer(optimizer=sgd), double, tmp_path)
    assert text.startswith(f"checkpoint {str(tmp_path / 'ckpt-000000')!r} does not fit this trainer: stage 0 backbone")
    assert "is [16, 3, 3, 3] float32 in the checkpoint and [16, 3, 3, 3] float64 here" in text


def test_an_optimizer_state_that_does_not_fit_changes_nothing(tmp_path):
    """An SGD trainer (no momentum) loading an SGD-with-momentum checkpoint after its own first step: the
    optimizer class matches, the state does not; stage 0 must not be loaded before stage 1 is found wrong."""
    compiled, trainer = _trained(1)
    trainer.save(tmp_path)
    other = w.pipeline(seed=7)
    nesterov = other.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, nesterov=True))
    nesterov.step(*w.batch(0))
    state = torch.load(checkpoint.latest(tmp_path) / "stage-1.pt", weights_only=True)
    state["optimizers"][0]["state"][0]["momentum_buffer"] = torch.zeros(3)
    _rewrite(tmp_path, 1, state)
    text = _refused(nesterov, other, tmp_path)
    assert "stage 1 optimizer 0 state of parameter 0['momentum_buffer'] is [3] float32 in the checkpoint" in text


def _rewrite(root: Path, stage: int, state: dict) -> None:
    """Replace a stage file of the newest checkpoint, manifest entry included (a consistent but other state)."""
    path = checkpoint.latest(root)
    (path / f"stage-{stage}.pt").unlink()  # save_stage creates its file exclusively
    entry = checkpoint.save_stage(path, state)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = [entry if f["stage"] == stage else f for f in manifest["files"]]
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_scheduler_mismatch_is_named_and_nothing_loads(tmp_path):
    compiled, trainer = _trained(1)
    trainer.save(tmp_path)
    other = w.pipeline(seed=7)
    scheduled = other.trainer(optimizer=sgd, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2))
    text = _refused(scheduled, other, tmp_path)
    assert "stage 0: the checkpoint has no scheduler state and this trainer has a learning-rate scheduler; build " \
           "the trainer with the scheduler= it was trained with" in text

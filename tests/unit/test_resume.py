"""fit(..., checkpoint=DIR, every=N): a run stopped at any batch and started again with the same call ends with the
parameters of a run that never stopped; failed saves warn, and a few in a row stop the fit; bad arguments are named."""

import re

import pytest
import torch

import ppll_compile
from ppll_compile import CheckpointError, PPLLError
from ppll_compile.runtime.rng import stream_seed
from tests.helpers import (
    BATCH,
    CONV_X,
    compiled_residual,
    fit_with_checkpoints,
    image_batches,
    resume_loader,
    saved_at,
    sgd,
    stage_state,
)
from tests.models import conv_student, conv_teacher
pytestmark = pytest.mark.usefixtures("one_thread_quietly")


class Batches:
    """A list of batches with a length, not a DataLoader; drawing batch ``stop`` (counted over every pass) raises
    KeyboardInterrupt."""

    def __init__(self, batches: list, stop: int | None = None) -> None:
        self.batches, self.stop, self.drawn = batches, stop, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            if self.drawn == self.stop:
                raise KeyboardInterrupt
            self.drawn += 1
            yield b


def test_any_loader_with_a_length_resumes_its_batches_drawn_and_dropped(tmp_path):
    data = image_batches(5, last=3)
    ref, _ = fit_with_checkpoints("sequential", tmp_path / "ref", Batches(data))
    with pytest.raises(KeyboardInterrupt):
        fit_with_checkpoints("sequential", tmp_path / "run", Batches(data, stop=8))
    assert saved_at(tmp_path / "run") == 7  # the end of epoch 1 (5), then batch 2 of epoch 2
    again = Batches(data)
    resumed, history = fit_with_checkpoints("sequential", tmp_path / "run", again)
    assert again.drawn == 5 and [(h["epoch"], h["samples"]) for h in history] == [(2, 2 * BATCH + 3)]
    for p, q in zip(stage_state(ref), stage_state(resumed), strict=True):
        assert torch.equal(p, q)


def test_every_epochs_order_is_the_documented_one_and_saving_does_not_change_the_training(tmp_path):
    loader = resume_loader()
    fitted, history = fit_with_checkpoints("sequential", tmp_path / "ckpt", loader)
    assert [(h["epoch"], h["samples"]) for h in history] == [(1, 44), (2, 44)]
    assert loader.sampler.generator is None  # given back as it was
    # the same batches stepped by hand, in the order the docstring of fit gives, saving nothing
    x, y = loader.dataset.tensors
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd) as trainer:
        for epoch in range(2):
            order = torch.randperm(44, generator=torch.Generator().manual_seed(stream_seed(0, -1, epoch)))
            for batch in order.split(BATCH):
                trainer.step(x[batch], y[batch])
            trainer.finish()
    for p, q in zip(stage_state(compiled), stage_state(fitted), strict=True):
        assert torch.equal(p, q)
    # every=2 and the end of each epoch: batches 2, 4, 6, 8, 10, 12; keep=1 leaves only the newest
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-000005", "latest"]


# ---- failed saves ---------------------------------------------------------------------------------------------

def _saving(trainer, outcomes: list[str]):
    """A stand-in for ``trainer.save``: the real save for "ok", else an OSError (disk full) or a CheckpointError."""
    real, calls = trainer.save, iter(outcomes)

    def save(path, keep=1):
        outcome = next(calls)
        if outcome == "ok":
            return real(path, keep)
        if outcome == "full":
            raise OSError(28, "No space left on device")
        raise CheckpointError("the process of rank 1 could not write its stages: OSError: read-only file system")

    return save


def test_failed_saves_warn_and_three_in_a_row_stop_the_fit(tmp_path):
    root = tmp_path / "ckpt"
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd) as trainer:
        trainer.save = _saving(trainer, ["ok", "full", "ok", "full", "other", "full", "ok"])
        with pytest.warns(UserWarning) as warned:
            with pytest.raises(PPLLError) as info:
                trainer.fit(image_batches(8), epochs=1, checkpoint=root, every=1, progress=False)
        assert trainer.batches == 6  # stopped at the third failure in a row; never reached batch 7
    last = root / "ckpt-000001"
    assert str(info.value) == (
        f"fit stopped: the last 3 checkpoint saves into {str(root)!r} failed, so training is no longer protected; "
        f"the last complete checkpoint is {str(last)!r} (batch 3); the last save (at batch 6) failed with OSError: "
        f"[Errno 28] No space left on device. Fix the cause (disk space, permissions, the directory), then run the "
        f"same fit(..., checkpoint=...) again: it resumes from the last complete checkpoint")
    assert [str(w.message) for w in warned] == [
        f"checkpoint save into {str(root)!r} at batch 2 failed (OSError: [Errno 28] No space left on device); "
        f"training goes on, the last complete checkpoint is {str(root / 'ckpt-000000')!r} (batch 1) (1 failed "
        f"save(s) in a row; fit stops at 3)",
        f"checkpoint save into {str(root)!r} at batch 4 failed (OSError: [Errno 28] No space left on device); "
        f"training goes on, the last complete checkpoint is {str(last)!r} (batch 3) (1 failed save(s) in a row; "
        f"fit stops at 3)",
        f"checkpoint save into {str(root)!r} at batch 5 failed (CheckpointError: the process of rank 1 could not "
        f"write its stages: OSError: read-only file system); training goes on, the last complete checkpoint is "
        f"{str(last)!r} (batch 3) (2 failed save(s) in a row; fit stops at 3)"]
    assert {w.filename for w in warned} == {__file__}  # the line that called fit
    assert saved_at(root) == 3


def test_failing_from_the_first_save_says_no_checkpoint_exists(tmp_path):
    root = tmp_path / "ckpt"
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd) as trainer:
        trainer.save = _saving(trainer, ["full"] * 3)
        with pytest.warns(UserWarning, match=re.escape(f"there is no complete checkpoint in {str(root)!r} yet")):
            with pytest.raises(PPLLError, match=re.escape(
                    f"training is no longer protected; and there is no complete checkpoint in {str(root)!r} yet; "
                    f"the last save (at batch 3) failed with OSError")):
                trainer.fit(image_batches(4), epochs=1, checkpoint=root, every=1, progress=False)


# ---- samplers ------------------------------------------------------------------------------------------------

def test_a_distributed_sampler_is_given_each_epoch(tmp_path):
    from torch.utils.data import DataLoader, DistributedSampler
    data = resume_loader().dataset
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    fitted, _ = fit_with_checkpoints("sequential", tmp_path / "ckpt", DataLoader(data, batch_size=BATCH,
                                                                                 sampler=sampler))
    assert sampler.epoch == 1
    x, y = data.tensors
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd) as trainer:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in torch.tensor(list(sampler)).split(BATCH):
                trainer.step(x[batch], y[batch])
            trainer.finish()
    for p, q in zip(stage_state(compiled), stage_state(fitted), strict=True):
        assert torch.equal(p, q)


def test_resuming_with_a_generator_of_the_loaders_own_warns(tmp_path):
    from torch.utils.data import DataLoader
    data = resume_loader().dataset
    fit_with_checkpoints("sequential", tmp_path / "ckpt", DataLoader(data, batch_size=BATCH, shuffle=True,
                                                     generator=torch.Generator().manual_seed(1)))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd) as trainer:
        with pytest.warns(UserWarning) as warned:
            assert trainer.fit(loader, epochs=3, checkpoint=tmp_path / "ckpt", progress=False)[0]["epoch"] == 3
    assert warned[0].filename == __file__
    assert [str(w.message) for w in warned] == [
        f"this DataLoader shuffles with a generator of its own: after resuming from "
        f"{str(tmp_path / 'ckpt' / 'ckpt-000005')!r}, its epochs are drawn from that generator's present state, not "
        f"in the order of a run that never stopped; build the DataLoader without generator= (fit then seeds every "
        f"epoch's order from the trainer's seed) to resume exactly"]


def test_a_runtime_that_trains_every_epoch_at_once_is_refused(tmp_path):
    torch.manual_seed(0)
    compiled = ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(CONV_X,),
                                    split_points=["5"], replicas=(1, 1))
    with compiled.trainer(optimizer=sgd, runtime="dna-per-block") as trainer:
        with pytest.raises(PPLLError) as info:
            trainer.fit([(CONV_X, None)], checkpoint=tmp_path / "ckpt", progress=False)
    assert str(info.value) == (
        "fit(checkpoint=...) saves between batches, but runtime='dna-per-block' trains over every epoch at once "
        "(block after block); leave checkpoint= out and call trainer.save(DIR) after fit, or train batch by batch "
        "(runtime=\"dna\" gives the same parameters)")

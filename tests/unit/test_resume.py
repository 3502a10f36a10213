"""fit(..., checkpoint=DIR, every=N): a run stopped at any batch and started again with the same call ends with the
parameters of a run that never stopped; failed saves warn, and a few in a row stop the fit; bad arguments are named."""

import json
import re
from pathlib import Path

import pytest
import torch

import ppll_compile
from ppll_compile import CheckpointError, PPLLError
from ppll_compile.runtime.rng import stream_seed
from tests.helpers import (
    BATCH,
    CONV_X,
    RESUME_EPOCH,
    compiled_residual,
    image_batches,
    resume_loader,
    run_gloo_workers,
    sgd,
    stage_state,
)
from tests.models import conv_student, conv_teacher

HERE = Path(__file__).parent
pytestmark = pytest.mark.usefixtures("one_thread_quietly")

EVERY = 2
STOP_AT = RESUME_EPOCH + 3  # in the second epoch, one batch after the checkpoint at batch 8


def _fit(runtime: str, root: Path, loader=None, **options):
    """A fresh pipeline trained by ``fit(loader, epochs=2, checkpoint=root, every=EVERY)`` (trainer ``options``);
    it and the history."""
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd, runtime=runtime, **options) as trainer:
        history = trainer.fit(loader if loader is not None else resume_loader(), epochs=2, checkpoint=root,
                              every=EVERY, progress=False)
    return compiled, history


def _stop() -> None:
    raise KeyboardInterrupt


def _saved_at(root: Path) -> int:
    """The batch count of the checkpoint ``root/latest`` names."""
    name = (root / "latest").read_text().strip()
    return json.loads((root / name / "manifest.json").read_text())["trainer"]["batches"]


@pytest.mark.parametrize("runtime, options", [("sequential", {}), pytest.param("threads", {}, marks=pytest.mark.slow),
                                              pytest.param("sequential", {"accumulate": 2}, marks=pytest.mark.slow)])
def test_a_run_stopped_mid_epoch_resumes_to_the_parameters_of_one_that_never_stopped(tmp_path, runtime, options):
    ref, _ = _fit(runtime, tmp_path / "ref", **options)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C while the loader draws batch 9 (the 4th of epoch 2)
        _fit(runtime, tmp_path / "run", resume_loader(STOP_AT, _stop), **options)
    assert _saved_at(tmp_path / "run") == 8
    loader = resume_loader()
    resumed, history = _fit(runtime, tmp_path / "run", loader, **options)  # the same call again
    assert loader.collate_fn.drawn == [4]  # the 2 batches skipped were never loaded
    # only what was left: batches 2..5 of epoch 2 (8 + 8 + 8 + 4 examples)
    assert [(h["epoch"], h["samples"]) for h in history] == [(2, 3 * BATCH + 4)]
    for p, q in zip(stage_state(ref), stage_state(resumed), strict=True):
        assert torch.equal(p, q)
    assert _saved_at(tmp_path / "run") == 2 * RESUME_EPOCH
    # a finished fit started again loads its last checkpoint and trains nothing
    again, history = _fit(runtime, tmp_path / "run", **options)
    assert history == []
    for p, q in zip(stage_state(ref), stage_state(again), strict=True):
        assert torch.equal(p, q)


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
    ref, _ = _fit("sequential", tmp_path / "ref", Batches(data))
    with pytest.raises(KeyboardInterrupt):
        _fit("sequential", tmp_path / "run", Batches(data, stop=8))
    assert _saved_at(tmp_path / "run") == 7  # the end of epoch 1 (5), then batch 2 of epoch 2
    again = Batches(data)
    resumed, history = _fit("sequential", tmp_path / "run", again)
    assert again.drawn == 5 and [(h["epoch"], h["samples"]) for h in history] == [(2, 2 * BATCH + 3)]
    for p, q in zip(stage_state(ref), stage_state(resumed), strict=True):
        assert torch.equal(p, q)


def test_every_epochs_order_is_the_documented_one_and_saving_does_not_change_the_training(tmp_path):
    loader = resume_loader()
    fitted, history = _fit("sequential", tmp_path / "ckpt", loader)
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


@pytest.mark.slow
def test_a_distributed_run_whose_rank_0_is_killed_resumes_to_the_parameters_of_one_that_never_stopped(tmp_path):
    """tests/resume_worker.py: an uninterrupted 2-process run, one whose rank 0 SIGKILLs itself as its loader draws
    batch 9 (the other rank then fails), and the same call again, which resumes from the checkpoint at batch 8."""
    text = run_gloo_workers(HERE / "resume_worker.py", 2, tmp_path, timeout=300)
    killed = [json.loads(line)["killed"] for line in text.splitlines() if line.startswith('{"killed"')]
    assert killed[0][0] == -9 and killed[0][1] != 0, text[-3000:]
    for rank in range(2):
        ref, resumed = (torch.load(tmp_path / f"{run}-{rank}.pt", weights_only=True) for run in ("ref", "resume"))
        assert ref["states"].keys() == resumed["states"].keys() == {rank}
        for name, value in ref["states"][rank].items():
            assert torch.equal(resumed["states"][rank][name], value), (rank, name)
    assert torch.load(tmp_path / "resume-0.pt", weights_only=True)["batches"] == 2 * RESUME_EPOCH


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
    assert _saved_at(root) == 3


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


# ---- bad arguments --------------------------------------------------------------------------------------------

EVERY_TEXT = ("every must be a positive whole number of batches between two checkpoints, got {}; pass e.g. "
              "every=100, or leave it out to save at the end of every epoch")


@pytest.mark.parametrize("options, expected", [
    ({"every": 0}, EVERY_TEXT.format(0)),
    ({"every": -2}, EVERY_TEXT.format(-2)),
    ({"every": 2.5}, EVERY_TEXT.format(2.5)),
    ({"every": True}, EVERY_TEXT.format(True)),
    ({"every": 3, "accumulate": 2}, "every=3 is not a multiple of accumulate=2: a checkpoint inside an accumulation "
                                    "group would lose the gradients its stages hold; pass every=4 or another "
                                    "multiple of 2"),
    ({"keep": 0}, "keep must be a whole number >= 1 (how many complete checkpoints stay in the directory), got 0; "
                  "pass keep=1 to keep only the newest"),
    ({"checkpoint": None, "every": 5}, "fit(every=5) saves every 5 batches, but no checkpoint directory was given; "
                                       "pass checkpoint=\"DIR\" too, or leave every= out"),
    ({"loader": (b for b in image_batches(2))},
     "fit(checkpoint=...) needs a loader with len(): the point to resume from is a position in an epoch, and "
     "generator has no length. Give a list of batches or a DataLoader over a map-style dataset, or leave "
     "checkpoint= out and call trainer.save(DIR) yourself"),
    ({"loader": []}, "fit(checkpoint=...) was given an empty loader (len() is 0): there is no batch to train or to "
                     "resume at; give a loader with at least one batch"),
])
def test_bad_arguments_are_refused_before_training(tmp_path, options, expected):
    compiled = compiled_residual()
    fit = {"loader": image_batches(2), "checkpoint": tmp_path / "ckpt"}
    fit |= {k: options.pop(k) for k in list(options) if k in fit or k in ("every", "keep")}
    with compiled.trainer(optimizer=sgd, **options) as trainer:
        with pytest.raises(PPLLError) as info:
            trainer.fit(fit.pop("loader"), progress=False, **fit)
        assert trainer.batches == 0
    assert str(info.value) == expected
    assert not (tmp_path / "ckpt").exists()


# ---- samplers ------------------------------------------------------------------------------------------------

def test_a_distributed_sampler_is_given_each_epoch(tmp_path):
    from torch.utils.data import DataLoader, DistributedSampler
    data = resume_loader().dataset
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    fitted, _ = _fit("sequential", tmp_path / "ckpt", DataLoader(data, batch_size=BATCH, sampler=sampler))
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
    _fit("sequential", tmp_path / "ckpt", DataLoader(data, batch_size=BATCH, shuffle=True,
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

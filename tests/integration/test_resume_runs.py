"""fit(..., checkpoint=DIR, every=N): a run stopped at any batch and started again with the same call ends with the
parameters of a run that never stopped; failed saves warn, and a few in a row stop the fit; bad arguments are named."""

import json
from pathlib import Path

import pytest
import torch
from tests.helpers import (
    BATCH,
    RESUME_EPOCH,
    fit_with_checkpoints,
    resume_loader,
    run_gloo_workers,
    saved_at,
    stage_state,
)
from ppll_compile import PPLLError
from tests.helpers import compiled_residual, image_batches, sgd

HERE = Path(__file__).parents[1]
pytestmark = pytest.mark.usefixtures("one_thread_quietly")

STOP_AT = RESUME_EPOCH + 3  # in the second epoch, one batch after the checkpoint at batch 8


def _stop() -> None:
    raise KeyboardInterrupt


EVERY_TEXT = ("every must be a positive whole number of batches between two checkpoints, got {}; pass e.g. "
              "every=100, or leave it out to save at the end of every epoch")


@pytest.mark.parametrize("runtime, options", [("sequential", {}), pytest.param("threads", {}, marks=pytest.mark.slow),
                                              pytest.param("sequential", {"accumulate": 2}, marks=pytest.mark.slow)])
def test_a_run_stopped_mid_epoch_resumes_to_the_parameters_of_one_that_never_stopped(tmp_path, runtime, options):
    ref, _ = fit_with_checkpoints(runtime, tmp_path / "ref", **options)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C while the loader draws batch 9 (the 4th of epoch 2)
        fit_with_checkpoints(runtime, tmp_path / "run", resume_loader(STOP_AT, _stop), **options)
    assert saved_at(tmp_path / "run") == 8
    loader = resume_loader()
    resumed, history = fit_with_checkpoints(runtime, tmp_path / "run", loader, **options)  # the same call again
    assert loader.collate_fn.drawn == [4]  # the 2 batches skipped were never loaded
    # only what was left: batches 2..5 of epoch 2 (8 + 8 + 8 + 4 examples)
    assert [(h["epoch"], h["samples"]) for h in history] == [(2, 3 * BATCH + 4)]
    for p, q in zip(stage_state(ref), stage_state(resumed), strict=True):
        assert torch.equal(p, q)
    assert saved_at(tmp_path / "run") == 2 * RESUME_EPOCH
    # a finished fit started again loads its last checkpoint and trains nothing
    again, history = fit_with_checkpoints(runtime, tmp_path / "run", **options)
    assert history == []
    for p, q in zip(stage_state(ref), stage_state(again), strict=True):
        assert torch.equal(p, q)


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

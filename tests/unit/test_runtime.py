"""The one-process runtimes: threads reproduce sequential local learning, faults stop the pipeline, checkpoints resume."""

import copy
import json
import threading
import time

import pytest
import torch
import torch.nn.functional as F
import yaml

import ppll_compile
from ppll_compile import CheckpointError, StageError
from tests.helpers import (
    BATCH,
    assert_same_parameters,
    compiled_residual,
    image_batches,
    no_workers_left,
    on_first_stage,
    sgd,
    stage_state,
    train_residual,
)
from tests.models import Residual

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def test_sequential_is_local_learning_by_hand():
    """Each stage: forward its block on the detached input, its own loss, its own optimizer step."""
    data = image_batches(3)
    compiled, _ = train_residual("sequential", data)
    ref = compiled_residual()
    opts = [sgd(ref.stage_parameters(i)) for i in range(2)]
    for x, y in data:
        h = ref.stages[0](x)
        loss0 = ref.heads[0].loss(h[0], y)
        opts[0].zero_grad()
        loss0.backward()
        opts[0].step()
        loss1 = F.cross_entropy(ref.stages[1](*(v.detach() for v in h)), y)
        opts[1].zero_grad()
        loss1.backward()
        opts[1].step()
    assert_same_parameters(compiled, ref)


def test_model_is_trained_in_place():
    compiled = compiled_residual()
    before = copy.deepcopy(compiled.model.state_dict())
    trainer = compiled.trainer(optimizer=sgd)
    for x, y in image_batches(2):
        trainer.step(x, y)
    after = compiled.model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before if after[k].is_floating_point())


def test_evaluate_matches_the_model():
    compiled, _ = train_residual("threads", image_batches(3))
    test = image_batches(2, seed=1)
    result = compiled.trainer(optimizer=sgd).evaluate(test)
    model = compiled.model.eval()
    with torch.no_grad():
        right = sum(int((model(x).argmax(1) == y).sum()) for x, y in test)
        h = [compiled.stages[0](x)[0] for x, _ in test]
        head_right = sum(int((compiled.heads[0].eval()(a).argmax(1) == y).sum()) for a, (_, y) in zip(h, test))
        out, scores = torch.cat([model(x) for x, _ in test]), torch.cat([compiled.heads[0](a) for a in h])
    n = sum(len(y) for _, y in test)
    y = torch.cat([y for _, y in test])
    loss = float(F.cross_entropy(out, y))
    assert result == {"loss": pytest.approx(loss, rel=1e-5),
                      "stage_loss": [pytest.approx(float(F.cross_entropy(scores, y)), rel=1e-5),
                                     pytest.approx(loss, rel=1e-5)],
                      "accuracy": right / n, "stage_accuracy": [head_right / n, right / n], "perplexity": None,
                      "samples": n}
    assert compiled.stages[0].training  # evaluate restores train mode


def test_fit_reports_every_batch_and_equals_steps():
    data = image_batches(4, last=3)
    compiled = compiled_residual()
    history = compiled.trainer(optimizer=sgd, runtime="threads").fit(data, epochs=2, progress=False)
    ref, _ = train_residual("sequential", data + data)
    assert_same_parameters(compiled, ref)
    assert [h["samples"] for h in history] == [3 * BATCH + 3] * 2
    assert all(len(h["loss"]) == 2 and all(v is not None for v in h["loss"]) for h in history)


def test_scheduler_steps_per_batch_on_every_stage():
    compiled = compiled_residual()
    trainer = compiled.trainer(optimizer=sgd, runtime="threads",
                               scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    for x, y in image_batches(5):
        trainer.step(x, y)
    trainer.finish()
    lrs = [r.optimizer.param_groups[0]["lr"] for r in trainer.runners]
    assert lrs == [0.05 * 0.5 ** 2] * 2
    assert trainer.steps == {0: 5, 1: 5}


def test_clip_grad_norm_bounds_each_stage():
    compiled = compiled_residual()
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
            return super().step(closure)

    trainer = compiled.trainer(optimizer=lambda p: Spy(p, lr=10.0), clip_grad_norm=1e-3)
    for x, y in image_batches(2):
        trainer.step(x, y)
    assert len(seen) == 4 and max(seen) <= 1e-3 * (1 + 1e-4)


def test_a_stage_measured_alone_computes_what_training_it_does():
    x, y = image_batches(1)[0]
    compiled = compiled_residual()
    trainer = compiled.trainer(optimizer=sgd)
    msg = trainer.message(x, y)
    assert (msg.index, trainer.batches) == (0, 1) and torch.equal(msg.target, y)
    first = trainer.runners[0]
    before = stage_state(trainer)
    out, loss = first.forward_loss(msg)
    assert all(torch.equal(p, q) for p, q in zip(before, stage_state(trainer))) and first.steps == 0
    sent, trained = first.train_step(msg)
    assert float(trained) == float(loss)
    assert torch.equal(sent.values[0], out[0].detach())
    assert not all(torch.equal(p, q) for p, q in zip(before, stage_state(trainer)))


def test_bf16_autocast_keeps_planned_boundary_dtype():
    x, y = image_batches(1)[0]
    full = compiled_residual().trainer(optimizer=sgd).step(x, y)
    trainer = compiled_residual().trainer(optimizer=sgd, autocast=torch.bfloat16)
    msg, loss = trainer.runners[0].train_step(trainer.message(x, y))
    assert msg.values[0].dtype == torch.float32  # what the plan (and a distributed receiver) expects
    assert float(loss) == pytest.approx(full[0][0], rel=0.05) and float(loss) != full[0][0]


# ---- queue="reuse" -----------------------------------------------------------------------------
def test_reuse_trains_inputs_again_when_upstream_is_slow():
    compiled = compiled_residual()
    trainer = compiled.trainer(optimizer=on_first_stage(compiled, lambda: time.sleep(0.05), lr=0.01),
                               runtime="threads", queue="reuse")
    data = image_batches(6)
    n_losses = [0, 0]
    for x, y in data:
        for i, ls in enumerate(trainer.step(x, y)):
            n_losses[i] += len(ls)
    for i, ls in enumerate(trainer.finish()):
        n_losses[i] += len(ls)
    assert trainer.reused[0] == 0 and 0 < trainer.reused[1] <= len(data)
    assert trainer.steps == {0: len(data), 1: len(data) + trainer.reused[1]}
    assert n_losses == [trainer.steps[0], trainer.steps[1]]


def test_reuse_never_sends_the_output_of_a_reused_input():
    """Stage 0 (which sends batch b before its step on it) steps on batch b only after stage 1 trained on b and
    then, finding no new input, on b again: every batch reaches stage 2 once, however often stage 1 trained on it."""
    n = 4
    compiled = compiled_residual(3)
    first, middle = ({id(p) for p in compiled.stage_parameters(i)} for i in (0, 1))
    steps = [0, 0]
    progress = threading.Condition()

    class Paced(torch.optim.SGD):
        def step(self, closure=None):
            ids = {id(p) for g in self.param_groups for p in g["params"]}
            with progress:
                if ids & middle:
                    steps[1] += 1
                    progress.notify_all()
                elif ids & first:
                    if not progress.wait_for(lambda: steps[1] >= 2 * (steps[0] + 1), timeout=60):
                        raise TimeoutError(f"stage 1 took {steps[1]} steps, expected {2 * (steps[0] + 1)}")
                    steps[0] += 1
            return super().step(closure)

    trainer = compiled.trainer(optimizer=lambda params: Paced(params, lr=0.01), runtime="threads", queue="reuse")
    losses = [0, 0, 0]
    for x, y in image_batches(n):
        for i, ls in enumerate(trainer.step(x, y)):
            losses[i] += len(ls)
    for i, ls in enumerate(trainer.finish()):
        losses[i] += len(ls)
    assert trainer.reused[0] == 0 and trainer.reused[1] == n
    assert trainer.steps[0] == n and trainer.steps[1] == n + trainer.reused[1]
    assert trainer.steps[2] - trainer.reused[2] == n  # new inputs of the last stage: each batch once
    assert losses == [trainer.steps[i] for i in range(3)]


# ---- faults ------------------------------------------------------------------------------------
def _failing_loss(at: int):
    calls = [0]

    def loss(out, y):
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError("boom in the user's loss")
        return F.cross_entropy(out, y)
    return loss


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_a_failing_stage_stops_the_pipeline(runtime):
    trainer = compiled_residual().trainer(optimizer=sgd, runtime=runtime, loss=_failing_loss(3))
    start = time.monotonic()
    with pytest.raises(StageError) as info:
        for x, y in image_batches(20):
            trainer.step(x, y)
        trainer.finish()
    assert time.monotonic() - start < 10
    err = info.value
    assert (err.stage, err.batch) == (1, 2)
    assert str(err).startswith("stage 1 failed at batch 2: RuntimeError: boom in the user's loss")
    assert "in loss" in err.traceback and "boom in the user's loss" in err.traceback
    assert no_workers_left()
    with pytest.raises(StageError):  # the pipeline stays stopped
        trainer.step(*image_batches(1)[0])


def test_nan_check_names_the_stage():
    trainer = compiled_residual().trainer(optimizer=sgd, runtime="threads", nan_check=True,
                                  loss=lambda out, y: F.cross_entropy(out, y) * float("nan"))
    with pytest.raises(StageError, match=r"^stage 1 failed at batch 0: FloatingPointError: loss is nan "):
        for x, y in image_batches(4):
            trainer.step(x, y)
        trainer.finish()
    assert no_workers_left()


def test_first_stage_failure_in_threads():
    compiled = compiled_residual()

    def explode():
        raise ValueError("optimizer exploded")

    trainer = compiled.trainer(optimizer=on_first_stage(compiled, explode, lr=0.1), runtime="threads")
    with pytest.raises(StageError, match="^stage 0 failed at batch 0: ValueError: optimizer exploded"):
        for x, y in image_batches(10):
            trainer.step(x, y)
        trainer.finish()
    assert no_workers_left()


# ---- bad input ---------------------------------------------------------------------------------
def test_step_rejects_a_batch_that_does_not_fit_the_plan():
    trainer = compiled_residual().trainer(optimizer=sgd)
    y = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError) as info:
        trainer.step(torch.randn(4, 3, 16, 16), y)
    assert str(info.value) == ("input 'x' has shape (4, 3, 16, 16) and dtype float32; the plan expects "
                               "(N, 3, 8, 8) float32 (N = any batch size). Compile with example inputs of the "
                               "shape you train on")
    with pytest.raises(ValueError, match=r"has shape \(4, 3, 8, 8\) and dtype float64; the plan expects"):
        trainer.step(torch.randn(4, 3, 8, 8, dtype=torch.float64), y)
    with pytest.raises(ValueError, match="^target has 5 rows but the inputs have batch size 4"):
        trainer.step(torch.randn(4, 3, 8, 8), torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="^input 'x' must be a tensor"):
        trainer.step([[1.0]], y)
    assert trainer.batches == 0 and trainer.steps == {0: 0, 1: 0}


@pytest.mark.parametrize("options,message", [
    ({"runtime": "gpu"}, "runtime='gpu' is not known; choose one of sequential, threads, distributed"),
    ({"queue": "lifo"}, "queue='lifo' is not known; choose one of fifo, latest, reuse"),
    ({"queue": "latest"}, 'queue="latest" needs a pipelined runtime'),
    ({"queue_depth": 0}, "queue_depth must be an integer >= 1, got 0"),
    ({"autocast": "bf16"}, "autocast must be a dtype"),
])
def test_trainer_options_are_checked(options, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        compiled_residual().trainer(optimizer=sgd, **options)


def test_optimizer_must_be_a_factory():
    compiled = compiled_residual()
    with pytest.raises(TypeError, match="optimizer must be a factory fn"):
        compiled.trainer(optimizer=torch.optim.SGD(compiled.model.parameters(), lr=0.1))


# ---- checkpoints -------------------------------------------------------------------------------
def test_resume_equals_never_stopping(tmp_path):
    data = image_batches(6, last=7)
    straight, _ = train_residual("threads", data, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)  # noqa: E731
    first = compiled_residual().trainer(optimizer=sgd, runtime="threads", scheduler=sched)
    for x, y in data[:3]:
        first.step(x, y)
    saved = first.save(tmp_path / "ckpt")
    first.close()
    resumed_pipeline = compiled_residual(seed=123)  # other initial weights: everything must come from the checkpoint
    resumed = resumed_pipeline.trainer(optimizer=sgd, runtime="sequential", scheduler=sched)
    resumed.load(tmp_path / "ckpt")
    assert resumed.batches == 3 and resumed.steps == {0: 3, 1: 3}
    for x, y in data[3:]:
        resumed.step(x, y)
    assert_same_parameters(resumed_pipeline, straight)
    assert saved == tmp_path / "ckpt" / "ckpt-000000"
    assert (tmp_path / "ckpt" / "latest").read_text() == "ckpt-000000\n"
    manifest = json.loads((saved / "manifest.json").read_text())
    assert [f["file"] for f in manifest["files"]] == ["stage-0.pt", "stage-1.pt"]


def _saved(tmp_path):
    trainer = compiled_residual().trainer(optimizer=sgd)
    trainer.step(*image_batches(1)[0])
    trainer.save(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_load_rejects_a_directory_without_a_checkpoint(tmp_path):
    path = _saved(tmp_path)
    (path / "latest").unlink()
    with pytest.raises(CheckpointError, match="^no complete checkpoint in .* \\(neither latest nor manifest.json\\): "
                                              "not a checkpoint, or no save there finished; load an earlier "
                                              "checkpoint"):
        compiled_residual().trainer(optimizer=sgd).load(path)


def test_load_rejects_a_corrupt_stage_file(tmp_path):
    path = _saved(tmp_path) / "ckpt-000000"
    data = bytearray((path / "stage-1.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "stage-1.pt").write_bytes(bytes(data))
    trainer = compiled_residual(seed=5).trainer(optimizer=sgd)
    before = stage_state(trainer)
    with pytest.raises(CheckpointError, match=r"stage-1.pt' has \d+ bytes and another sha256; manifest.json "
                                              r"expects \d+ bytes"):
        trainer.load(path)
    for p, q in zip(before, stage_state(trainer)):  # nothing was half-loaded
        assert torch.equal(p, q)


def test_load_rejects_another_plan(tmp_path):
    path = _saved(tmp_path)
    other = compiled_residual(3)
    with pytest.raises(CheckpointError) as info:
        other.trainer(optimizer=sgd).load(path)
    text = str(info.value)
    assert "was saved for another pipeline: stages: checkpoint has 2, this pipeline has 3; cuts: checkpoint has" \
           in text and "compile(model, plan=...)" in text


def _refused(trainer, path) -> str:
    """The error of loading ``path`` into ``trainer``, after checking that nothing was loaded."""
    before = stage_state(trainer)
    with pytest.raises(CheckpointError) as info:
        trainer.load(path)
    for p, q in zip(before, stage_state(trainer), strict=True):
        assert torch.equal(p, q)
    assert trainer.batches == 0 and set(trainer.steps.values()) == {0}
    return str(info.value)


def test_load_rejects_a_checkpoint_saved_with_other_heads(tmp_path):
    path = _saved(tmp_path)
    saved = compiled_residual()
    edited = yaml.safe_load(saved.plan.to_yaml())
    edited["stages"][0]["head"]["config"]["loss"]["classification_weight"] = 0.5
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(edited))
    torch.manual_seed(5)
    other = ppll_compile.compile(Residual(), plan=tmp_path / "plan.yaml")
    assert [p.shape for p in stage_state(other)] == [p.shape for p in stage_state(saved)]  # only the head's loss differs
    heads = [[s["head"]["config"] for s in yaml.safe_load(c.plan.to_yaml())["stages"]] for c in (saved, other)]
    assert heads[0] != heads[1]
    assert _refused(other.trainer(optimizer=sgd), path) == (
        f"checkpoint {str(path / 'ckpt-000000')!r} was saved for another pipeline: heads: checkpoint has {heads[0]!r}, this "
        f"pipeline has {heads[1]!r}. Compile the same model with the plan it was trained with "
        f"(compile(model, plan=...)) to load it.")


def test_load_rejects_a_checkpoint_of_another_optimizer(tmp_path):
    path = _saved(tmp_path)  # trained with SGD
    trainer = compiled_residual(seed=5).trainer(optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
    assert _refused(trainer, path) == (
        f"checkpoint {str(path / 'ckpt-000000')!r} was saved for another pipeline: optimizer: checkpoint has ['SGD'], this "
        f"pipeline has ['Adam']. Build the trainer with the optimizer class it was trained with "
        f"(trainer(optimizer=...)) to load it.")


def test_save_refuses_a_file_path(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file; a checkpoint is a directory"):
        compiled_residual().trainer(optimizer=sgd).save(tmp_path / "f")

"""Mixed precision (``autocast=``: bfloat16, float16 with a gradient scaler per stage) and gradient accumulation
(``accumulate=n``), held to float32 and to reference computations, the same in every runtime."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ppll_compile
from ppll_compile import PPLLError
from tests.helpers import assert_same_parameters, compiled_residual, image_batches, sgd, stage_state, train_residual
from tests.models import Residual, conv_student, conv_teacher

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

pytestmark = pytest.mark.usefixtures("one_thread_quietly")

LOSS_RTOL = 2e-3
"""How close a reduced-precision run's losses stay to float32's over 5 steps of the Residual pipeline (measured on
this CPU: bfloat16 within 4.4e-4 relative, float16 within 1.5e-4)."""


def _losses(dtype: torch.dtype | None, data: list, **options) -> tuple[object, list[float]]:
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd, autocast=dtype, **options) as trainer:
        losses = [loss for x, y in data for ls in trainer.step(x, y) for loss in ls]
    return compiled, losses


def _output_dtypes(compiled) -> list[torch.dtype]:
    """Hooks on every conv and linear layer of every stage; the dtypes of their outputs, recorded as they run."""
    seen: list[torch.dtype] = []
    for stage in compiled.stages:
        for m in stage.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


# ---- autocast -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stages_compute_in_the_autocast_dtype_and_track_float32(dtype):
    data = image_batches(5)
    _, ref = _losses(None, data)
    compiled = compiled_residual()
    seen = _output_dtypes(compiled)
    with compiled.trainer(optimizer=sgd, autocast=dtype) as trainer:
        losses = [loss for x, y in data for ls in trainer.step(x, y) for loss in ls]
        assert seen and set(seen) == {dtype}  # every conv and linear layer of both stages
        scalers = [r.scaler for r in trainer.runners]
    assert len(losses) == len(ref) == 10
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=LOSS_RTOL, atol=0)
    if dtype == torch.float16:  # one scaler per stage, of the stage's device type
        assert all(isinstance(s, torch.amp.GradScaler) for s in scalers) and scalers[0] is not scalers[1]
        assert all(s.get_scale() == 65536.0 for s in scalers)
    else:
        assert scalers == [None, None]


def test_float32_computes_in_float32():
    compiled = compiled_residual()
    seen = _output_dtypes(compiled)
    with compiled.trainer(optimizer=sgd) as trainer:
        trainer.step(*image_batches(1)[0])
        assert [r.scaler for r in trainer.runners] == [None, None]
    assert set(seen) == {torch.float32}


def test_a_step_the_scaler_skips_leaves_parameters_and_schedulers():
    compiled = compiled_residual()
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
    (x, y), (x2, y2) = image_batches(2)
    with compiled.trainer(optimizer=sgd, scheduler=sched, autocast=torch.float16) as trainer:
        for r in trainer.runners:
            r.scaler.load_state_dict(r.scaler.state_dict() | {"scale": 2.0 ** 100})  # float16 gradients overflow
        before = stage_state(compiled)
        trainer.step(x, y)
        for p, q in zip(stage_state(compiled), before, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert [r.scheduler.get_last_lr() for r in trainer.runners] == [[0.05], [0.05]]
        assert [r.scaler.get_scale() for r in trainer.runners] == [2.0 ** 99] * 2  # backed off
        for r in trainer.runners:
            r.scaler.update(new_scale=1024.0)
        trainer.step(x2, y2)
        assert [r.scheduler.get_last_lr() for r in trainer.runners] == [[0.025], [0.025]]
        assert trainer.updates == {0: 2, 1: 2}


def test_the_scale_is_in_the_checkpoint_and_older_checkpoints_load(tmp_path):
    data = image_batches(3)
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd, autocast=torch.float16) as trainer:
        for x, y in data:
            trainer.step(x, y)
        trainer.runners[0].scaler.update(new_scale=1024.0)
        trainer.save(tmp_path / "fp16")
    saved = stage_state(compiled)
    again = compiled_residual(seed=1)
    with again.trainer(optimizer=sgd, autocast=torch.float16) as trainer:
        trainer.load(tmp_path / "fp16")
        assert [r.scaler.get_scale() for r in trainer.runners] == [1024.0, 65536.0]
    for p, q in zip(stage_state(again), saved, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    plain = compiled_residual()
    with plain.trainer(optimizer=sgd) as trainer:  # no scaler: its checkpoint has none
        trainer.step(*data[0])
        trainer.save(tmp_path / "fp32")
    with compiled_residual(seed=1).trainer(optimizer=sgd, autocast=torch.float16) as trainer:
        trainer.load(tmp_path / "fp32")
        assert [r.scaler.get_scale() for r in trainer.runners] == [65536.0, 65536.0]


@pytest.mark.cuda
@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_float16_on_a_gpu(runtime):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    data = [(x.cuda(), y.cuda()) for x, y in image_batches(5)]
    runs = {}
    for dtype in (None, torch.float16):
        torch.manual_seed(0)
        compiled = ppll_compile.compile(Residual(), example_inputs=(data[0][0],), split_points=["add"],
                                        devices=["cuda:0", "cuda:0"])
        seen = _output_dtypes(compiled)
        with compiled.trainer(optimizer=sgd, runtime=runtime, autocast=dtype) as trainer:
            losses = [loss for x, y in data for ls in trainer.step(x, y) for loss in ls]
            losses += [loss for ls in trainer.finish() for loss in ls]
            scalers = [r.scaler for r in trainer.runners]
        runs[dtype] = sorted(losses)
        assert set(seen) == {dtype or torch.float32}
    assert all(isinstance(s, torch.amp.GradScaler) and s.get_scale() == 65536.0 for s in scalers)
    torch.testing.assert_close(torch.tensor(runs[torch.float16]), torch.tensor(runs[None]), rtol=LOSS_RTOL, atol=0)


# ---- accumulate ---------------------------------------------------------------------------------------------

def test_accumulation_is_local_learning_by_hand():
    """Every stage: each loss scaled by 1/n, gradients added over n batches, one step; a partial group at the end of
    the data steps on its mean (gradients times n/k)."""
    data = image_batches(7, last=5)
    compiled, _ = train_residual("sequential", data, accumulate=3)
    ref = compiled_residual()
    opts = [sgd(ref.stage_parameters(i)) for i in range(2)]
    for k, (x, y) in enumerate(data):
        if k % 3 == 0:
            for o in opts:
                o.zero_grad(set_to_none=True)
        h = ref.stages[0](x)
        (ref.heads[0].loss(h[0], y) * (1 / 3)).backward()
        (F.cross_entropy(ref.stages[1](*(v.detach() for v in h)), y) * (1 / 3)).backward()
        if k % 3 == 2 or k == len(data) - 1:
            held = k % 3 + 1
            for i, o in enumerate(opts):
                if held < 3:
                    for p in ref.stage_parameters(i):
                        p.grad.mul_(3 / held)
                o.step()
    assert_same_parameters(compiled, ref)


def test_accumulated_step_equals_one_step_on_the_concatenated_batch():
    """The last stage (no batch norm): 3 accumulated batches of 8 == one step on the 24 examples together."""
    data = image_batches(3)
    compiled = compiled_residual()
    ref = compiled_residual()
    with compiled.trainer(optimizer=sgd, accumulate=3) as trainer:
        for x, y in data:
            trainer.step(x, y)
        assert trainer.steps == {0: 3, 1: 3} and trainer.updates == {0: 1, 1: 1}
    x, y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    opt = sgd(ref.stage_parameters(1))
    F.cross_entropy(ref.stages[1](*(v.detach() for v in ref.stages[0](x))), y).backward()
    opt.step()
    moved = [(p - q).abs().max() for p, q in zip(compiled.stage_parameters(1), compiled_residual().stage_parameters(1))]
    assert min(moved) > 1e-4  # it trained
    for p, q in zip(compiled.stage_parameters(1), ref.stage_parameters(1), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_threads_accumulate_like_sequential():
    data = image_batches(7, last=5)
    seq, seq_losses = train_residual("sequential", data, accumulate=3)
    thr, thr_losses = train_residual("threads", data, accumulate=3)
    assert_same_parameters(seq, thr)
    assert thr_losses == seq_losses
    one, _ = train_residual("sequential", data)
    assert any((p - q).abs().max() > 1e-4 for p, q in zip(stage_state(one), stage_state(seq)))


def test_fit_steps_a_partial_group_at_the_end_of_every_epoch():
    data = image_batches(5)
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd, accumulate=2) as trainer:
        trainer.fit(data, epochs=2, progress=False)
        assert trainer.steps == {0: 10, 1: 10} and trainer.updates == {0: 6, 1: 6}  # 2 + 2 + 1 per epoch
    ref, _ = train_residual("sequential", data + data, accumulate=2)  # groups across the epochs: 5 updates
    assert any((p - q).abs().max() > 0 for p, q in zip(stage_state(ref), stage_state(compiled)))
    by_epoch = compiled_residual()
    with by_epoch.trainer(optimizer=sgd, accumulate=2) as trainer:
        for _ in range(2):
            for x, y in data:
                trainer.step(x, y)
            trainer.finish()
    assert_same_parameters(by_epoch, compiled)


def test_a_save_inside_an_accumulation_group_is_refused(tmp_path):
    data = image_batches(4)
    compiled = compiled_residual()
    with compiled.trainer(optimizer=sgd, accumulate=2) as trainer:
        for x, y in data[:3]:
            trainer.step(x, y)
        with pytest.raises(PPLLError, match=re.escape(
                "save() would lose the gradients every stage holds for 1 batch(es) of an accumulation group "
                "(accumulate=2; 3 batches fed); save after a multiple of 2 batches, or call trainer.finish() first "
                "to step on the partial group")):
            trainer.save(tmp_path)
        assert not (tmp_path / "latest").exists() and trainer.updates == {0: 1, 1: 1}
        trainer.step(*data[3])
        trainer.save(tmp_path)  # 4 batches: a whole group
        trainer.step(*data[0])
        trainer.finish()  # steps the partial group: a save is at a boundary again
        trainer.save(tmp_path)
        assert trainer.updates == {0: 3, 1: 3}


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_accumulate_must_be_a_positive_integer(value):
    with pytest.raises(PPLLError, match=re.escape(
            f"accumulate must be an integer >= 1 (the batches whose gradients every stage adds up before one "
            f"optimizer step; 1: a step per batch), got {value!r}")):
        compiled_residual().trainer(optimizer=sgd, accumulate=value)


def test_accumulate_refuses_moving_cuts():
    compiled = compiled_residual()
    with pytest.raises(PPLLError, match=re.escape("rebalance=True moves cuts between two batches, which would split "
                                                  "an accumulation group (accumulate=2)")):
        compiled.trainer(optimizer=sgd, runtime="threads", accumulate=2, rebalance=True)
    with compiled.trainer(optimizer=sgd, accumulate=2) as trainer:
        cuts = [c for c in trainer.plan.legal_cuts if c not in trainer.plan.cuts]
        with pytest.raises(PPLLError, match=re.escape("this trainer cannot move cuts: a moved cut would split an "
                                                      "accumulation group (accumulate=2)")):
            trainer.replan(cuts[:1])


def test_accumulate_refuses_pipebd_plans():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    compiled = ppll_compile.compile(conv_student(), 2, teacher=conv_teacher(), example_inputs=(x,))
    with pytest.raises(PPLLError, match=re.escape("accumulate=2 applies to ppll plans; a pipebd plan's blocks step "
                                                  "once per batch")):
        compiled.trainer(optimizer=sgd, accumulate=2)

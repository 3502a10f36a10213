"""Pipe-BD: block alignment, distillation losses, placement with replicas, and the one-process runtimes."""

import math
import re
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ppll_compile
from ppll_compile import CutError, Plan, PolicyError, StageError
from ppll_compile.cli.command import main
from ppll_compile.pipebd.policy import distill_loss, load_distill_policy
from tests.helpers import (
    DISTILL_STUDENT_ENDS,
    DISTILL_TEACHER_ENDS,
    DISTILL_X,
    distill_batches,
    distill_compiled,
    distill_pair,
    distill_reference,
    distill_slices,
    sgd,
)
from tests.models import conv_student


pytestmark = pytest.mark.usefixtures("one_thread_quietly")


# ---- alignment ----------------------------------------------------------------------------------------

def test_blocks_align_at_the_ends_of_equal_shape_runs():
    p = distill_compiled().plan
    assert p.mode == "pipebd" and p.teacher == "Sequential" and len(p.blocks) == 4
    assert [b.teacher_module for b in p.blocks] == ["3", "7", "11", "14"]
    assert [b.student_module for b in p.blocks] == ["1", "5", "7", "10"]
    assert [b.output.shape for b in p.blocks] == [(8, 8, 16, 16), (8, 16, 8, 8), (8, 32, 4, 4), (8, 10)]
    # the pooled and flattened boundaries have no student parameters before them: merged into the last block
    assert any("no parameters; merged" in n for n in p.notes)
    assert [s.blocks for s in p.stages] == [(0, 1), (2, 3)]
    assert p.stages[0].boundary == (p.blocks[1].output,)


def test_named_blocks_choose_the_boundaries():
    teacher, student = distill_pair()
    p = ppll_compile.plan(student, teacher=teacher, example_inputs=(DISTILL_X,), gpus=1, replicas=False,
                          blocks=[("7", "5")])
    assert [(b.teacher_module, b.student_module) for b in p.blocks] == [("7", "5"), ("14", "10")]


def test_named_blocks_of_other_shapes_list_the_candidates():
    teacher, student = distill_pair()
    with pytest.raises(CutError) as info:
        ppll_compile.plan(student, teacher=teacher, example_inputs=(DISTILL_X,), gpus=2, blocks=[("3", "5")])
    text = str(info.value)
    assert text.startswith("blocks[0]: the teacher's output at '3' has shape [8, 8, 16, 16] but the student's at "
                           "'5' has [8, 16, 8, 8]; a student block learns the teacher's output, so the shapes must "
                           "agree. Candidate boundaries with their shapes:\n  teacher: _3 [8, 8, 16, 16], _5 "
                           "[8, 24, 16, 16], _7 [8, 16, 8, 8]")
    assert "\n  student: _1 [8, 8, 16, 16], _3 [8, 12, 16, 16], _5 [8, 16, 8, 8]" in text


def test_models_without_a_common_boundary_are_refused_with_both_sides():
    teacher = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    student = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 4))
    with pytest.raises(CutError, match=re.escape(
            "the teacher and the student share no boundary shape, so they cannot be cut into aligned blocks. "
            "Candidate boundaries with their shapes:\n  teacher: _1 [2, 6]\n  student: _1 [2, 5]\n"
            "Name the block ends with blocks=[(teacher_module, student_module), ...]")):
        ppll_compile.plan(student, teacher=teacher, example_inputs=(torch.randn(2, 8),), gpus=2)


def test_outputs_of_other_shapes_are_refused():
    teacher = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    student = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    with pytest.raises(CutError, match=re.escape("the teacher returns shape [2, 4] but the student [2, 3]")):
        ppll_compile.plan(student, teacher=teacher, example_inputs=(torch.randn(2, 8),), gpus=2)


def test_mode_and_teacher_must_agree():
    teacher, student = distill_pair()
    with pytest.raises(TypeError, match=re.escape("mode='pipebd' distils the model from a teacher: pass teacher=")):
        ppll_compile.plan(student, 2, mode="pipebd", example_inputs=(DISTILL_X,))
    with pytest.raises(ValueError, match=re.escape("a teacher is only used by mode='pipebd'")):
        ppll_compile.plan(student, 2, teacher=teacher, mode="ppll", example_inputs=(DISTILL_X,))
    with pytest.raises(ValueError, match=re.escape("blocks= aligns a teacher with a student")):
        ppll_compile.plan(student, 2, blocks=[("3", "1")], example_inputs=(DISTILL_X,))


# ---- lowering ----------------------------------------------------------------------------------------

def test_blocks_are_transparent_and_share_the_students_parameters():
    teacher, student = distill_pair()
    c = ppll_compile.compile(student, teacher=teacher, example_inputs=(DISTILL_X,), gpus=2)
    with torch.no_grad():
        torch.testing.assert_close(c(DISTILL_X), student(DISTILL_X), rtol=0, atol=0)
        values = (DISTILL_X,)
        for block in c.teacher_blocks:
            values = block(*values)
        torch.testing.assert_close(values, teacher(DISTILL_X), rtol=0, atol=0)
    ours = {id(p) for k in range(len(c.student_blocks)) for p in c.student_blocks[k].parameters()}
    assert ours == {id(p) for p in student.parameters()}
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


# ---- the loss policy ----------------------------------------------------------------------------------

def test_kl_loss_is_temperature_scaled_kl_divergence():
    s, t = torch.randn(6, 5), torch.randn(6, 5)
    expected = (F.softmax(t / 4, 1) * (F.log_softmax(t / 4, 1) - F.log_softmax(s / 4, 1))).sum() / 6 * 16
    loss = distill_loss(load_distill_policy("kl").last)
    torch.testing.assert_close(loss(s, t), expected)
    assert distill_loss(load_distill_policy("mse").last)(s, t) == F.mse_loss(s, t)


def _by_hand(s: torch.Tensor, t: torch.Tensor) -> tuple[float, float, float]:
    """Soft-target cross-entropy, KL divergence and the teacher's entropy at T=1, row by row in float64."""
    ce = kl = h = 0.0
    for srow, trow in zip(s.double().tolist(), t.double().tolist()):
        zs = math.log(sum(math.exp(v) for v in srow))
        zt = math.log(sum(math.exp(v) for v in trow))
        for a, b in zip(srow, trow):
            p = math.exp(b - zt)
            ce -= p * (a - zs)
            kl += p * ((b - zt) - (a - zs))
            h -= p * (b - zt)
    return ce / len(s), kl / len(s), h / len(s)


def test_pipebds_last_block_loss_is_soft_target_cross_entropy_and_kl_at_t1_differs_by_a_constant():
    s, t = torch.randn(6, 5, requires_grad=True), torch.randn(6, 5)
    ce, kl, entropy = _by_hand(s.detach(), t)
    rules = load_distill_policy("pipebd")
    assert rules.loss == {"type": "mse"} and rules.last == {"type": "soft_ce", "temperature": 1.0}
    soft_ce = distill_loss(rules.last)(s, t)
    assert soft_ce.item() == pytest.approx(ce, rel=1e-6)
    torch.testing.assert_close(soft_ce, -(F.softmax(t, -1) * F.log_softmax(s, -1)).sum(-1).mean())  # Pipe-BD's code
    kl_t1 = distill_loss({"type": "kl", "temperature": 1.0})(s, t)
    assert kl_t1.item() == pytest.approx(kl, rel=1e-6)
    assert (soft_ce - kl_t1).item() == pytest.approx(entropy, rel=1e-6)  # KL + the teacher's entropy
    grads = [torch.autograd.grad(loss, s)[0] for loss in (soft_ce, kl_t1)]
    torch.testing.assert_close(grads[0], grads[1])  # the same training signal for the student


@pytest.mark.parametrize("temperature", [3.0, 0.5])
def test_soft_ce_and_kl_at_a_temperature_are_scaled_by_its_square(temperature):
    """Hinton's (and Pipe-BD's) scaling: the softened distributions' KL divergence times T**2; soft_ce adds the
    softened teacher's entropy, also times T**2, so both give the student the same gradient at any T."""
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 5, generator=g, requires_grad=True), torch.randn(6, 5, generator=g) * 3
    ce, kl, entropy = _by_hand(s.detach() / temperature, t / temperature)
    soft_ce = distill_loss({"type": "soft_ce", "temperature": temperature})(s, t)
    kl_t = distill_loss({"type": "kl", "temperature": temperature})(s, t)
    assert kl_t.item() == pytest.approx(kl * temperature ** 2, rel=1e-6)
    assert soft_ce.item() == pytest.approx((kl + entropy) * temperature ** 2, rel=1e-6)
    assert soft_ce.item() == pytest.approx(ce * temperature ** 2, rel=1e-6)
    grads = [torch.autograd.grad(loss, s)[0] for loss in (soft_ce, kl_t)]
    torch.testing.assert_close(grads[0], grads[1])


def test_the_default_policy_is_pipebds_own_for_logits_and_mse_otherwise():
    p = distill_compiled().plan
    assert p.policy == "pipebd"
    assert [b.loss for b in p.blocks] == [{"type": "mse"}] * 3 + [{"type": "soft_ce", "temperature": 1.0}]
    assert p.stages[1].head.config == {"type": "mse+soft_ce"}
    teacher, student = distill_pair()  # the models up to their last feature map: no logits
    p = ppll_compile.plan(student[:8], teacher=teacher[:12], example_inputs=(DISTILL_X,), split_points=["5"])
    assert p.policy == "mse" and [b.loss for b in p.blocks] == [{"type": "mse"}] * 3
    assert "policy auto: the models return shape [8, 32, 4, 4], not N x C logits, so the last block learns under " \
           "mse like the others (policy 'mse'); Pipe-BD's soft-target cross-entropy needs logits" in p.notes
    with pytest.raises(PolicyError, match=re.escape(
            "policy 'pipebd' compares the last block's outputs with soft_ce, which needs N x C logits; the models "
            "return shape [8, 32, 4, 4] (use policy='mse')")):
        ppll_compile.plan(student[:8], teacher=teacher[:12], example_inputs=(DISTILL_X,), policy="pipebd",
                          split_points=["5"])


def test_the_kl_policy_puts_kl_on_the_last_block_only():
    p = distill_compiled(policy="kl").plan
    assert [b.loss for b in p.blocks] == [{"type": "mse"}] * 3 + [{"type": "kl", "temperature": 4.0}]
    assert p.policy == "kl" and p.stages[1].head.config == {"type": "mse+kl"}


@pytest.mark.parametrize("policy,message", [
    ({"loss": {"type": "l1"}}, "distillation policy: loss.type is 'l1'; known distillation losses: mse, smooth_l1, kl, "
                               "soft_ce"),
    ({"loss": {"type": "kl"}}, "distillation policy: loss.type kl compares class logits and fits only the last block"),
    ({"loss": {"type": "soft_ce"}}, "distillation policy: loss.type soft_ce compares class logits and fits only the "
                                    "last block; use mse or smooth_l1 for 'loss' and put soft_ce under 'last'"),
    ({"last": {"type": "kl", "tau": 2}}, "distillation policy: last has unknown option(s) ['tau']; kl takes "
                                         "['temperature']"),
    ({"last": {"type": "kl", "temperature": 0}}, "distillation policy: last.temperature must be a positive number"),
    ({"heads": {}}, "distillation policy: not a distillation policy: a mapping of 1 key with neither 'loss' nor "
                    "'last' and keys other than name, description, loss and last; pass a shipped name (kl, mse, "
                    "pipebd) or a distillation policy file"),
    ({"last": {"type": "kl"}, "heads": {}}, "distillation policy: unknown key(s) ['heads']; a distillation policy "
                                            "has name, description, loss and last"),
    ("nope", "unknown distillation policy 'nope': not a shipped one (kl, mse, pipebd) nor a file"),
])
def test_bad_policies_say_what_is_wrong(policy, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        load_distill_policy(policy)


def test_a_policy_file_is_read(tmp_path):
    path = tmp_path / "huber.yaml"
    path.write_text("loss: {type: smooth_l1, beta: 0.5}\nlast: {type: mse}\n")
    rules = load_distill_policy(str(path))
    assert rules.loss == {"type": "smooth_l1", "beta": 0.5} and rules.last == {"type": "mse"}


# ---- placement ----------------------------------------------------------------------------------------

def test_replicas_fixed_per_stage_and_stage_ends_by_hand():
    p = distill_compiled(replicas=(2, 1)).plan
    assert [s.replicas for s in p.stages] == [2, 1] and p.world_size == 3 and p.partitioner == "manual"
    free = distill_compiled(split_points=None, replicas=(1, 2)).plan  # the partitioner groups the blocks
    assert [s.replicas for s in free.stages] == [1, 2] and len(free.stages) == 2
    with pytest.raises(CutError, match=re.escape("split_points: '3' is not where a block ends; a pipebd stage ends "
                                                 "at a block end: '_1', '_5', '_7'")):
        distill_compiled(split_points=["3"])


def test_the_chosen_layout_is_optimal_for_the_plans_own_costs():
    from ppll_compile.partitioners.replicas import ReplicaProblem, brute_force_replicated
    p = distill_compiled(split_points=None, gpus=4, profile="flops", flops_per_second=1e9, link_bandwidth=1e12).plan
    problem = ReplicaProblem(compute=[b.cost for b in p.blocks], devices=4, allreduce_bandwidth=1e12,
                             comm=[b.output.bytes / 1e12 for b in p.blocks[:-1]] + [0.0],
                             grad_bytes=[b.grad_bytes for b in p.blocks], memory=[b.memory_bytes for b in p.blocks])
    assert p.bottleneck_cost == pytest.approx(brute_force_replicated(problem).bottleneck, rel=1e-12)


def test_a_saved_plan_is_reapplied(tmp_path):
    p = distill_compiled(replicas=(1, 2), policy="kl").plan
    path = p.save(tmp_path / "plan.json")
    assert Plan.load(path) == p
    teacher, student = distill_pair()
    again = ppll_compile.plan(student, teacher=teacher, example_inputs=(DISTILL_X,), plan=path)
    assert [s.blocks for s in again.stages] == [s.blocks for s in p.stages]
    assert [s.replicas for s in again.stages] == [1, 2] and [b.loss for b in again.blocks] == [b.loss for b in p.blocks]


def test_ppll_plans_take_replicas_too():
    torch.manual_seed(0)
    student = conv_student()
    p = ppll_compile.plan(student, example_inputs=(DISTILL_X,), split_points=["5"], replicas=(2, 1))
    assert [s.replicas for s in p.stages] == [2, 1] and p.world_size == 3
    assert p.stages[0].comm_cost == pytest.approx(p.stages[0].boundary[0].bytes / p.link_bandwidth / 2)
    with pytest.raises(ValueError, match=re.escape("with split_points the stages are fixed: give their replicas as "
                                                   "a tuple")):
        ppll_compile.plan(student, example_inputs=(DISTILL_X,), split_points=["5"], replicas=True)
    with pytest.raises(ValueError, match=re.escape("replicated stages split the batch evenly over identical devices")):
        ppll_compile.plan(student, 2, example_inputs=(DISTILL_X,), replicas=True, device_speeds=[1, 2])


# ---- training -----------------------------------------------------------------------------------------


def test_reuse_queue_trains_a_later_stage_again_while_it_waits():
    c = distill_compiled()
    slow = c.student_blocks[0]
    forward = slow.forward
    slow.forward = lambda *v: (time.sleep(0.05), forward(*v))[1]
    batches = distill_batches(6)
    with c.trainer(optimizer=sgd, runtime="threads", queue="reuse") as trainer:
        for x in batches:
            trainer.step(x)
    assert trainer.reused[0] == 0 and 0 < trainer.reused[1] <= len(batches)
    assert trainer.steps == {0: len(batches), 1: len(batches) + trainer.reused[1]}


def test_evaluate_gives_each_blocks_mean_loss():
    teacher, student = distill_pair()
    c = ppll_compile.compile(student, teacher=teacher, example_inputs=(DISTILL_X,), split_points=["5"])
    data = [(x, torch.zeros(len(x), dtype=torch.long)) for x in distill_batches(2, seed=3, last=5)]
    with c.trainer(optimizer=sgd, runtime="threads") as trainer:
        result = trainer.evaluate(data)
    t_blocks, s_blocks = distill_slices(teacher, DISTILL_TEACHER_ENDS), distill_slices(student, DISTILL_STUDENT_ENDS)
    x = torch.cat([x for x, _ in data])
    expected = []
    with torch.no_grad():
        for k, (tb, sb) in enumerate(zip(t_blocks, s_blocks)):
            y = tb(x)  # the last block under the default policy (pipebd): the soft-target cross-entropy
            expected.append(float(F.mse_loss(sb(x), y) if k < 3 else -(F.softmax(y, 1) * F.log_softmax(sb(x), 1))
                                  .sum(1).mean()))
            x = y
    assert result["samples"] == 13
    assert result["block_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["loss"] == pytest.approx(sum(expected), rel=1e-5)


def test_checkpoints_resume_across_runtimes(tmp_path):
    batches = distill_batches(6)
    c = distill_compiled()
    with c.trainer(optimizer=sgd, runtime="threads") as trainer:
        for x in batches[:3]:
            trainer.step(x)
        trainer.save(tmp_path / "ckpt")
    c2 = distill_compiled()
    with c2.trainer(optimizer=sgd, runtime="dna") as trainer:
        trainer.load(tmp_path / "ckpt")
        for x in batches[3:]:
            trainer.step(x)
    for ours, ref in zip(c2.model.parameters(), distill_reference(batches)):
        torch.testing.assert_close(ours.detach(), ref)


def test_a_failing_block_names_its_stage():
    c = distill_compiled()
    block = c.student_blocks[2]
    block.forward = lambda *v: (_ for _ in ()).throw(RuntimeError("student broke"))
    with pytest.raises(StageError) as info, c.trainer(optimizer=sgd, runtime="threads") as trainer:
        for x in distill_batches(3):
            trainer.step(x)
        trainer.finish()
    assert str(info.value).startswith("stage 1 failed at batch 0: RuntimeError: student broke")


def test_trainer_options_that_do_not_fit_distillation_are_refused():
    c = distill_compiled()
    with pytest.raises(ValueError, match=re.escape("a pipebd plan trains on the distillation losses of its policy; "
                                                   "drop loss=")):
        c.trainer(optimizer=sgd, loss=F.cross_entropy)
    for runtime in ("dna", "dna-per-block"):
        with pytest.raises(ValueError, match=re.escape('decoupled=False (a barrier of all the stages before every '
                                                       'optimizer step) applies to the pipelined runtimes')):
            c.trainer(optimizer=sgd, runtime=runtime, decoupled=False)
    ppll = ppll_compile.compile(conv_student(), 2, example_inputs=(DISTILL_X,))
    with pytest.raises(ValueError, match=re.escape("runtime='dna' is not known; choose one of sequential, threads, "
                                                   "distributed")):
        ppll.trainer(optimizer=sgd, runtime="dna")


# ---- the command line ---------------------------------------------------------------------------------

def test_ppll_plan_shows_a_pipebd_plan(tmp_path, capsys):
    path = tmp_path / "pair.py"
    path.write_text(textwrap.dedent("""
        import torch
        from tests.models import conv_student, conv_teacher
        build_model, build_teacher = conv_student, conv_teacher
        def example_inputs():
            return torch.randn(8, 3, 16, 16)
    """))
    assert main([str(path), "--mode", "pipebd", "--replicas", "1,2", "--policy", "kl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PIPEBD plan for Sequential from teacher Sequential (4 blocks): 2 stages on 3 devices")
    assert "teacher ends at" in out and "cpu x2" in out and "mse+kl" in out
    assert main([str(path), "--gpus", "2", "--blocks", "7:5"]) == 2
    assert "--blocks aligns a teacher with a student; add --mode pipebd" in capsys.readouterr().err

"""Online rebalancing: a cut moved between batches keeps the FIFO computation, the user's parameters and their
optimizer state; a balanced plan stays; bad options and bad moves are refused with the way out."""

import math

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import CutError, PPLLError, Trainer
from ppll_compile.pipeline import CompiledPipeline
from tests.helpers import (
    Chain,
    REBALANCE_BATCH,
    REBALANCE_IN,
    rebalance_compiled,
    rebalance_data,
    rebalance_sgd,
    rebalance_step_lr,
)


pytestmark = pytest.mark.usefixtures("one_thread_quietly")


# ---- what a move keeps ---------------------------------------------------------------------------
def test_a_move_keeps_the_users_parameters_and_their_optimizer_state():
    compiled = rebalance_compiled()
    model = compiled.model
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731 - two state tensors and a step per parameter
    with compiled.trainer(optimizer=adam, scheduler=rebalance_step_lr) as t:
        for x, y in rebalance_data(3):
            t.step(x, y)
        moving = list(model.blocks[1].parameters())  # the last block of stage 0, stage 1's first after the move
        before = {id(p): {k: v.clone() for k, v in t.runners[0].optimizer.state[p].items()} for p in moving}
        lr, epoch = t.runners[0].optimizer.param_groups[0]["lr"], t.runners[0].scheduler.last_epoch
        old_runner2, old_head0, old_head1 = t.runners[2], compiled.heads[0], compiled.heads[1]
        plan = t.move_cut(0, "add")
        assert plan is t.plan is compiled.plan and plan.cuts == ("add", "add_2")
        assert any(n.startswith("rebalanced before batch 3 (asked): moved the cut after 'add_1' to 'add'")
                   for n in plan.notes)
        # every stage parameter is the user's own object, each in exactly one stage
        owned = [id(p) for st in compiled.stages for p in st.parameters()]
        assert sorted(owned) == sorted(id(p) for p in model.parameters())
        assert {id(p) for p in moving} <= {id(p) for p in compiled.stages[1].parameters()}
        # the moved parameters' Adam state went with them; learning rate, scheduler and counters stayed
        after = t.runners[1].optimizer
        for p in moving:
            assert set(after.state[p]) == set(before[id(p)])
            for k, v in before[id(p)].items():
                torch.testing.assert_close(after.state[p][k], v, rtol=0, atol=0)
        assert t.runners[0].optimizer.param_groups[0]["lr"] == lr and t.runners[0].scheduler.last_epoch == epoch
        assert t.runners[1].optimizer.param_groups[0]["lr"] == lr and [r.steps for r in t.runners] == [3, 3, 3]
        # the stage whose cuts stayed, and the head at the cut that stayed, are the very same objects
        assert t.runners[2] is old_runner2 and compiled.heads[1] is old_head1
        assert compiled.heads[0] is not None and compiled.heads[0] is not old_head0
        # training goes on in place, and the pipeline still computes the model
        w = model.blocks[1].lin.weight.detach().clone()
        for x, y in rebalance_data(2, seed=5):
            t.step(x, y)
        assert not torch.equal(w, model.blocks[1].lin.weight)
    compiled.eval()
    x = torch.randn(REBALANCE_BATCH, REBALANCE_IN)
    torch.testing.assert_close(compiled(x), model(x))


def test_a_rebalanced_run_resumes_from_its_plan_and_checkpoint(tmp_path):
    compiled = rebalance_compiled()
    with compiled.trainer(optimizer=rebalance_sgd, runtime="threads") as t:
        for x, y in rebalance_data(3):
            t.step(x, y)
        t.move_cut(0, "add")
        for x, y in rebalance_data(2, seed=3):
            t.step(x, y)
        t.save(tmp_path)
        plan = t.plan
        saved = [p.detach().clone() for j in range(3) for p in t.stage_parameters(j)]
    again = rebalance_compiled(split_points=None, plan=plan, seed=9)  # the new plan re-applied to a fresh model
    assert again.plan.cuts == ("add", "add_2")
    with again.trainer(optimizer=rebalance_sgd) as t:
        t.load(tmp_path)
        assert t.batches == 5
        for a, b in zip(saved, [p for j in range(3) for p in t.stage_parameters(j)], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- when to move ------------------------------------------------------------------------------
def _linear_head(spec, num_classes):
    """A head much cheaper than a block, so that the blocks alone set the stage times."""
    return nn.Linear(spec.shape[-1], num_classes)


def test_a_measured_imbalance_is_moved_once_by_fit():
    # stage 0: the input layer and 3 of 4 equal blocks, stage 1: the last one, about 3x faster; the cut moves one
    # block left (two blocks each: a third faster), then no neighbouring move helps (one stage would get 3): the
    # checks stop. The blocks are wide enough (512, batch 128) for their work to outweigh every step's fixed costs
    # (loss, optimizer, Python): at width 256 and batch 64 the estimated gain was about the threshold
    compiled = rebalance_compiled(2, ("add_2",), model=Chain(d=512, p=0.0), policy=_linear_head)
    batch = 128
    data = rebalance_data(24, batch=batch)
    with compiled.trainer(optimizer=rebalance_sgd, runtime="threads", rebalance=True, rebalance_steps=8,
                          rebalance_policy=_linear_head) as t:
        history = t.fit(data, progress=False)
        assert [(m.batch, m.new_cuts) for m in t.rebalances] == [(8, ("add_1",))], (t.rebalances, t.stage_times)
        m = t.rebalances[0]
        assert m.times[0] > 1.5 * m.times[1] and max(m.estimated) < 0.9 * m.times[0], m
        assert len(t.stage_times) == 2 and all(r.step_times is None for r in t.runners)  # checked at 16, then stopped
        assert t.steps == {0: 24, 1: 24}
    assert history[0]["samples"] == 24 * batch and all(v is not None for v in history[0]["loss"])


def test_a_balanced_plan_is_not_moved():
    # the exact partitioner balanced the plan for its predicted costs; measured times that agree with them leave no
    # neighbouring move that makes the slowest stage faster, even at threshold 0
    compiled = rebalance_compiled(3, None, model=Chain(depth=5), flops_per_second=1e9)
    plan = compiled.plan
    with compiled.trainer(optimizer=rebalance_sgd, runtime="threads", rebalance=True, rebalance_steps=2,
                          rebalance_threshold=0.0) as t:
        for x, y in rebalance_data(2):
            t.step(x, y)
        t.finish()
        for r, s in zip(t.runners, plan.stages):
            r.step_times[:] = [s.compute_cost * 7.0]
        for x, y in rebalance_data(4, seed=2):
            t.step(x, y)
        assert t.rebalances == [] and t.plan is plan and compiled.plan is plan
        assert t.stage_times == tuple(s.compute_cost * 7.0 for s in plan.stages)
        assert all(r.step_times is None for r in t.runners)


def test_a_measured_gain_under_the_threshold_is_not_taken():
    compiled = rebalance_compiled()
    with compiled.trainer(optimizer=rebalance_sgd, rebalance=True, rebalance_steps=2, rebalance_threshold=0.9) as t:
        for x, y in rebalance_data(2):
            t.step(x, y)
        for r, seconds in zip(t.runners, [3e-3, 1e-3, 1e-3]):
            r.step_times[:] = [seconds]
        t.step(*rebalance_data(1)[0])
        assert t.rebalances == [] and t.plan.cuts == ("add_1", "add_2") and t.stage_times == (3e-3, 1e-3, 1e-3)


def test_rebalance_needs_the_compiled_pipeline():
    compiled = rebalance_compiled()
    with pytest.raises(ValueError, match=r"build the trainer with compiled.trainer\(..., rebalance=True\)"):
        Trainer(compiled.plan, compiled.lowered, optimizer=rebalance_sgd, rebalance=True)
    with Trainer(compiled.plan, compiled.lowered, optimizer=rebalance_sgd) as t:
        with pytest.raises(PPLLError, match=r"cannot move cuts: it was not built by a compiled pipeline; use "
                                            r"compiled.trainer"):
            t.move_cut(0, "add")


def test_a_pipebd_plan_is_not_rebalanced():
    from tests.models import conv_student, conv_teacher

    torch.manual_seed(0)
    compiled = ppll_compile.compile(conv_student(), 2, teacher=conv_teacher(), profile="flops", devices=["cpu", "cpu"],
                                    example_inputs=(torch.randn(4, 3, 16, 16),))
    with pytest.raises(ValueError, match="rebalance=True moves the cuts of a ppll plan; a pipebd plan's stages"):
        compiled.trainer(optimizer=rebalance_sgd, rebalance=True)
    with compiled.trainer(optimizer=rebalance_sgd) as t:
        with pytest.raises(PPLLError, match="cannot move cuts: a pipebd plan's stages are distillation blocks"):
            t.replan(list(compiled.plan.cuts))


def test_bad_moves_are_refused():
    compiled = rebalance_compiled()
    with compiled.trainer(optimizer=rebalance_sgd) as t:
        with pytest.raises(ValueError, match=r"stage must be the index of a stage followed by a cut, 0..1"):
            t.move_cut(2, "add")
        with pytest.raises(CutError, match=r"'blocks' is not a legal cut of the plan; its legal cuts, in graph "
                                           r"order: 'inp', 'relu', 'add', 'add_1', 'add_2', 'add_3'"):
            t.move_cut(0, "blocks")
        with pytest.raises(CutError, match=r"not in graph order, or name a cut twice"):
            t.move_cut(0, "add_3")
        with pytest.raises(ValueError, match=r"split_points lists 1 cut\(s\), but the plan has 3 stages, so 2 cut"):
            t.replan(["add"])
        assert t.replan(["add_1", "add_2"]) is compiled.plan and t.rebalances == []  # no move asked


def test_a_callable_policy_is_kept_for_new_heads():
    def policy(spec, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(spec.shape[1:]), num_classes))

    compiled = rebalance_compiled(policy=policy)
    by_hand = CompiledPipeline(model=compiled.model, graph_module=compiled.graph_module, plan=compiled.plan,
                               lowered=compiled.lowered, front=compiled.front)  # the policy not given
    with pytest.raises(PPLLError, match=r"from the plan's policy '.*policy', which cannot be loaded by that name .*"
                                        r"pass rebalance_policy=<the policy the pipeline was compiled with"):
        by_hand.trainer(optimizer=rebalance_sgd, rebalance=True)
    with pytest.raises(PPLLError, match=r"this pipeline's cuts cannot move: it was not made by ppll_compile.compile"):
        CompiledPipeline(model=compiled.model, graph_module=compiled.graph_module, plan=compiled.plan,
                         lowered=compiled.lowered, policy=policy).trainer(optimizer=rebalance_sgd, rebalance=True)
    with compiled.trainer(optimizer=rebalance_sgd, rebalance=True) as t:  # compile() kept the callable
        t.step(*rebalance_data(1)[0])
        t.move_cut(0, "add")
        assert isinstance(compiled.heads[0][1], nn.Linear) and t.plan.cuts == ("add", "add_2")

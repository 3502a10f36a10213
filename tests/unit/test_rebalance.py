"""Online rebalancing: a cut moved between batches keeps the FIFO computation, the user's parameters and their
optimizer state; a balanced plan stays; bad options and bad moves are refused with the way out."""

import math

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile import CutError, PPLLError, Trainer
from ppll_compile.pipeline import CompiledPipeline

BATCH = 16
IN = 12

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


class Block(nn.Module):
    """A residual block with dropout: the legal cuts of :class:`Chain` lie between blocks."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(torch.relu(self.lin(x)))


class Chain(nn.Module):
    """input layer, ``depth`` residual blocks, classifier; legal cuts 'inp', 'relu', then 'add', 'add_1', ... after each
    block."""

    def __init__(self, d: int = 16, depth: int = 4, classes: int = 5, p: float = 0.2):
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(depth))
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _compiled(gpus: int = 3, split_points=("add_1", "add_2"), seed: int = 0, model=None, **options):
    torch.manual_seed(seed)
    model = model or Chain()
    options = {"split_points": list(split_points)} | options if split_points is not None else options
    return ppll_compile.compile(model, gpus, example_inputs=(torch.randn(BATCH, IN),), profile="flops",
                                devices=["cpu"] * gpus, **options)


def _data(n: int, seed: int = 1, batch: int = BATCH, width: int = IN):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _state(trainer):
    """Every trained tensor (stage, head) and every optimizer-state tensor, by stage, in order."""
    out = []
    for j in range(trainer.plan.num_stages):
        r = trainer.runners[j]
        for p in trainer.stage_parameters(j):
            out.append(p.detach().clone())
            for v in r.optimizer.state.get(p, {}).values():
                out.append(v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
        out.append(torch.tensor([g["lr"] for g in r.optimizer.param_groups]))
        out.append(torch.tensor(float(r.scheduler.last_epoch)))
    return out


# ---- the same computation ----------------------------------------------------------------------
def test_threads_rebalanced_by_measurement_equals_sequential_moved_by_hand():
    data = _data(6)  # the next check would come before batch 6
    # threads: measured over 3 steps, then stage 0 "measures" 3x the others (injected): the check before batch 3
    # moves the cut after stage 0 one legal cut left ('add_1' -> 'add')
    threads = _compiled()
    with threads.trainer(optimizer=_sgd, scheduler=_step_lr, runtime="threads", rebalance=True, rebalance_steps=3,
                         rebalance_threshold=0.0) as t:
        for x, y in data[:3]:
            t.step(x, y)
        t.finish()
        for r, seconds in zip(t.runners, [3e-3, 1e-3, 1e-3]):
            r.step_times[:] = [seconds]
        for x, y in data[3:]:
            t.step(x, y)
        t.finish()
        moves, got, plan = t.rebalances, _state(t), t.plan
    # sequential: the same move, asked for before the same batch
    sequential = _compiled()
    with sequential.trainer(optimizer=_sgd, scheduler=_step_lr) as s:
        for x, y in data[:3]:
            s.step(x, y)
        s.move_cut(0, "add")
        for x, y in data[3:]:
            s.step(x, y)
        want = _state(s)
        assert s.rebalances[0].batch == 3 and s.rebalances[0].times is None
    assert [(m.batch, m.old_cuts, m.new_cuts) for m in moves] == [(3, ("add_1", "add_2"), ("add", "add_2"))]
    assert moves[0].times == (3e-3, 1e-3, 1e-3) and len(moves[0].estimated) == 3
    assert plan.cuts == sequential.plan.cuts == ("add", "add_2") and threads.plan is plan
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    for p, q in zip(threads.model.parameters(), sequential.model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


# ---- what a move keeps ---------------------------------------------------------------------------
def test_a_move_keeps_the_users_parameters_and_their_optimizer_state():
    compiled = _compiled()
    model = compiled.model
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731 - two state tensors and a step per parameter
    with compiled.trainer(optimizer=adam, scheduler=_step_lr) as t:
        for x, y in _data(3):
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
        for x, y in _data(2, seed=5):
            t.step(x, y)
        assert not torch.equal(w, model.blocks[1].lin.weight)
    compiled.eval()
    x = torch.randn(BATCH, IN)
    torch.testing.assert_close(compiled(x), model(x))


def test_the_head_at_a_new_cut_is_seeded_so_runs_agree():
    heads = []
    for _ in range(2):
        compiled = _compiled()
        torch.manual_seed(123 + len(heads))  # whatever the caller's generator holds
        with compiled.trainer(optimizer=_sgd) as t:
            t.step(*_data(1)[0])
            t.move_cut(1, "add_3")
            heads.append([p.detach().clone() for p in compiled.heads[1].parameters()])
    for a, b in zip(*heads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_rebalanced_run_resumes_from_its_plan_and_checkpoint(tmp_path):
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd, runtime="threads") as t:
        for x, y in _data(3):
            t.step(x, y)
        t.move_cut(0, "add")
        for x, y in _data(2, seed=3):
            t.step(x, y)
        t.save(tmp_path)
        plan = t.plan
        saved = [p.detach().clone() for j in range(3) for p in t.stage_parameters(j)]
    again = _compiled(split_points=None, plan=plan, seed=9)  # the new plan re-applied to a fresh model
    assert again.plan.cuts == ("add", "add_2")
    with again.trainer(optimizer=_sgd) as t:
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
    compiled = _compiled(2, ("add_2",), model=Chain(d=512, p=0.0), policy=_linear_head)
    batch = 128
    data = _data(24, batch=batch)
    with compiled.trainer(optimizer=_sgd, runtime="threads", rebalance=True, rebalance_steps=8,
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
    compiled = _compiled(3, None, model=Chain(depth=5), flops_per_second=1e9)
    plan = compiled.plan
    with compiled.trainer(optimizer=_sgd, runtime="threads", rebalance=True, rebalance_steps=2,
                          rebalance_threshold=0.0) as t:
        for x, y in _data(2):
            t.step(x, y)
        t.finish()
        for r, s in zip(t.runners, plan.stages):
            r.step_times[:] = [s.compute_cost * 7.0]
        for x, y in _data(4, seed=2):
            t.step(x, y)
        assert t.rebalances == [] and t.plan is plan and compiled.plan is plan
        assert t.stage_times == tuple(s.compute_cost * 7.0 for s in plan.stages)
        assert all(r.step_times is None for r in t.runners)


def test_a_measured_gain_under_the_threshold_is_not_taken():
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd, rebalance=True, rebalance_steps=2, rebalance_threshold=0.9) as t:
        for x, y in _data(2):
            t.step(x, y)
        for r, seconds in zip(t.runners, [3e-3, 1e-3, 1e-3]):
            r.step_times[:] = [seconds]
        t.step(*_data(1)[0])
        assert t.rebalances == [] and t.plan.cuts == ("add_1", "add_2") and t.stage_times == (3e-3, 1e-3, 1e-3)


# ---- refused, with the way out -----------------------------------------------------------------
@pytest.mark.parametrize("options,error,message", [
    ({"rebalance": "yes"}, TypeError, "rebalance must be True or False"),
    ({"rebalance": True, "rebalance_steps": 0}, ValueError, "rebalance_steps must be an integer >= 1"),
    ({"rebalance": True, "rebalance_steps": 2.5}, ValueError, "rebalance_steps must be an integer >= 1"),
    ({"rebalance": True, "rebalance_steps": True}, ValueError, "rebalance_steps must be an integer >= 1"),
    ({"rebalance": True, "rebalance_threshold": -0.1}, ValueError, r"rebalance_threshold must be a fraction in \[0, 1"),
    ({"rebalance": True, "rebalance_threshold": 1.0}, ValueError, r"rebalance_threshold must be a fraction in \[0, 1"),
    ({"rebalance": True, "rebalance_threshold": math.nan}, ValueError, "rebalance_threshold must be a fraction"),
    ({"rebalance": True, "rebalance_threshold": "10%"}, ValueError, "rebalance_threshold must be a fraction"),
    ({"rebalance_steps": 5}, ValueError, r"rebalance_steps=5 applies to rebalancing; pass rebalance=True too"),
    ({"rebalance": True, "runtime": "distributed"}, ValueError,
     r"under runtime='distributed' every stage is another process. Measure and rebalance with runtime='threads'.*"
     r"trainer.plan.save\('plan.yaml'\).*plan='plan.yaml' for torchrun"),
])
def test_rebalance_options_are_checked(options, error, message):
    compiled = _compiled()
    with pytest.raises(error, match=message):
        compiled.trainer(optimizer=_sgd, **options)
    compiled.trainer(optimizer=_sgd).close()  # nothing was left open


def test_rebalance_needs_the_compiled_pipeline():
    compiled = _compiled()
    with pytest.raises(ValueError, match=r"build the trainer with compiled.trainer\(..., rebalance=True\)"):
        Trainer(compiled.plan, compiled.lowered, optimizer=_sgd, rebalance=True)
    with Trainer(compiled.plan, compiled.lowered, optimizer=_sgd) as t:
        with pytest.raises(PPLLError, match=r"cannot move cuts: it was not built by a compiled pipeline; use "
                                            r"compiled.trainer"):
            t.move_cut(0, "add")


def test_a_pipebd_plan_is_not_rebalanced():
    from tests.models import conv_student, conv_teacher

    torch.manual_seed(0)
    compiled = ppll_compile.compile(conv_student(), 2, teacher=conv_teacher(), profile="flops", devices=["cpu", "cpu"],
                                    example_inputs=(torch.randn(4, 3, 16, 16),))
    with pytest.raises(ValueError, match="rebalance=True moves the cuts of a ppll plan; a pipebd plan's stages"):
        compiled.trainer(optimizer=_sgd, rebalance=True)
    with compiled.trainer(optimizer=_sgd) as t:
        with pytest.raises(PPLLError, match="cannot move cuts: a pipebd plan's stages are distillation blocks"):
            t.replan(list(compiled.plan.cuts))


def test_bad_moves_are_refused():
    compiled = _compiled()
    with compiled.trainer(optimizer=_sgd) as t:
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

    compiled = _compiled(policy=policy)
    by_hand = CompiledPipeline(model=compiled.model, graph_module=compiled.graph_module, plan=compiled.plan,
                               lowered=compiled.lowered, front=compiled.front)  # the policy not given
    with pytest.raises(PPLLError, match=r"from the plan's policy '.*policy', which cannot be loaded by that name .*"
                                        r"pass rebalance_policy=<the policy the pipeline was compiled with"):
        by_hand.trainer(optimizer=_sgd, rebalance=True)
    with pytest.raises(PPLLError, match=r"this pipeline's cuts cannot move: it was not made by ppll_compile.compile"):
        CompiledPipeline(model=compiled.model, graph_module=compiled.graph_module, plan=compiled.plan,
                         lowered=compiled.lowered, policy=policy).trainer(optimizer=_sgd, rebalance=True)
    with compiled.trainer(optimizer=_sgd, rebalance=True) as t:  # compile() kept the callable
        t.step(*_data(1)[0])
        t.move_cut(0, "add")
        assert isinstance(compiled.heads[0][1], nn.Linear) and t.plan.cuts == ("add", "add_2")
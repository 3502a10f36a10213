"""Online rebalancing: a cut moved between batches keeps the FIFO computation, the user's parameters and their
optimizer state; a balanced plan stays; bad options and bad moves are refused with the way out."""

import math

import pytest
import torch

from tests.helpers import rebalance_compiled, rebalance_data, rebalance_sgd, rebalance_step_lr


pytestmark = pytest.mark.usefixtures("one_thread_quietly")


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
    data = rebalance_data(6)  # the next check would come before batch 6
    # threads: measured over 3 steps, then stage 0 "measures" 3x the others (injected): the check before batch 3
    # moves the cut after stage 0 one legal cut left ('add_1' -> 'add')
    threads = rebalance_compiled()
    with threads.trainer(optimizer=rebalance_sgd, scheduler=rebalance_step_lr, runtime="threads", rebalance=True,
                         rebalance_steps=3,
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
    sequential = rebalance_compiled()
    with sequential.trainer(optimizer=rebalance_sgd, scheduler=rebalance_step_lr) as s:
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


def test_the_head_at_a_new_cut_is_seeded_so_runs_agree():
    heads = []
    for _ in range(2):
        compiled = rebalance_compiled()
        torch.manual_seed(123 + len(heads))  # whatever the caller's generator holds
        with compiled.trainer(optimizer=rebalance_sgd) as t:
            t.step(*rebalance_data(1)[0])
            t.move_cut(1, "add_3")
            heads.append([p.detach().clone() for p in compiled.heads[1].parameters()])
    for a, b in zip(*heads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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
    compiled = rebalance_compiled()
    with pytest.raises(error, match=message):
        compiled.trainer(optimizer=rebalance_sgd, **options)
    compiled.trainer(optimizer=rebalance_sgd).close()  # nothing was left open

"""What a pipeline must share to load a checkpoint or to run across ranks: the model class in a checkpoint's identity,
every head in the cross-rank plan check."""

import dataclasses

import pytest
import torch

import ppll_compile
from ppll_compile import CheckpointError
from ppll_compile.runtime.distributed.group import plan_identity, plan_mismatch
from tests import ckpt_worker as w
from tests.helpers import sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


class Twin(w.Residual):
    """The same layers and shapes as :class:`Residual`, under another class name: another model."""


def _compiled(model_class: type, cuts: list[str] | None = None) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(0)
    return ppll_compile.compile(model_class(c=16), 2, example_inputs=(torch.randn(w.BATCH, 3, 8, 8),), policy="dgl",
                                split_points=cuts)


def test_a_checkpoint_of_another_model_class_with_the_same_shapes_is_refused(tmp_path):
    saved = _compiled(w.Residual)
    with saved.trainer(optimizer=sgd) as trainer:
        trainer.step(*w.batch(0))
        trainer.save(tmp_path)
    twin = _compiled(Twin, list(saved.plan.cuts))
    assert twin.plan.cuts == saved.plan.cuts and twin.plan.model != saved.plan.model
    assert [[p.shape for p in twin.stage_parameters(i)] for i in range(2)] == \
        [[p.shape for p in saved.stage_parameters(i)] for i in range(2)]
    before = w.parameters(twin)
    with twin.trainer(optimizer=sgd) as other:
        with pytest.raises(CheckpointError) as info:
            other.load(tmp_path)
        assert other.batches == 0
    assert all(torch.equal(p, q) for p, q in zip(before, w.parameters(twin), strict=True))
    assert str(info.value) == (
        f"checkpoint {str(tmp_path / 'ckpt-000000')!r} was saved for another pipeline: model: checkpoint has "
        f"{saved.plan.model!r}, this pipeline has {twin.plan.model!r}. Compile the same model with the plan it was "
        f"trained with (compile(model, plan=...)) to load it.")
    with _compiled(w.Residual, list(saved.plan.cuts)).trainer(optimizer=sgd) as same:
        same.load(tmp_path)  # the model it was saved for loads it
        assert same.batches == 1


def test_plans_that_differ_only_in_a_head_are_refused_across_ranks():
    plan = _compiled(w.Residual).plan
    stage = plan.stages[0]
    head = dataclasses.replace(stage.head, config={**stage.head.config, "depth": stage.head.config["depth"] + 1})
    other = dataclasses.replace(plan, stages=(dataclasses.replace(stage, head=head), *plan.stages[1:]))
    assert other.cuts == plan.cuts and [s.replicas for s in other.stages] == [s.replicas for s in plan.stages]
    assert plan_mismatch([plan_identity(plan), plan_identity(plan)]) is None
    assert plan_mismatch([plan_identity(plan), plan_identity(other)]) == (
        f"the processes compiled different plans: rank 0 cuts after {list(plan.cuts)}, rank 1 after "
        f"{list(plan.cuts)} (and other heads or replicas). Plan once (e.g. plan.save('plan.json') on one process) "
        f"and compile with plan='plan.json' on every rank")


def test_plans_with_other_cuts_are_refused_across_ranks_naming_both():
    plan = _compiled(w.Residual).plan
    legal = list(plan.legal_cuts)
    moved = next(c for c in legal if c != plan.cuts[0])
    other = _compiled(w.Residual, [moved]).plan
    assert plan_mismatch([plan_identity(plan), plan_identity(plan), plan_identity(other)]) == (
        f"the processes compiled different plans: rank 0 cuts after {list(plan.cuts)}, rank 2 after [{moved!r}]. "
        f"Plan once (e.g. plan.save('plan.json') on one process) and compile with plan='plan.json' on every rank")

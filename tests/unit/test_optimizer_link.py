"""The optimizer the trainer builds is compared with the one the plan costed: a mismatch warns once, naming both, each
stage's optimizer-state memory against the plan's, and the way out."""

import warnings

import torch

import ppll_compile
from tests.models import Residual


def _compiled(optimizer: str):
    torch.manual_seed(0)
    return ppll_compile.compile(Residual(), 2, example_inputs=(torch.randn(8, 3, 8, 8),), profile="flops",
                                devices=["cpu", "cpu"], optimizer=optimizer)


def _warnings(compiled, factory, **options) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.trainer(optimizer=factory, **options).close()
    return [w for w in caught if "optimizer" in str(w.message)]


def test_momentum_on_a_plan_for_plain_sgd_warns_once_with_the_memory_per_stage():
    compiled = _compiled("sgd")
    assert [s.grad_bytes for s in compiled.plan.stages] == [10240, 180]  # the stage state sizes below
    caught = _warnings(compiled, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), runtime="threads")
    assert [str(w.message) for w in caught] == [
        "the trainer builds SGD with momentum 0.9, which keeps 1 state tensor per parameter (optimizer='momentum' in a "
        "plan), but the plan costs optimizer='sgd' (0 per parameter): stage 0's optimizer state is 10.0 KiB, not 0 B "
        "as planned; stage 1's optimizer state is 180 B, not 0 B as planned. Plan with optimizer='momentum' "
        "(ppll_compile.compile(model, ..., optimizer='momentum')) so that its memory and step costs count this state"]
    assert caught[0].category is UserWarning and caught[0].filename == __file__  # points at the trainer(...) call


def test_adamw_on_a_plan_for_momentum_names_both_and_the_way_out():
    caught = _warnings(_compiled("momentum"), lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert [str(w.message) for w in caught] == [
        "the trainer builds AdamW, which keeps 2 state tensors per parameter (optimizer='adam' in a plan), but the "
        "plan costs optimizer='momentum' (1 per parameter): stage 0's optimizer state is 20.0 KiB, not 10.0 KiB as "
        "planned; stage 1's optimizer state is 360 B, not 180 B as planned. Plan with optimizer='adam' "
        "(ppll_compile.compile(model, ..., optimizer='adam')) so that its memory and step costs count this state"]


def test_plain_sgd_on_a_plan_for_adam_says_the_state_is_smaller():
    caught = _warnings(_compiled("adam"), lambda p: torch.optim.SGD(p, lr=0.1))
    assert [str(w.message) for w in caught] == [
        "the trainer builds SGD without momentum, which keeps 0 state tensors per parameter (optimizer='sgd' in a "
        "plan), but the plan costs optimizer='adam' (2 per parameter): stage 0's optimizer state is 0 B, not 20.0 KiB "
        "as planned; stage 1's optimizer state is 0 B, not 360 B as planned. Plan with optimizer='sgd' "
        "(ppll_compile.compile(model, ..., optimizer='sgd')) so that its memory and step costs count this state"]


def test_an_optimizer_of_unknown_state_is_not_guessed():
    compiled = _compiled("sgd")
    assert _warnings(compiled, lambda p: torch.optim.LBFGS(p)) == []
    assert len(_warnings(compiled, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5))) == 1

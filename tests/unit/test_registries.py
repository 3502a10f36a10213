"""The head-type registry and the optimizer table: every entry builds, measures and keeps what it declares; a type
registered from outside the package reaches policies, planning and the runtime; unknown names list the known ones."""

import math

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.cost.optimizers import OPTIMIZERS, kind_of, optimizer_spec, states_of
from ppll_compile.cost.roofline import step_ops
from ppll_compile.errors import PolicyError
from ppll_compile.heads.build import build_head, head_spec
from ppll_compile.heads.modules import AuxHead, head_loss
from ppll_compile.heads.policy import load_policy, validate_policy
from ppll_compile.heads.schema import integer
from ppll_compile.heads.types import (
    BUILT_IN,
    HeadType,
    head_type,
    head_type_names,
    register_head_type,
    unregister_head_type,
)
from ppll_compile.lower.profile import make_optimizer
from ppll_compile.plans.plan import TensorSpec
from tests.models import Residual

SHAPES = {"feature_map": (4, 16, 8, 8), "channels_last": (4, 8, 8, 16), "sequence": (4, 9, 64), "vector": (4, 32)}
INPUT_SHAPE = (4, 3, 16, 16)
KNOWN = "conv, infopro, lm, lm_output, mlp, momentum, token, transformer"


def _spec(kind: str) -> TensorSpec:
    shape = SHAPES[kind]
    return TensorSpec(name="h", shape=shape, dtype="float32", bytes=4 * math.prod(shape),
                      layout="channels_last" if kind == "channels_last" else "")


# ---- head types ---------------------------------------------------------------------------------------

def test_the_built_in_types_are_the_registry():
    assert head_type_names() == tuple(sorted(BUILT_IN)) == tuple(KNOWN.split(", "))


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_head_type_builds_trains_and_measures_on_every_kind_it_reads(name):
    t = head_type(name)
    for kind in t.kinds:
        spec = _spec(kind)
        torch.manual_seed(0)
        head = build_head({"type": name}, spec, 7, INPUT_SHAPE, per_token=t.per_token)
        assert isinstance(head, AuxHead) and head.needs_input is t.needs_input
        h = torch.randn(spec.shape, requires_grad=True)
        y = torch.randint(0, 7, spec.shape[:2] if t.per_token else spec.shape[:1])
        out = head(h)
        assert tuple(out.shape) == ((*spec.shape[:2], 7) if t.per_token else (spec.shape[0], 7))
        head_loss(head, h, y, torch.rand(INPUT_SHAPE) if t.needs_input else None).backward()
        trained = list(head.parameters())
        assert trained and all(p.grad is not None for p in trained)
        measured = head_spec(load_policy("auto"), {"type": name}, spec, 7, INPUT_SHAPE, "sgd", per_token=t.per_token)
        assert measured.param_count == sum(p.numel() for p in trained)
        assert measured.flops_fwd > 0 and measured.flops_bwd > 0
        assert measured.config["type"] == name


class _Seeing(AuxHead):
    """A pool-and-linear head whose loss keeps every raw input it is given (``None`` when none)."""

    def __init__(self, channels: int, classes: int, loss) -> None:
        super().__init__(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)), loss)
        self.seen: list = []

    def loss(self, h, target, input=None):
        self.seen.append(None if input is None else input.detach().clone())
        return super().loss(h, target)


@pytest.fixture(params=[True, False], ids=["needs-input", "stands-alone"])
def seeing(request):
    t = register_head_type(HeadType(name="seeing", kinds=("feature_map",), options={"unused": integer(0)},
                                    needs_input=request.param,
                                    build=lambda r: _Seeing(r.shape[1], r.num_classes, r.loss)))
    try:
        yield t
    finally:
        unregister_head_type("seeing")
    assert "seeing" not in head_type_names()


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_a_registered_head_type_is_planned_from_a_policy_dict_and_gets_what_it_needs(seeing, runtime):
    policy = validate_policy({"name": "seeing", "heads": {"feature_map": {"type": "seeing"}}}, "a dict")
    assert policy.heads["feature_map"] == {"type": "seeing", "unused": 0}
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Residual(), 3, example_inputs=(torch.randn(4, 3, 8, 8),), profile="flops",
                                    devices=["cpu"] * 3, policy=policy)
    assert [s.head.config["type"] for s in compiled.plan.stages] == ["seeing", "seeing", "model"]
    assert all(s.head.param_count == 8 * 5 + 5 for s in compiled.plan.stages[:2])
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(3)]
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime=runtime) as trainer:
        trainer.fit(data, progress=False)
    for head in compiled.heads[:2]:  # stage 1's input crossed stage 0, carried along only when the head needs it
        assert isinstance(head, _Seeing)
        if seeing.needs_input:
            assert len(head.seen) == len(data) and None not in head.seen
            for got, (x, _) in zip(head.seen, data):
                torch.testing.assert_close(got, x, rtol=0, atol=0)
        else:
            assert head.seen == [None] * len(data)
        assert head.needs_input is seeing.needs_input


def test_an_unknown_head_type_lists_the_known_ones():
    with pytest.raises(PolicyError) as e:
        head_type("nope")
    assert str(e.value) == (f"unknown head type 'nope'; known head types: {KNOWN} (or register one with "
                            f"ppll_compile.heads.types.register_head_type)")
    with pytest.raises(PolicyError) as e:
        validate_policy({"heads": {"feature_map": {"type": "nope"}}}, "p.yaml")
    assert str(e.value) == f"p.yaml: heads.feature_map.type must be one of {KNOWN}, got 'nope'"
    with pytest.raises(PolicyError) as e:
        build_head({"type": "nope"}, _spec("vector"), 3)
    assert str(e.value) == f"head config: type must be one of {KNOWN}, got 'nope'"


def test_a_head_type_name_is_registered_once(seeing):
    assert f"one of {KNOWN.replace('momentum, ', 'momentum, seeing, ')}," in _type_error()
    with pytest.raises(PolicyError) as e:
        register_head_type(seeing)
    assert str(e.value) == ("head type 'seeing' is registered already; pick another name, or pass replace=True to "
                            "replace it")
    with pytest.raises(PolicyError) as e:
        register_head_type(HeadType(name="callable", kinds=("vector",), options={}, build=seeing.build))
    assert str(e.value) == ("head type name 'callable' is reserved (a policy callable's heads, the last stage's own "
                            "output); pick another name")


def _type_error() -> str:
    with pytest.raises(PolicyError) as e:
        validate_policy({"heads": {"vector": {"type": 1}}}, "p.yaml")
    return str(e.value)


# ---- optimizer kinds ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_kind_keeps_the_state_it_declares(name):
    spec = optimizer_spec(name)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
    opt = make_optimizer(name, params, torch.device("cpu"))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    kept = [sum(isinstance(v, torch.Tensor) and v.shape == p.shape for v in opt.state[p].values()) for p in params]
    assert kept == [spec.states] * len(params)
    assert states_of(opt) == spec.states and kind_of(opt) == name
    assert [op.bytes for op in step_ops([100], name)] == [100 * (2 * spec.states + 3)]


def test_an_optimizer_the_table_does_not_hold_is_recognised_by_its_state():
    params = [nn.Parameter(torch.zeros(2))]
    assert kind_of(torch.optim.AdamW(params)) == "adam"
    amsgrad = torch.optim.Adam(params, amsgrad=True)
    assert kind_of(amsgrad) == "adam" and states_of(amsgrad) == 3
    assert kind_of(torch.optim.Adagrad(params)) == "momentum"
    assert kind_of(torch.optim.LBFGS(params)) is None


def test_an_unknown_optimizer_kind_lists_the_known_ones():
    unknown = "unknown optimizer kind 'lamb'; known kinds: sgd, momentum, adam (pass one of them as optimizer=)"
    with pytest.raises(ValueError) as e:
        optimizer_spec("lamb")
    assert str(e.value) == unknown
    with pytest.raises(ValueError) as e:
        step_ops([8], "lamb")
    assert str(e.value) == unknown
    with pytest.raises(ValueError) as e:
        make_optimizer("lamb", [], torch.device("cpu"))
    assert str(e.value) == ("optimizer must be one of sgd, momentum, adam or a factory fn(params) -> Optimizer, "
                            "got 'lamb'")

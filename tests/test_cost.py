"""Measured costs equal their closed forms."""

import pytest
import torch
from torch import nn

from ppll_compile.cost import META_KEY, measure_graph, measure_module
from ppll_compile.trace import trace


def _costs(model, *inputs):
    gm = trace(model, example_inputs=inputs)
    measure_graph(gm, inputs)
    return {n.name: n.meta[META_KEY] for n in gm.graph.nodes if n.op != "output"}, gm


def test_linear_flops_closed_form():
    b, i, o = 8, 32, 16
    model = nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, 4))
    costs, _ = _costs(model, torch.randn(b, i))
    assert costs["_0"].flops_fwd == 2 * b * i * o
    assert costs["_0"].flops_bwd == 2 * b * i * o  # weight gradient only: the input needs none
    assert costs["_2"].flops_fwd == 2 * b * o * 4
    assert costs["_2"].flops_bwd == 2 * 2 * b * o * 4  # weight and input gradients
    assert costs["_0"].params == {"0.weight": i * o, "0.bias": o}


def test_conv_flops_closed_form():
    b, cin, cout, h, w, k = 4, 3, 8, 10, 12, 3
    model = nn.Sequential(nn.Conv2d(cin, cout, k, padding=1), nn.Conv2d(cout, cout, k, stride=2, padding=1))
    costs, _ = _costs(model, torch.randn(b, cin, h, w))
    assert costs["_0"].flops_fwd == 2 * b * cout * h * w * cin * k * k
    assert costs["_1"].flops_fwd == 2 * b * cout * (h // 2) * (w // 2) * cout * k * k
    assert costs["_1"].flops_bwd == 2 * costs["_1"].flops_fwd


def test_depthwise_conv_backward_costs_twice_its_forward():
    # the weight gradient of a grouped conv sums over as many products as its forward (torch counts it dense)
    b, c, h, w, k = 4, 16, 8, 8, 3
    model = nn.Sequential(nn.Conv2d(3, c, 1), nn.Conv2d(c, c, k, padding=1, groups=c))
    costs, _ = _costs(model, torch.randn(b, 3, h, w))
    assert costs["_1"].flops_fwd == 2 * b * c * h * w * k * k
    assert costs["_1"].flops_bwd == 2 * costs["_1"].flops_fwd


def test_saved_activations_of_a_conv_bn_relu_block_count_each_storage_once():
    b, c, h, w = 2, 4, 6, 6
    model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                          nn.Conv2d(c, c, 3, padding=1))
    x = torch.randn(b, 3, h, w)
    costs, _ = _costs(model, x)
    saved: dict[str, int] = {}
    for cost in costs.values():
        for k, v in cost.saved.items():
            saved[k] = max(saved.get(k, 0), v)
    fmap = b * c * h * w * 4
    # conv input x; conv output (saved by BN); BN output, overwritten in place by ReLU and read by conv 2;
    # BN's per-channel mean and inverse std
    assert saved.pop("input_1") == x.numel() * 4  # nn.Sequential names its input `input`
    assert saved.pop("_0") == fmap
    assert saved.pop("_1") == fmap
    assert sorted(saved.values()) == [c * 4, c * 4]


def test_measuring_changes_nothing_on_the_model():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _costs(model, torch.randn(2, 3, 8, 8))
    assert not model.training and not any(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_attention_flops_include_the_attention_kernel():
    b, seq, e, heads = 2, 10, 32, 4
    mha = nn.MultiheadAttention(e, heads, batch_first=True)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    costs, _ = _costs(Wrap(), torch.randn(b, seq, e))
    projections = 2 * b * seq * e * (3 * e) + 2 * b * seq * e * e
    attention = 2 * (2 * b * seq * seq * e)  # QK^T and AV
    assert costs["attn"].flops_fwd == projections + attention


def test_native_attention_formula_matches_the_training_path():
    """The eval fast path (_native_multi_head_attention) is counted like the training path."""
    from torch.utils.flop_counter import FlopCounterMode

    from ppll_compile.cost import _flop_counter
    b, seq, e = 2, 10, 32
    mha = nn.MultiheadAttention(e, 4, batch_first=True).eval()
    x = torch.randn(b, seq, e)
    with torch.no_grad(), _flop_counter() as fast:
        mha(x, x, x, need_weights=False)
    with FlopCounterMode(display=False) as plain, torch.no_grad():
        mha(x, x, x, need_weights=False)
    assert plain.get_total_flops() == 0 or plain.get_total_flops() < fast.get_total_flops()
    projections = 2 * b * seq * e * (3 * e) + 2 * b * seq * e * e
    assert fast.get_total_flops() == projections + 2 * (2 * b * seq * seq * e)


def test_measure_module_on_meta():
    with torch.device("meta"):
        lin = nn.Linear(16, 4)
        x = torch.empty(8, 16)
    cost = measure_module(lin, lambda: lin(x))
    assert (cost.flops_fwd, cost.flops_bwd, cost.param_count) == (2 * 8 * 16 * 4, 2 * 8 * 16 * 4, 16 * 4 + 4)
    assert cost.activation_bytes == 8 * 16 * 4


@pytest.mark.parametrize("name", ["residual", "masked", "resnet18", "mobilenet_v2", "vit"])
def test_repeated_nodes_reuse_exactly_what_running_them_measures(name, monkeypatch):
    # a node that repeats an earlier one replays its measurement; running every node afresh gives the same
    import torchvision

    from ppll_compile import cost
    from tests.models import Masked, Residual

    torch.manual_seed(0)
    model, inputs = {
        "residual": lambda: (Residual(), (torch.randn(2, 3, 8, 8),)),
        "masked": lambda: (Masked(depth=4), (torch.randn(2, 5, 8), torch.ones(2, 5))),
        "resnet18": lambda: (torchvision.models.resnet18(), (torch.randn(2, 3, 64, 64),)),
        "mobilenet_v2": lambda: (torchvision.models.mobilenet_v2(), (torch.randn(2, 3, 64, 64),)),
        "vit": lambda: (torchvision.models.VisionTransformer(32, 8, 4, 2, 32, 64), (torch.randn(2, 3, 32, 32),)),
    }[name]()
    reused, _ = _costs(model, *inputs)
    monkeypatch.setattr(cost._Measure, "_signature", lambda self, *a: None)  # measure every node
    monkeypatch.setattr(cost._FakeState, "needs_all", lambda self, values: True)  # every parameter fake at once
    fresh, _ = _costs(model, *inputs)
    assert reused == fresh

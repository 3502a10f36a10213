"""Measured costs equal their closed forms."""

import warnings
import torch
from torch import nn

import ppll_compile
from ppll_compile.cost.modules import measure_module
from tests.helpers import measured_costs


def test_linear_flops_closed_form():
    b, i, o = 8, 32, 16
    model = nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, 4))
    costs, _ = measured_costs(model, torch.randn(b, i))
    assert costs["_0"].flops_fwd == 2 * b * i * o
    assert costs["_0"].flops_bwd == 2 * b * i * o  # weight gradient only: the input needs none
    assert costs["_2"].flops_fwd == 2 * b * o * 4
    assert costs["_2"].flops_bwd == 2 * 2 * b * o * 4  # weight and input gradients
    assert costs["_0"].params == {"0.weight": i * o, "0.bias": o}


def test_conv_flops_closed_form():
    b, cin, cout, h, w, k = 4, 3, 8, 10, 12, 3
    model = nn.Sequential(nn.Conv2d(cin, cout, k, padding=1), nn.Conv2d(cout, cout, k, stride=2, padding=1))
    costs, _ = measured_costs(model, torch.randn(b, cin, h, w))
    assert costs["_0"].flops_fwd == 2 * b * cout * h * w * cin * k * k
    assert costs["_1"].flops_fwd == 2 * b * cout * (h // 2) * (w // 2) * cout * k * k
    assert costs["_1"].flops_bwd == 2 * costs["_1"].flops_fwd


def test_conv_backward_counts_an_input_gradient_only_where_the_input_needs_one():
    b, cin, c1, c2, h, w, k = 4, 3, 8, 6, 10, 12, 3
    model = nn.Sequential(nn.Conv2d(cin, c1, k, padding=1), nn.Conv2d(c1, c2, k, stride=2, padding=1, groups=2))
    costs, _ = measured_costs(model, torch.randn(b, cin, h, w))
    # as torch's conv_flop_count: 2 x batch x weight elements (out x in / groups x kh x kw) x output positions
    first = 2 * b * (c1 * cin * k * k) * (h * w)
    second = 2 * b * (c2 * (c1 // 2) * k * k) * ((h // 2) * (w // 2))
    assert (costs["_0"].flops_fwd, costs["_0"].flops_bwd) == (first, first)  # the model's input needs no gradient
    assert (costs["_1"].flops_fwd, costs["_1"].flops_bwd) == (second, 2 * second)  # input and weight gradients


def test_depthwise_conv_backward_costs_twice_its_forward():
    # the weight gradient of a grouped conv sums over as many products as its forward (torch counts it dense)
    b, c, h, w, k = 4, 16, 8, 8, 3
    model = nn.Sequential(nn.Conv2d(3, c, 1), nn.Conv2d(c, c, k, padding=1, groups=c))
    costs, _ = measured_costs(model, torch.randn(b, 3, h, w))
    assert costs["_1"].flops_fwd == 2 * b * c * h * w * k * k
    assert costs["_1"].flops_bwd == 2 * costs["_1"].flops_fwd


def test_saved_activations_of_a_conv_bn_relu_block_count_each_storage_once():
    b, c, h, w = 2, 4, 6, 6
    model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                          nn.Conv2d(c, c, 3, padding=1))
    x = torch.randn(b, 3, h, w)
    costs, _ = measured_costs(model, x)
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


def test_stage_activation_bytes_count_a_storage_saved_by_several_nodes_once():
    b, cin, c, h, w, d = 2, 3, 4, 6, 6, 8
    model = nn.Sequential(nn.Conv2d(cin, c, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(),
                          nn.Linear(c * h * w, d), nn.ReLU(), nn.Linear(d, 5))
    x = torch.randn(b, cin, h, w)
    costs, _ = measured_costs(model, x)
    # the conv's output, overwritten by the in-place ReLU and viewed by Flatten, is saved by the ReLU and the Linear
    assert costs["_1"].saved.keys() == costs["_3"].saved.keys() == {"_0"}
    # the second ReLU's output is saved by that ReLU and by the last Linear
    assert costs["_4"].saved.keys() == costs["_5"].saved.keys() == {"_4"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ppll_compile.plan(model, example_inputs=(x,), split_points=["_3"])
    assert [s.nodes for s in plan.stages] == [("_0", "_1", "_2", "_3"), ("_4", "_5")]
    assert [s.activation_bytes for s in plan.stages] == [x.numel() * 4 + b * c * h * w * 4, b * d * 4]


def test_measuring_changes_nothing_on_the_model():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measured_costs(model, torch.randn(2, 3, 8, 8))
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

    costs, _ = measured_costs(Wrap(), torch.randn(b, seq, e))
    projections = 2 * b * seq * e * (3 * e) + 2 * b * seq * e * e
    attention = 2 * (2 * b * seq * seq * e)  # QK^T and AV
    assert costs["attn"].flops_fwd == projections + attention


def test_native_attention_formula_matches_the_training_path():
    """The eval fast path (_native_multi_head_attention) is counted like the training path."""
    from torch.utils.flop_counter import FlopCounterMode

    from ppll_compile.cost.flops import flop_counter
    b, seq, e = 2, 10, 32
    mha = nn.MultiheadAttention(e, 4, batch_first=True).eval()
    x = torch.randn(b, seq, e)
    with torch.no_grad(), flop_counter() as fast:
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

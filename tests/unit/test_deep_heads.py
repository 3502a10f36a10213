"""Heads built on the model's blocks and InfoPro as its paper builds it: transformer heads (fresh or copied blocks),
momentum (MAN) heads that follow the next stage by EMA, InfoPro's decoder, BCE target and per-stage weights."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ppll_compile.errors import CutError, PolicyError
from ppll_compile.heads import InfoProHead, MomentumHead
from ppll_compile.heads.build import build_head, make_head
from ppll_compile.heads.modules import head_loss
from ppll_compile.heads.policy import load_policy
from ppll_compile.lower.split import next_blocks
from ppll_compile.plans.plan import Plan, TensorSpec
from tests.helpers import IMG, compile_quietly, SeqNet
from tests.helpers import heads_policy as policy
from tests.models import CNN, Res


def spec(shape, name="h"):
    return TensorSpec(name=name, shape=tuple(shape), dtype="float32", bytes=4 * math.prod(shape))


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(PolicyError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def refused(fn, *args, **kwargs) -> str:
    """The message of a compile that refuses a cut or a head (while planning, or when building the heads)."""
    with pytest.raises((PolicyError, CutError)) as e:
        fn(*args, **kwargs)
    return str(e.value)


SEQ_X = torch.randn(4, 6, 12)


# ---- transformer heads ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_a_fresh_transformer_head_of_depth_d_has_d_pre_norm_blocks(depth):
    head = build_head({"type": "transformer", "depth": depth}, spec((8, 17, 96)), 10)
    layers = [m for m in head.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    assert len(layers) == depth
    for layer in layers:
        assert layer.norm_first and layer.self_attn.batch_first and layer.activation is F.gelu
        assert layer.linear1.out_features == 4 * 96 and layer.self_attn.num_heads == 1
        assert layer.dropout.p == 0.0
    read_out = list(head.net.children())[1:]
    assert [type(m).__name__ for m in read_out] == ["LayerNorm", "_Pool", "Linear"]
    h = torch.randn(8, 17, 96)
    assert head(h).shape == (8, 10)
    torch.testing.assert_close(head.net[2](h), h[:, 0])  # pool: cls by default


def test_attention_heads_one_per_64_channels_lowered_to_a_divisor_or_as_given():
    def heads(d, **o):
        head = build_head({"type": "transformer", "depth": 1, **o}, spec((2, 5, d)), 3)
        return next(m for m in head.modules() if isinstance(m, nn.TransformerEncoderLayer)).self_attn.num_heads

    assert [heads(d) for d in (192, 768, 96, 100, 20)] == [3, 12, 1, 1, 1]
    assert heads(96, heads=4, mlp_ratio=2.0) == 4
    assert error(build_head, {"type": "transformer", "heads": 5}, spec((2, 5, 96)), 3) == (
        "head config: heads 5 does not divide the boundary's width D = 96; use a divisor of 96 (e.g. 4 or 6) or "
        "heads: 0 to choose one")


def test_a_policy_file_asks_for_transformer_blocks_and_conv_layers_of_depth_0_to_4(tmp_path):
    for d in range(5):
        path = tmp_path / f"p{d}.yaml"
        path.write_text(f"heads:\n  sequence: {{type: transformer, depth: {d}, init: fresh}}\n"
                        f"  feature_map: {{type: conv, depth: {d}}}\n")
        p = load_policy(path)
        seq, _ = make_head(p, spec((2, 5, 64)), 3)
        conv, _ = make_head(p, spec((2, 16, 8, 8)), 3)
        assert sum(isinstance(m, nn.TransformerEncoderLayer) for m in seq.modules()) == d
        assert sum(isinstance(m, nn.Conv2d) for m in conv.modules()) == d
    bad = tmp_path / "bad.yaml"
    bad.write_text("heads:\n  sequence: {type: transformer, init: clone}\n")
    assert error(load_policy, bad) == f"{bad}: heads.sequence.init must be one of fresh, copy, got 'clone'"


# ---- momentum (MAN) heads -------------------------------------------------------------------------------------
MOMENTUM = {"type": "momentum", "depth": 2, "momentum": 0.9, "every": 3, "pool": "cls"}


@pytest.fixture
def man():
    torch.manual_seed(0)
    model = SeqNet()
    return model, compile_quietly(model, SEQ_X, gpus=2, split_points=["blocks_1"], policy=policy(MOMENTUM))


def test_a_momentum_head_starts_as_the_next_blocks_and_follows_their_parameters(man):
    model, c = man
    head = c.lowered.heads[0]
    assert isinstance(head, MomentumHead) and (head.momentum, head.every) == (0.9, 3)
    followed = [p for b in (model.blocks[2], model.blocks[3]) for p in b.parameters()]
    mirrors = c.lowered.mirrors(0)
    assert len(mirrors) == len(followed) and all(m is p for m, p in zip(mirrors, followed))
    stage1 = dict(c.stages[1].named_parameters())
    assert all(stage1[n] is p for n, p in zip(head.mirrors, followed))
    for e, p in zip(head.ema_tensors(), mirrors):
        assert torch.equal(e, p) and e.data_ptr() != p.data_ptr()
    assert c.lowered.mirrors(1) == [] and c.lowered.mirrors(5) == []


def test_pull_is_the_exponential_moving_average(man):
    _, c = man
    head = c.lowered.heads[0]
    start = [e.clone() for e in head.ema_tensors()]
    targets = [torch.randn_like(e) for e in start]
    head.pull(targets)
    expected = [0.9 * e + 0.1 * t for e, t in zip(start, targets)]
    for got, want in zip(head.ema_tensors(), expected):
        torch.testing.assert_close(got, want)
    head.pull(c.lowered.mirrors(0))
    for got, e, p in zip(head.ema_tensors(), expected, c.lowered.mirrors(0)):
        torch.testing.assert_close(got, 0.9 * e + 0.1 * p.detach())
    with pytest.raises(ValueError, match="pull\\(\\) got 1 tensor\\(s\\), but the momentum head follows 24"):
        head.pull(targets[:1])


def test_the_momentum_trunk_is_not_trained_and_is_checkpointed(man):
    model, c = man
    head = c.lowered.heads[0]
    trained = {id(p) for p in c.lowered.stage_parameters(c.plan.stages[0])}
    assert not any(id(e) in trained for e in head.ema_tensors())
    assert [n for n, _ in head.named_parameters()] == ["net.1.1.weight", "net.1.1.bias"]  # pool, then linear
    assert set(head.ema_names) <= set(head.state_dict())
    h = torch.randn(4, 6, 32, requires_grad=True)
    head_loss(head, h, torch.randint(0, 5, (4,))).backward()
    assert h.grad is not None and h.grad.abs().sum() > 0  # the stage trains through the trunk
    assert all(not e.requires_grad and e.grad is None for e in head.ema_tensors())


def test_the_plan_counts_the_weights_sent_back(man):
    model, c = man
    size = sum(p.numel() * 4 for b in (model.blocks[2], model.blocks[3]) for p in b.parameters())
    head = c.plan.stages[0].head
    assert head.config["mirror_bytes"] == size == c.lowered.heads[0].ema_bytes()
    assert head.param_count == 32 * 5 + 5
    note = next(n for n in c.plan.notes if n.startswith("stage 0's momentum head"))
    assert size == 4 * 2 * (3 * 32 * 32 + 3 * 32 + 32 * 32 + 32 + 2 * 32 * 128 + 128 + 32 + 4 * 32)  # 2 blocks
    assert note.startswith("stage 0's momentum head follows stage 1's first 2 block(s) by EMA (momentum 0.9): "
                           "stage 1 sends their weights, 99.2 KiB, back every 3 step(s) (33.1 KiB per step")
    saved = Plan.from_json(c.plan.to_json())  # a saved plan carries the figure and rebuilds the head
    assert saved.stages[0].head.config == head.config
    again = compile_quietly(SeqNet(), SEQ_X, plan=saved, policy=policy(MOMENTUM))
    assert again.plan.stages[0].head.config["mirror_bytes"] == size


def test_a_momentum_head_follows_the_next_residual_block_of_a_cnn():
    torch.manual_seed(0)
    model = CNN()
    c = compile_quietly(model, IMG, gpus=2, split_points=["relu_3"], policy=policy(feature_map={"type": "momentum"}))
    head = c.lowered.heads[0]
    assert type(head.trunk.blocks[0]) is Res and c.lowered.mirrors(0) == list(model.blocks[2].parameters())
    assert head(torch.randn(2, 8, 8, 8)).shape == (2, 5)


# ---- errors ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graphs():
    """SeqNet and CNN with their traced graphs' nodes (compiled with MLP heads, which need no blocks)."""
    seq, cnn = SeqNet(), CNN()
    return {name: (model, list(compile_quietly(model, x, gpus=2, policy="mlp").graph_module.graph.nodes))
            for name, model, x in (("seq", seq, SEQ_X), ("cnn", cnn, IMG))}


def test_finding_the_blocks_after_a_cut(graphs):
    model, nodes = graphs["seq"]
    assert next_blocks(model, nodes, "blocks_0", 3) == [(f"blocks.{k}", model.blocks[k]) for k in (1, 2, 3)]
    assert next_blocks(model, nodes, "embed", 1) == [("blocks.0", model.blocks[0])]
    model, nodes = graphs["cnn"]
    assert next_blocks(model, nodes, "relu_1", 2) == [("blocks.1", model.blocks[1]), ("blocks.2", model.blocks[2])]
    assert next_blocks(model, nodes, "stem_2", 1) == [("blocks.0", model.blocks[0])]  # not the stem's own layers


def test_copying_more_blocks_than_are_left(graphs):
    model, nodes = graphs["seq"]
    config = {"type": "transformer", "depth": 2, "init": "copy"}
    assert error(next_blocks, model, nodes, "blocks_2", 2, stage=1, config=config) == (
        "stage 1's transformer head (init: copy, depth 2) copies the 2 blocks after cut 'blocks_2', but only 1 "
        "block(s) of 'blocks' follow it (blocks.3); use depth: 1 or less, cut earlier, or use init: fresh")
    msg = refused(compile_quietly, SeqNet(), SEQ_X, gpus=2, split_points=["blocks_2"], policy=policy(config))
    assert ("copies the 2 blocks after cut 'blocks_2', but only 1 block(s) of 'blocks' follow it (blocks.3); use "
            "depth: 1 or less, cut earlier, or use init: fresh") in msg


def test_a_momentum_head_where_no_block_follows(graphs):
    model, nodes = graphs["seq"]
    assert error(next_blocks, model, nodes, "blocks_3", 1, stage=0, config={"type": "momentum"}) == (
        "stage 0's momentum head (depth 1) follows the 1 block(s) after cut 'blocks_3', but no block begins there: "
        "the next module, 'norm', is not a child of a ModuleList or Sequential that begins at the cut; a momentum "
        "head needs blocks of a ModuleList or Sequential right after its cut; use another head type")
    model, nodes = graphs["cnn"]
    assert error(next_blocks, model, nodes, "add", 2, config={"type": "momentum", "depth": 2}).startswith(
        "the momentum head (depth 2) follows the 2 block(s) after cut 'add', but no block begins there: the "
        "next module, 'blocks.0', is not a child")  # 'add' is inside blocks.0
    msg = refused(compile_quietly, SeqNet(), SEQ_X, gpus=2, split_points=["blocks_3"],
                  policy=policy({"type": "momentum"}))
    assert ("follows the 1 block(s) after cut 'blocks_3', but no block begins there: the next module, 'norm', is not "
            "a child of a ModuleList or Sequential that begins at the cut; a momentum head needs blocks of a "
            "ModuleList or Sequential right after its cut; use another head type") in msg


def test_a_momentum_head_follows_the_next_stage_only():
    msg = error(compile_quietly, SeqNet(), SEQ_X, gpus=3, split_points=["blocks_0", "blocks_1"],
                policy=policy(MOMENTUM))
    assert msg == ("stage 0's momentum head follows the 2 block(s) after cut 'blocks_0', but "
                   "blocks.2.self_attn.in_proj_weight is not trained by stage 1 (a momentum head follows the next "
                   "stage's parameters only); use a smaller depth, or give stage 1 more blocks (split_points=...)")


# ---- InfoPro --------------------------------------------------------------------------------------------------
def test_the_infopro_decoder_upsamples_first_then_convolves_to_the_image():
    head, _ = make_head(load_policy("infopro"), spec((4, 32, 4, 4)), 10, (4, 3, 16, 16))
    assert isinstance(head, InfoProHead)
    layers = list(head.decoder)
    assert [type(m).__name__ for m in layers] == ["Upsample", "Conv2d", "BatchNorm2d", "ReLU", "Conv2d"]
    up, first, last = layers[0], layers[1], layers[4]
    assert (up.size, up.mode, up.align_corners) == ((16, 16), "bilinear", True)
    assert (first.in_channels, first.out_channels, first.kernel_size) == (32, 12, (3, 3))
    assert (last.in_channels, last.out_channels, last.kernel_size) == (12, 3, (3, 3))
    conv = head.net[0]  # the paper's 1c2f classifier on 32 channels: conv3x3 to 64, stride 2
    assert (conv.kernel_size, conv.out_channels, conv.stride) == ((3, 3), 64, (2, 2))


def test_infopro_scores_the_sigmoid_by_bce_against_the_de_normalised_input():
    torch.manual_seed(0)
    p = policy(feature_map={"type": "infopro", "mean": [0.3], "std": [0.4]})
    head, config = make_head(p, spec((4, 8, 4, 4)), 10, (4, 1, 8, 8))
    head.eval()
    image = torch.rand(4, 1, 8, 8)
    x, h, y = (image - 0.3) / 0.4, torch.randn(4, 8, 4, 4), torch.randint(0, 10, (4,))
    r = 1 / (1 + torch.exp(-head.decoder(h)))
    bce = -(image * torch.log(r) + (1 - image) * torch.log(1 - r)).mean()
    ce = -torch.log_softmax(head.net(h), 1)[torch.arange(4), y].mean()
    assert (config["loss"]["reconstruction_weight"], config["loss"]["classification_weight"]) == (5.0, 0.5)
    torch.testing.assert_close(head.loss(h, y, x), 5.0 * bce + 0.5 * ce)
    mse = policy(feature_map={"type": "infopro", "reconstruction": "mse", "lambda1": [2, 2], "lambda2": [1, 1]})
    head, _ = make_head(mse, spec((4, 8, 4, 4)), 10, (4, 1, 8, 8))
    torch.testing.assert_close(head.loss(h, y, x), 2 * ((head.decoder(h) - x) ** 2).mean()
                               + F.cross_entropy(head.net(h), y))


def test_infopro_stats_must_fit_the_input_channels():
    msg = error(make_head, load_policy("infopro"), spec((4, 8, 4, 4)), 10, (4, 1, 8, 8))
    assert msg == ("head type 'infopro' de-normalises the input with mean [0.491373, 0.482353, 0.446667] and std "
                   "[0.247059, 0.243529, 0.261569] (CIFAR's, the default), but the input has 1 channel(s) (shape "
                   "(4, 1, 8, 8)); give mean: and std: with one value each, the normalisation of your data, or use "
                   "reconstruction: mse")
    assert error(make_head, policy(feature_map={"type": "infopro", "mean": [0.5, 0.5]}), spec((4, 8, 4, 4)), 10,
                 (4, 3, 8, 8)).endswith("(shape (4, 3, 8, 8)); give mean: and std: with 1 or 3 values each, the "
                                        "normalisation of your data, or use reconstruction: mse")


@pytest.mark.parametrize("stages,weights", [
    (3, [(5.0, 0.5), (0.5, 1.0)]),
    (4, [(5.0, 0.5), (2.75, 0.75), (0.5, 1.0)]),  # stage 1 of 4: ratio 1/2, 5 * 0.5 + 0.5 * 0.5 and 0.5 * 0.5 + 0.5
])
def test_infopro_weights_ramp_linearly_over_the_stages_into_each_head_config(tmp_path, stages, weights):
    torch.manual_seed(0)
    cuts = ["relu_1", "relu_3", "relu_5"][:stages - 1]
    c = compile_quietly(CNN(), IMG, gpus=stages, split_points=cuts, policy="infopro")
    got = [(s.head.config["loss"]["reconstruction_weight"], s.head.config["loss"]["classification_weight"])
           for s in c.plan.stages[:-1]]
    assert got == weights
    assert [(h.reconstruction_weight, h.classification_weight) for h in c.lowered.heads[:-1]] == weights
    path = c.plan.save(tmp_path / "plan.json")
    again = compile_quietly(CNN(), IMG, plan=path, policy="infopro")
    assert [s.head.config["loss"] for s in again.plan.stages[:-1]] == [s.head.config["loss"]
                                                                      for s in c.plan.stages[:-1]]

"""Tests of heads for channels-last maps (N x H x W x C) and per-token labels: kinds, fits, lm heads, costs, errors."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from ppll_compile import policies
from ppll_compile.errors import PolicyError
from ppll_compile.heads import AuxHead
from ppll_compile.heads.build import build_head, head_for, head_spec, make_head
from ppll_compile.heads.losses import IGNORE_INDEX, model_loss
from ppll_compile.heads.modules import head_loss
from ppll_compile.heads.policy import KINDS, load_policy, tensor_kind, validate_policy
from ppll_compile.plans.plan import TensorSpec

N, H, W, C = 4, 5, 6, 16  # a channels-last map N x H x W x C
N_, L, D = 3, 7, 24       # a sequence N x L x D


def spec(shape, layout="", name="h"):
    return TensorSpec(name=name, shape=tuple(shape), dtype="float32", bytes=4 * math.prod(shape), layout=layout)


MAP = spec((N, H, W, C), "channels_last")
SEQ = spec((N_, L, D))


def error(fn, *args, **kwargs):
    with pytest.raises(PolicyError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def randomise(module):
    """Give every parameter and BatchNorm running statistic random values, so no default hides a wrong axis."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn_like(m.running_mean))
                m.running_var.copy_(torch.rand_like(m.running_var) + 0.5)


def lm_policy(rank, **extra):
    return validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm", "rank": rank, **extra}},
                           "inline")



def test_tensor_kind_reads_rank_and_layout():
    assert tensor_kind(spec((8, 64, 16, 16))) == "feature_map"
    assert tensor_kind(spec((8, 16, 16, 64), "channels_last")) == "channels_last"
    assert tensor_kind(spec((8, 17, 96))) == "sequence"
    assert tensor_kind(spec((8, 96))) == "vector"
    assert "channels_last" in KINDS
    msg = error(tensor_kind, spec((8, 3, 4, 4, 4), name="blocks_2"))
    assert msg == ("boundary 'blocks_2': a tensor of shape (8, 3, 4, 4, 4) is 5-D, but policy heads read 4-D feature "
                   "maps (N x C x H x W, or N x H x W x C with layout 'channels_last'), 3-D sequences (N x L x D) or "
                   "2-D vectors (N x D); pass a policy callable fn(spec, num_classes) -> nn.Module that builds a head "
                   "for it, or cut elsewhere")
    assert "a tensor of shape (8, 17, 96) with layout 'channels_last' is 3-D" in error(
        tensor_kind, spec((8, 17, 96), "channels_last"))



@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("depth,hidden", [(1, 0), (2, 10)])
def test_conv_head_on_a_channels_last_map_is_the_conv_head_on_the_permuted_map(train, depth, hidden):
    config = {"type": "conv", "width": 12, "depth": depth, "pool": 2, "hidden": hidden}
    head = build_head(config, MAP, 10)
    randomise(head)
    head.train(train)
    x = torch.randn(MAP.shape)
    convs = [m for m in head.modules() if isinstance(m, nn.Conv2d)]
    bns = [m for m in head.modules() if isinstance(m, nn.BatchNorm2d)]
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert [c.in_channels for c in convs] == [C] + [12] * (depth - 1)
    y = x.permute(0, 3, 1, 2)  # N x C x H x W
    for conv, bn in zip(convs, bns):
        stats = (bn.running_mean.clone(), bn.running_var.clone())
        y = F.relu(F.batch_norm(F.conv2d(y, conv.weight, padding=1), *stats, bn.weight, bn.bias,
                                training=train, eps=bn.eps))
    y = F.adaptive_avg_pool2d(y, 2).flatten(1)
    for i, lin in enumerate(linears):
        y = F.linear(y, lin.weight, lin.bias)
        y = F.relu(y) if i < len(linears) - 1 else y
    out = head(x)
    assert out.shape == (N, 10)
    assert torch.allclose(out, y, atol=1e-5)


def test_token_head_on_a_channels_last_map_normalises_channels_and_averages_positions():
    head = build_head({"type": "token"}, MAP, 10)  # pool defaults to mean on a map
    randomise(head)
    ln, lin = head.net[0], head.net[-1]
    assert isinstance(ln, nn.LayerNorm) and ln.normalized_shape == (C,)
    x = torch.randn(MAP.shape)
    xp = x.permute(0, 3, 1, 2)  # N x C x H x W: normalise over dim 1, average over H x W
    mu, var = xp.mean(1, keepdim=True), xp.var(1, unbiased=False, keepdim=True)
    normed = (xp - mu) / torch.sqrt(var + ln.eps) * ln.weight[:, None, None] + ln.bias[:, None, None]
    expected = normed.mean((2, 3)) @ lin.weight.T + lin.bias
    assert torch.allclose(head(x), expected, atol=1e-5)


def test_mlp_head_on_a_channels_last_map_averages_over_h_and_w():
    head = build_head({"type": "mlp", "hidden": 9, "depth": 1}, MAP, 10)
    randomise(head)
    first, last = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert first.in_features == C
    x = torch.randn(MAP.shape)
    pooled = x.permute(0, 3, 1, 2).mean((2, 3))
    expected = F.relu(pooled @ first.weight.T + first.bias) @ last.weight.T + last.bias
    assert torch.allclose(head(x), expected, atol=1e-5)


@pytest.mark.parametrize("name", ["auto", "dgl", "infopro", "mlp", "vit"])
def test_every_shipped_policy_has_a_channels_last_head_counted_under_its_kind(name):
    policy = load_policy(name)
    assert policy.fits(MAP)
    head, config = make_head(policy, MAP, 10, (N, 3, 32, 32))
    assert config["type"] == policy.heads["channels_last"]["type"] and head(torch.randn(MAP.shape)).shape == (N, 10)
    assert head_spec(policy, None, MAP, 10, None, "adam").kind == "channels_last"


def test_dgl_conv_head_costs_the_same_on_a_map_in_either_layout():
    policy = load_policy("dgl")
    last = head_spec(policy, None, MAP, 10, None, "adam")
    first = head_spec(policy, None, spec((N, C, H, W)), 10, None, "adam")
    assert (last.param_count, last.flops_fwd, last.flops_bwd) == (first.param_count, first.flops_fwd, first.flops_bwd)
    assert last.config == first.config and last.kind == "channels_last" and first.kind == "feature_map"


def test_a_token_head_on_a_channels_last_map_has_no_cls_token(tmp_path):
    msg = error(validate_policy, {"heads": {"channels_last": {"type": "token", "pool": "cls"}}}, "p.yaml")
    assert msg == "p.yaml: heads.channels_last.pool must be 'mean' on channels_last tensors (N x H x W x C), got 'cls'"
    msg = error(validate_policy, {"heads": {"channels_last": {"type": "infopro"}}}, "p.yaml")
    assert msg == ("p.yaml: heads.channels_last.type 'infopro' cannot read channels_last tensors (N x H x W x C) "
                   "(it reads feature_map); use type conv or mlp or token")
    policy = validate_policy({"heads": {"feature_map": {"type": "conv"}}}, "p.yaml")
    assert not policy.fits(MAP)
    assert error(policy.config_for, MAP) == (
        "policy 'p.yaml' has no head for channels_last tensors (N x H x W x C), needed for boundary 'h' of shape "
        "(4, 5, 6, 16); it has heads for: feature_map. Use policy='auto', or add a 'channels_last:' entry under "
        "'heads:' in p.yaml")



ODD = [spec((2, 3, 4, 4, 4, 4)), spec((2, 3, 4, 4, 4)), spec((8,)),
       TensorSpec(name="n", shape=(), dtype="int", bytes=0),
       spec((8, 17, 96), "channels_last"), spec((8, 3, 4, 4), "strange")]
FITTING = [spec((8, 64, 4, 4)), MAP, SEQ, spec((8, 96))]


@pytest.mark.parametrize("name", [*policies.names(), "callable"])
def test_fits_never_raises_and_agrees_with_config_for(name):
    policy = load_policy(nn.Flatten if name == "callable" else name)
    for s in ODD + FITTING:
        for per_token in (False, True):
            fits = policy.fits(s, per_token)
            try:
                policy.config_for(s, per_token=per_token)
                accepted = True
            except PolicyError:
                accepted = False
            assert fits == accepted, (s, per_token)
            if s in ODD:
                assert fits == (name == "callable"), (s, per_token)


def test_fits_per_kind_and_per_token():
    auto, dgl, lm = load_policy("auto"), load_policy("dgl"), load_policy("lm")
    assert all(auto.fits(s) for s in FITTING) and all(dgl.fits(s) for s in FITTING)
    assert [lm.fits(s) for s in FITTING] == [False, False, True, True]
    assert [auto.fits(s, per_token=True) for s in FITTING] == [False, False, True, False]
    assert [lm.fits(s, per_token=True) for s in FITTING] == [False, False, True, False]
    assert not any(dgl.fits(s, per_token=True) for s in FITTING)



@pytest.mark.parametrize("rank", [0, 5, 64])
def test_lm_head_gives_per_token_scores_with_the_closed_form_parameter_count(rank):
    vocab = 101
    head, config = make_head(lm_policy(rank), SEQ, vocab, per_token=True)
    assert config["type"] == "lm" and config["rank"] == rank and isinstance(head, AuxHead)
    expected = (D * rank + rank * vocab if rank else D * vocab) + vocab + 2 * D
    assert sum(p.numel() for p in head.parameters()) == expected
    randomise(head)
    h = torch.randn(SEQ.shape)
    out = head(h)
    assert out.shape == (N_, L, vocab)
    ln, *linears = head.net
    by_hand = F.layer_norm(h, (D,), ln.weight, ln.bias, ln.eps)
    if rank:
        assert linears[0].bias is None and linears[0].weight.shape == (rank, D)
        by_hand = by_hand @ linears[0].weight.T
    assert torch.allclose(out, by_hand @ linears[-1].weight.T + linears[-1].bias, atol=1e-5)


def test_shipped_lm_policy_and_auto_give_a_low_rank_per_token_head():
    for name in ("lm", "auto"):
        policy = load_policy(name)
        assert policy.per_token == {"type": "lm", "rank": 64}
        assert policy.config_for(SEQ, per_token=True)["type"] == "lm"
    assert load_policy("lm").heads == {"sequence": {"type": "token", "pool": "mean"},
                                       "vector": {"type": "mlp", "hidden": 256, "depth": 1}}
    assert yaml.safe_load(policies.path("lm").read_text())["name"] == "lm"


def per_token_labels(vocab):
    torch.manual_seed(2)
    y = torch.randint(0, vocab, (N_, L))
    y[0, :3] = IGNORE_INDEX   # a prompt
    y[1] = IGNORE_INDEX       # a row with no label at all
    y[2, -1] = IGNORE_INDEX   # the last token of a causal LM
    return y


def by_hand_cross_entropy(scores, y):
    """Mean over the labelled positions of -log softmax(scores)[label]; ignored positions count for nothing."""
    logp = scores.log_softmax(-1).reshape(-1, scores.shape[-1])
    flat = y.reshape(-1)
    keep = flat != IGNORE_INDEX
    return -logp[keep].gather(1, flat[keep, None]).mean()


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_lm_head_loss_is_cross_entropy_over_the_labelled_tokens(weight):
    vocab = 37
    policy = validate_policy({"heads": {"vector": {"type": "mlp"}}, "per_token": {"type": "lm", "rank": 6},
                              "loss": {"classification_weight": weight}}, "inline")
    head, _ = make_head(policy, SEQ, vocab, per_token=True)
    h, y = torch.randn(SEQ.shape), per_token_labels(vocab)
    scores = head(h)
    expected = weight * by_hand_cross_entropy(scores, y)
    torch.testing.assert_close(head.loss(h, y), expected)
    torch.testing.assert_close(head_loss(head, h, y), expected)
    torch.testing.assert_close(expected, weight * F.cross_entropy(scores.reshape(-1, vocab), y.reshape(-1),
                                                                  ignore_index=-100))
    head.loss(h, y).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


def test_head_for_builds_a_saved_lm_config_and_checks_it_against_the_labels():
    config = {**lm_policy(4).config_for(SEQ, per_token=True)}
    head, got = head_for(lm_policy(0), config, SEQ, 11, None, per_token=True)
    assert got == config and head(torch.randn(SEQ.shape)).shape == (N_, L, 11)
    assert error(head_for, lm_policy(0), config, SEQ, 11, None) == (
        "head config: type 'lm' gives per-token scores (N x L x C), but the sequence boundary 'h' of shape "
        "(3, 7, 24) serves labels of one class per example (N); use type mlp or momentum or token or transformer")



def test_model_loss_reads_the_scores_of_any_output_per_example_and_per_token():
    torch.manual_seed(3)
    per_example = (torch.randn(5, 9), torch.tensor([1, 0, IGNORE_INDEX, 8, 3]))
    per_token = (torch.randn(N_, L, 9), per_token_labels(9))
    for scores, y in (per_example, per_token):
        expected = by_hand_cross_entropy(scores, y)
        for output in (scores, {"logits": scores, "loss": torch.tensor(0.0)}, SimpleNamespace(logits=scores),
                       (scores, torch.randn(2)), [scores]):
            torch.testing.assert_close(model_loss(output, y), expected)



def test_head_spec_counts_the_per_token_head_at_every_token():
    rank = 8

    def counted(vocab, per_token=True, r=rank):
        return head_spec(lm_policy(r), None, SEQ, vocab, None, "adam", per_token=per_token)

    small, large = counted(1000), counted(5000)
    assert small.kind == large.kind == "sequence" and small.config["type"] == "lm"
    matmul = 2 * N_ * L * (D * rank + rank * 1000)  # forward FLOPs of Linear(D, r) and Linear(r, C) at each token
    assert large.flops_fwd - small.flops_fwd == 2 * N_ * L * rank * 4000
    assert 0 <= small.flops_fwd - matmul <= 10 * N_ * L * D  # at most a LayerNorm's share on top
    assert large.flops_bwd > small.flops_bwd > 0
    assert large.param_count - small.param_count == (rank + 1) * 4000
    assert large.memory_bytes > small.memory_bytes
    full = counted(1000, r=0)
    assert full.flops_fwd - small.flops_fwd == 2 * N_ * L * (D * 1000 - D * rank - rank * 1000)
    pooled = head_spec(load_policy("lm"), None, SEQ, 1000, None, "adam")  # per-example labels: token read-out
    assert pooled.config["type"] == "token" and pooled.flops_fwd < small.flops_fwd


def test_a_callable_policy_serves_per_token_labels_when_it_gives_per_token_scores():
    def per_token_head(s, num_classes):
        return nn.Linear(s.shape[-1], num_classes)

    policy = load_policy(per_token_head)
    assert policy.fits(SEQ, per_token=True) and policy.fits(spec((2, 3, 4, 4, 4)), per_token=True)
    counted = head_spec(policy, None, SEQ, 50, None, "sgd", per_token=True)
    assert counted.flops_fwd == 2 * N_ * L * D * 50 and counted.config == {"type": "callable", "name": policy.name}
    head, _ = make_head(policy, SEQ, 50, per_token=True)
    h, y = torch.randn(SEQ.shape), per_token_labels(50)
    torch.testing.assert_close(head_loss(head, h, y), by_hand_cross_entropy(head(h), y))
    msg = error(make_head, load_policy(lambda s, n: None), SEQ, 50, per_token=True)
    assert msg.endswith("it must return an nn.Module mapping a tensor of shape (3, 7, 24) to per-token scores "
                        "N x L x 50")



def test_a_policy_without_per_token_head_names_the_boundary_the_labels_and_the_way_out():
    assert error(load_policy("dgl").config_for, spec((8, 17, 96), name="h_3"), per_token=True) == (
        f"policy 'dgl' has no per-token head, needed for boundary 'h_3' of shape (8, 17, 96), a sequence "
        f"(N x L x D) whose labels are per token (N x L); use policy='lm', or add a 'per_token:' entry (type lm) to "
        f"{policies.path('dgl')}")
    assert error(make_head, load_policy("vit"), SEQ, 10, per_token=True).startswith(
        "policy 'vit' has no per-token head")


def test_per_token_labels_on_a_boundary_that_is_not_a_sequence():
    lm = load_policy("lm")
    assert error(lm.config_for, MAP, per_token=True) == (
        "boundary 'h' of shape (4, 5, 6, 16) is a channels_last tensor (N x H x W x C), but the labels are per token "
        "(N x L) and per-token heads read sequences (N x L x D); cut where the boundary is a sequence, or pass a "
        "policy callable fn(spec, num_classes) -> nn.Module giving N x L x C scores")
    assert error(build_head, {"type": "lm"}, spec((8, 64, 4, 4)), 10, per_token=True) == (
        "head config: the feature_map boundary 'h' of shape (8, 64, 4, 4) (N x C x H x W) cannot serve labels per "
        "token (N x L): per-token heads read sequences (N x L x D); cut where the boundary is a sequence, or pass a "
        "policy callable")


def test_an_lm_head_on_a_feature_map_or_a_per_example_sequence_is_refused():
    assert error(validate_policy, {"heads": {"feature_map": {"type": "lm"}}}, "p.yaml") == (
        "p.yaml: heads.feature_map.type 'lm' cannot read feature_map tensors (N x C x H x W) (it reads sequence); "
        "use type conv or infopro or mlp or momentum")
    assert error(build_head, {"type": "lm"}, spec((8, 64, 4, 4)), 10) == (
        "head config: type 'lm' cannot read the feature_map boundary 'h' of shape (8, 64, 4, 4) (it reads sequence); "
        "use type conv or infopro or mlp or momentum")
    assert error(validate_policy, {"heads": {"sequence": {"type": "lm"}}}, "p.yaml") == (
        "p.yaml: heads.sequence.type 'lm' gives per-token scores (N x L x C), but heads.sequence serves labels of one "
        "class per example (N); use type mlp or momentum or token or transformer (a per-token head goes under "
        "per_token:)")


def test_the_per_token_entry_is_validated_like_every_head_config():
    def msg(per_token):
        return error(validate_policy, {"heads": {"vector": {"type": "mlp"}}, "per_token": per_token}, "p.yaml")

    assert msg({"type": "lm", "rnak": 8}) == "p.yaml: unknown key 'rnak' at per_token (allowed: rank, type)"
    rank = "p.yaml: per_token.rank must be an integer from 0 to 1048576 (a width x width layer this wide holds 4 TiB "
    rank += "of "
    assert msg({"type": "lm", "rank": -1}) == rank + "parameters), got -1"
    assert msg({"type": "lm", "rank": "64"}) == rank + "parameters), got '64'"
    assert msg({"rank": 8}) == ("p.yaml: per_token.type must be one of conv, infopro, lm, lm_output, mlp, momentum, "
                                "token, transformer, got None")
    assert msg("lm") == "p.yaml: per_token must be a mapping, got 'lm'"
    assert msg({"type": "mlp"}) == ("p.yaml: per_token.type 'mlp' gives one score vector per example (N x C), but "
                                    "per_token serves labels of one class per token (N x L); use type lm or lm_output")
    assert msg({"type": "conv"}) == ("p.yaml: per_token.type 'conv' cannot read sequence tensors (N x L x D) "
                                     "(it reads feature_map, channels_last); use type lm or lm_output")
    assert error(build_head, {"type": "token"}, SEQ, 10, per_token=True) == (
        "head config: type 'token' gives one score vector per example (N x C), but the sequence boundary 'h' of shape "
        "(3, 7, 24) serves labels of one class per token (N x L); use type lm or lm_output")



CONV = {"type": "conv", "width": 0, "max_width": 0, "depth": 2, "pool": 2, "hidden": 0}
MLP = {"type": "mlp", "hidden": 256, "depth": 1}


def test_existing_kinds_keep_their_head_configs_in_every_shipped_policy():
    # infopro: the paper's decoder and loss (see policies/infopro.yaml)
    before = {
        "auto": {"feature_map": {**CONV, "max_width": 256, "depth": 1}, "sequence": {"type": "token", "pool": "mean"},
                 "vector": MLP},
        "dgl": {"feature_map": CONV, "sequence": MLP, "vector": MLP},
        "infopro": {"feature_map": {"type": "infopro", "width": 12, "upsample": "bilinear", "reconstruction": "bce",
                                    "mean": [0.491373, 0.482353, 0.446667], "std": [0.247059, 0.243529, 0.261569],
                                    "lambda1": [5.0, 0.5], "lambda2": [0.5, 1.0], "cls_width": 0, "cls_stride": 0,
                                    "hidden": 128}, "vector": MLP},
        "mlp": {"feature_map": MLP, "sequence": MLP, "vector": MLP},
        "vit": {"feature_map": MLP, "sequence": {"type": "token", "pool": "cls"}, "vector": MLP},
    }
    for name, heads in before.items():
        policy = load_policy(name)
        assert {k: dict(v) for k, v in policy.heads.items() if k != "channels_last"} == heads, name
    assert load_policy("infopro").loss == {"classification": "cross_entropy", "classification_weight": 1.0,
                                           "reconstruction_weight": 5.0}

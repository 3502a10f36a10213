"""Tests of the auxiliary-head policies and heads: shipped policies, schema errors, head shapes, losses and costs."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import ppll_compile
from ppll_compile import policies
from ppll_compile.errors import PolicyError
from ppll_compile.heads import AuxHead, InfoProHead
from ppll_compile.heads.build import build_head, make_head
from ppll_compile.heads.modules import CIFAR_MEAN, CIFAR_STD, head_loss
from ppll_compile.heads.policy import KINDS, Policy, load_policy, tensor_kind, validate_policy
from ppll_compile.plans.plan import TensorSpec

SHAPES = {"feature_map": (8, 64, 16, 16), "channels_last": (8, 16, 16, 64), "sequence": (8, 17, 96), "vector": (8, 256)}
INPUT_SHAPE = (8, 3, 32, 32)
SHIPPED = ["auto", "dgl", "infopro", "lm", "man", "mlp", "vit", "vit_deep"]


def spec(shape, name="h", layout=""):
    return TensorSpec(name=name, shape=tuple(shape), dtype="float32", bytes=4 * math.prod(shape), layout=layout)


def kind_spec(kind):
    """The spec of the test boundary of tensor kind ``kind`` (a channels-last map carries its layout)."""
    return spec(SHAPES[kind], layout="channels_last" if kind == "channels_last" else "")


def write(tmp_path, data, name="p.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def error(tmp_path, data):
    path = write(tmp_path, data)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    return str(e.value), path


def test_names_lists_every_shipped_policy_and_each_validates():
    assert policies.names() == SHIPPED
    for name in SHIPPED:
        path = policies.path(name)
        policy = load_policy(name)
        assert policy.name == name and policy.source == str(path) and policy.description
        assert yaml.safe_load(path.read_text())["name"] == name
        assert set(policy.heads) <= set(KINDS) and policy.heads
        for config in policy.heads.values():
            assert "type" in config


def test_shipped_policies_cover_the_kinds_they_promise():
    kinds = {name: {k: c["type"] for k, c in load_policy(name).heads.items()} for name in SHIPPED}
    assert kinds["dgl"] == {"feature_map": "conv", "channels_last": "conv", "sequence": "mlp", "vector": "mlp"}
    assert kinds["infopro"] == {"feature_map": "infopro", "channels_last": "mlp", "vector": "mlp"}
    assert kinds["mlp"] == {"feature_map": "mlp", "channels_last": "mlp", "sequence": "mlp", "vector": "mlp"}
    assert kinds["vit"] == {"feature_map": "mlp", "channels_last": "token", "sequence": "token", "vector": "mlp"}
    assert kinds["auto"] == {"feature_map": "conv", "channels_last": "token", "sequence": "token", "vector": "mlp"}
    assert kinds["lm"] == {"sequence": "token", "vector": "mlp"}
    assert kinds["man"] == {"feature_map": "momentum", "channels_last": "mlp", "sequence": "momentum",
                            "vector": "mlp"}
    assert kinds["vit_deep"] == {"feature_map": "mlp", "channels_last": "token", "sequence": "transformer",
                                 "vector": "mlp"}
    assert {n: (p.per_token or {}).get("type") for n, p in map(lambda n: (n, load_policy(n)), SHIPPED)} == {
        "auto": "lm", "dgl": None, "infopro": None, "lm": "lm", "man": None, "mlp": None, "vit": None,
        "vit_deep": None}
    assert load_policy("infopro").heads["feature_map"]["lambda1"][0] > 0


@pytest.mark.parametrize("name,kind", [(n, k) for n in SHIPPED for k in SHAPES if k in load_policy(n).heads])
def test_every_shipped_head_gives_logits_and_a_loss_that_trains_it(name, kind):
    torch.manual_seed(0)
    head, config = make_head(load_policy(name), kind_spec(kind), 10, INPUT_SHAPE)
    assert isinstance(head, AuxHead) and config["type"] == load_policy(name).heads[kind]["type"]
    h = torch.randn(SHAPES[kind])
    assert head(h).shape == (8, 10)
    x = torch.randn(INPUT_SHAPE) if head.needs_input else None
    loss = head_loss(head, h, torch.randint(0, 10, (8,)), x)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname
    small = torch.randn(3, *SHAPES[kind][1:])  # any batch size
    head.eval()
    assert head(small).shape == (3, 10)


def test_infopro_loss_is_the_weighted_sum_of_reconstruction_and_cross_entropy():
    torch.manual_seed(0)
    policy = load_policy("infopro")
    head, config = make_head(policy, spec(SHAPES["feature_map"]), 10, INPUT_SHAPE)
    assert isinstance(head, InfoProHead) and head.needs_input
    head.eval()
    h, x, y = torch.randn(SHAPES["feature_map"]), torch.randn(INPUT_SHAPE), torch.randint(0, 10, (8,))
    recon = head.reconstruct(h)
    assert recon.shape == INPUT_SHAPE and 0 <= recon.min() and recon.max() <= 1
    w = config["loss"]  # outside a plan: the weights of the first auxiliary head
    assert (w["reconstruction_weight"], w["classification_weight"]) == (5.0, 0.5)
    image = (x * torch.tensor(CIFAR_STD).view(1, 3, 1, 1) + torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)).clamp(0, 1)
    expected = 5.0 * F.binary_cross_entropy(recon, image) + 0.5 * F.cross_entropy(head.net(h), y)
    torch.testing.assert_close(head.loss(h, y, x), expected)
    with pytest.raises(PolicyError, match="input=None"):
        head.loss(h, y)


@pytest.mark.parametrize("policy", ["dgl", "infopro"])
def test_loss_weights_of_a_hand_edited_config_scale_each_term(policy):
    torch.manual_seed(0)
    s = spec(SHAPES["feature_map"])
    weights = {"classification": "cross_entropy", "classification_weight": 0.3, "reconstruction_weight": 2.5}
    head = build_head({**load_policy(policy).config_for(s), "loss": weights}, s, 10, INPUT_SHAPE)
    h, x, y = torch.randn(SHAPES["feature_map"]), torch.randn(INPUT_SHAPE), torch.randint(0, 10, (8,))
    expected = 0.3 * F.cross_entropy(head.net(h), y)
    if policy == "infopro":  # only InfoPro's heads reconstruct the input
        expected = expected + 2.5 * head.reconstruction_loss(h, x)
    torch.testing.assert_close(head_loss(head, h, y, x), expected)
    torch.testing.assert_close(head.loss(h, y, x), expected)


def test_infopro_needs_an_image_input_shape():
    config = load_policy("infopro").config_for(spec(SHAPES["feature_map"]))
    with pytest.raises(PolicyError) as e:
        build_head(config, spec(SHAPES["feature_map"]), 10, (8, 128))
    assert str(e.value) == ("head type 'infopro' reconstructs the model input, which must be an image batch "
                            "N x C x H x W, got input shape (8, 128); pass input_shape, or use a policy without "
                            "infopro heads (e.g. 'dgl')")


@pytest.mark.parametrize("width,max_width,depth,pool,hidden",
                         [(128, 0, 1, 2, 0), (0, 0, 2, 2, 0), (32, 0, 2, 1, 50), (16, 0, 0, 3, 20), (0, 24, 1, 2, 0),
                          (128, 100, 1, 1, 0)])
def test_conv_head_parameter_count_matches_the_closed_form(width, max_width, depth, pool, hidden):
    c, k = 64, 10
    config = {"type": "conv", "width": width, "max_width": max_width, "depth": depth, "pool": pool,
              "hidden": hidden}
    head = build_head(config, spec((8, c, 16, 16)), k)
    w = min(width or c, max_width) if max_width else (width or c)
    convs = (c * w * 9 + 2 * w + (depth - 1) * (w * w * 9 + 2 * w)) if depth else 0
    features = (w if depth else c) * pool * pool
    mlp = (features * hidden + hidden + hidden * k + k) if hidden else features * k + k
    assert sum(p.numel() for p in head.parameters()) == convs + mlp


def test_defaults_are_filled_in_and_config_for_merges_the_loss(tmp_path):
    path = write(tmp_path, {"heads": {"feature_map": {"type": "conv", "width": 32}}})
    policy = load_policy(path)
    assert policy.name == str(path)
    assert policy.heads == {"feature_map": {"type": "conv", "width": 32, "max_width": 0, "depth": 1, "pool": 2,
                                            "hidden": 0}}
    assert policy.config_for(spec(SHAPES["feature_map"])) == {
        "type": "conv", "width": 32, "max_width": 0, "depth": 1, "pool": 2, "hidden": 0,
        "loss": {"classification": "cross_entropy", "classification_weight": 1.0, "reconstruction_weight": 0.0}}


def test_validate_policy_takes_parsed_data_and_names_its_source():
    policy = validate_policy({"heads": {"vector": {"type": "mlp", "depth": 0}}}, "inline")
    assert isinstance(policy, Policy) and policy.name == "inline" and policy.source == "inline"
    assert validate_policy({"name": "x", "heads": {"vector": {"type": "mlp"}}}, "inline").name == "x"
    with pytest.raises(PolicyError) as e:
        validate_policy({"heads": {}}, "inline")
    assert str(e.value) == ("inline: heads is empty; give a head config for at least one of "
                            "feature_map, channels_last, sequence, vector")


def test_unknown_key_names_the_place_and_the_allowed_keys(tmp_path):
    msg, path = error(tmp_path, {"heads": {"feature_map": {"type": "conv", "widht": 64}}})
    assert msg == (f"{path}: unknown key 'widht' at heads.feature_map "
                   f"(allowed: depth, hidden, max_width, pool, type, width)")
    msg, path = error(tmp_path, {"heads": {"vector": {"type": "mlp"}}, "los": {}})
    assert msg == f"{path}: unknown key 'los' (allowed: description, heads, loss, name, per_token)"
    msg, path = error(tmp_path, {"heads": {"vector": {"type": "mlp"}}, "loss": {"recon_weight": 1}})
    assert msg == (f"{path}: unknown key 'recon_weight' at loss "
                   f"(allowed: classification, classification_weight, reconstruction_weight)")


def test_wrong_option_values_say_what_was_expected(tmp_path):
    msg, path = error(tmp_path, {"heads": {"feature_map": {"type": "conv", "width": "abc"}}})
    assert msg == (f"{path}: heads.feature_map.width must be an integer from 0 to 1048576 (a width x width layer this "
                   f"wide holds 4 TiB of parameters), got 'abc'")
    msg, path = error(tmp_path, {"heads": {"feature_map": {"type": "conv", "pool": 0}}})
    assert msg == (f"{path}: heads.feature_map.pool must be an integer from 1 to 256 (more than the side of any map a "
                   f"head reads), got 0")
    msg, path = error(tmp_path, {"heads": {"sequence": {"type": "token", "pool": "max"}}})
    assert msg == f"{path}: heads.sequence.pool must be one of cls, mean, got 'max'"
    msg, path = error(tmp_path, {"heads": {"vector": {"type": "mlp"}}, "loss": {"classification_weight": -1}})
    assert msg == f"{path}: loss.classification_weight must be a number >= 0, got -1"
    msg, path = error(tmp_path, {"heads": {"vector": {"type": "mlp", "depth": True}}})
    assert msg == (f"{path}: heads.vector.depth must be an integer from 0 to 1024 (deeper than ResNet-1001's trunk), "
                   f"got True")


def test_unknown_or_misplaced_head_type(tmp_path):
    msg, path = error(tmp_path, {"heads": {"feature_map": {"type": "foo"}}})
    assert msg == (f"{path}: heads.feature_map.type must be one of conv, infopro, lm, lm_output, mlp, momentum, token, "
                   f"transformer, got 'foo'")
    msg, path = error(tmp_path, {"heads": {"feature_map": {"width": 3}}})
    assert msg == (f"{path}: heads.feature_map.type must be one of conv, infopro, lm, lm_output, mlp, momentum, token, "
                   f"transformer, got None")
    msg, path = error(tmp_path, {"heads": {"sequence": {"type": "conv"}}})
    assert msg == (f"{path}: heads.sequence.type 'conv' cannot read sequence tensors (N x L x D) "
                   f"(it reads feature_map, channels_last); use type mlp or momentum or token or transformer")
    msg, path = error(tmp_path, {"heads": {"feature_map": {"type": "infopro", "reconstruction": "l1"}}})
    assert msg == f"{path}: heads.feature_map.reconstruction must be one of bce, mse, got 'l1'"


def test_unknown_kind_and_malformed_sections(tmp_path):
    msg, path = error(tmp_path, {"heads": {"image": {"type": "conv"}}})
    assert msg == f"{path}: unknown key 'image' at heads (allowed: channels_last, feature_map, sequence, vector)"
    msg, path = error(tmp_path, {"name": "x"})
    assert msg == (f"{path}: missing key 'heads' (a mapping from tensor kind - feature_map, channels_last, "
                   f"sequence, vector - to a head config)")
    msg, path = error(tmp_path, "- just\n- a list\n")
    assert msg == f"{path}: a policy must be a mapping with the key 'heads', got a list of 2 items"
    msg, path = error(tmp_path, {"heads": {"vector": "mlp"}})
    assert msg == f"{path}: heads.vector must be a mapping, got 'mlp'"


def test_missing_kind_names_policy_kind_shape_and_the_way_out():
    policy = load_policy("infopro")
    with pytest.raises(PolicyError) as e:
        policy.config_for(spec((8, 17, 96), name="encoder_layer_3"))
    assert str(e.value) == (
        f"policy 'infopro' has no head for sequence tensors (N x L x D), needed for boundary 'encoder_layer_3' "
        f"of shape (8, 17, 96); it has heads for: feature_map, channels_last, vector. Use policy='auto', or add a "
        f"'sequence:' entry under 'heads:' in {policies.path('infopro')}")


def test_a_number_too_long_for_python_names_its_key(tmp_path):
    long = "9" * 10_000  # over Python's int-string conversion limit (4300 digits)
    msg, path = error(tmp_path, f"heads:\n  vector:\n    type: mlp\n    hidden: {long}\n")
    assert msg == (f"{path}: heads.vector.hidden must be an integer from 1 to 1048576 (a width x width layer this "
                   f"wide holds 4 TiB of parameters), got an integer of 10,000 digits")
    msg, path = error(tmp_path, f"name: {long}\nheads:\n  vector:\n    type: mlp\n")
    assert msg == f"{path}: name must be a string, got an integer of 10,000 digits"
    # a hexadecimal one converts, but is too long to print
    msg, path = error(tmp_path, f"heads:\n  vector:\n    type: mlp\n    depth: 0x{long}\n")
    assert msg.endswith("heads.vector.depth must be an integer from 0 to 1024 (deeper than ResNet-1001's trunk), got "
                        "an integer of 12,042 digits")


SECRET = "token-0123456789abcdefghijklmnopqrstuvwxyz"


@pytest.mark.parametrize(("content", "found"), [
    (f"{SECRET}\n", "a policy must be a mapping with the key 'heads', got text of 42 characters"),
    (f"{SECRET}: {SECRET}\nother: 1\n", "missing key 'heads' (a mapping from tensor kind - feature_map, "
                                          "channels_last, sequence, vector - to a head config)"),
    (f"- {SECRET}\n- x\n", "a policy must be a mapping with the key 'heads', got a list of 2 items"),
    (f"key: *{SECRET}\n", "not valid YAML at line 1, column 6: found undefined alias a name in the file; fix the "
                           "file's syntax"),
    (f"{SECRET}: [\n", "not valid YAML at line 2, column 1: expected the node content, but found '<stream end>'; "
                        "fix the file's syntax"),
])
def test_errors_on_any_file_quote_none_of_it(tmp_path, content, found):
    path = tmp_path / "secret.txt"
    path.write_text(content)
    with pytest.raises(PolicyError) as e:
        load_policy(str(path))
    assert str(e.value) == f"{path}: {found}"


def test_bad_yaml_names_the_file(tmp_path):
    msg, path = error(tmp_path, "heads:\n  vector: {type: mlp\n")
    assert msg.startswith(f"{path}: not valid YAML at line 3, column 1: ")
    assert msg.endswith("; fix the file's syntax")


def test_unknown_policy_name_lists_the_shipped_ones():
    with pytest.raises(PolicyError) as e:
        load_policy("nope")
    assert str(e.value) == ("unknown policy 'nope': not a shipped policy (auto, dgl, infopro, lm, man, mlp, vit, "
                            "vit_deep) nor a file; "
                            "pass a shipped name, the path to a policy YAML file, or a callable "
                            "fn(spec, num_classes) -> nn.Module")
    with pytest.raises(PolicyError, match="got 3"):
        load_policy(3)


def test_tensor_kind():
    assert [tensor_kind(kind_spec(k)) for k in SHAPES] == list(SHAPES)
    with pytest.raises(PolicyError, match=r"shape \(8, 3, 4, 4, 4\) is 5-D.*policy callable"):
        tensor_kind(spec((8, 3, 4, 4, 4)))


def test_a_user_yaml_file_works_end_to_end(tmp_path):
    path = write(tmp_path, "name: mine\nheads:\n  vector: {type: mlp, hidden: 32, depth: 2}\n"
                           "loss: {classification_weight: 0.5}\n")
    policy = load_policy(str(path))
    assert load_policy(policy) is policy
    head, config = make_head(policy, spec((8, 20)), 7)
    assert config["hidden"] == 32 and config["loss"]["classification_weight"] == 0.5
    assert sum(isinstance(m, nn.Linear) for m in head.modules()) == 3
    h, y = torch.randn(8, 20), torch.randint(0, 7, (8,))
    torch.testing.assert_close(head_loss(head, h, y), 0.5 * F.cross_entropy(head(h), y))


def test_a_user_callable_works_end_to_end():
    def my_head(s, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(s.shape[1:]), num_classes))

    policy = load_policy(my_head)
    assert policy.name.endswith("my_head") and policy.builder is my_head
    s = spec((8, 4, 5, 6, 7))  # 5-D: only a callable can serve it
    head, config = make_head(policy, s, 10)
    assert config == {"type": "callable", "name": policy.name}
    h, y = torch.randn(s.shape), torch.randint(0, 10, (8,))
    torch.testing.assert_close(head_loss(head, h, y), F.cross_entropy(head(h), y))
    with pytest.raises(PolicyError, match="must return an nn.Module"):
        make_head(load_policy(lambda s, n: None), s, 10)


def test_hand_edited_configs_are_validated_by_build_head():
    s = spec(SHAPES["feature_map"])
    config = {**load_policy("dgl").config_for(s), "widht": 3}
    with pytest.raises(PolicyError) as e:
        build_head(config, s, 10)
    assert str(e.value) == ("head config: unknown key 'widht' "
                            "(allowed: depth, hidden, loss, max_width, pool, type, width)")
    with pytest.raises(PolicyError) as e:
        build_head({"type": "token"}, s, 10)
    assert str(e.value) == ("head config: type 'token' cannot read the feature_map boundary 'h' of shape "
                            "(8, 64, 16, 16) (it reads sequence, channels_last); use type conv or infopro or "
                            "mlp or momentum")
    with pytest.raises(PolicyError) as e:
        build_head({"type": "conv", "loss": {"classification_weight": "high"}}, s, 10)
    assert str(e.value) == "head config: loss.classification_weight must be a number >= 0, got 'high'"


@pytest.mark.parametrize("name", SHIPPED)
def test_heads_construct_on_the_meta_device(name):
    policy = load_policy(name)
    with torch.device("meta"):
        for kind in policy.heads:
            head, _ = make_head(policy, kind_spec(kind), 10, INPUT_SHAPE)
            assert all(p.is_meta for p in head.parameters())
            assert head(torch.empty(SHAPES[kind])).shape == (8, 10)


def test_dgl_head_costs_more_after_an_early_wide_map_than_after_a_late_narrow_one():
    def flops(shape):
        head, _ = make_head(load_policy("dgl"), spec(shape), 10)
        with FlopCounterMode(display=False) as counter:
            head(torch.randn(shape))
        return counter.get_total_flops()

    early, late = flops((8, 64, 32, 32)), flops((8, 256, 4, 4))
    assert early > 2 * late > 0


def test_a_plan_files_policy_path_to_any_file_is_refused_quoting_none_of_it(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback
        plan = ppll_compile.plan(model, 2, example_inputs=(x,), devices=["cpu", "cpu"], profile="flops")
    secret = tmp_path / "id_key"
    secret.write_text(f"{SECRET}\n")
    saved = tmp_path / "plan.json"
    plan.save(str(saved))
    saved.write_text(saved.read_text().replace('"policy": "auto"', f'"policy": "{secret}"'))
    with pytest.raises(PolicyError) as e:
        ppll_compile.compile(model, example_inputs=(x,), plan=str(saved), devices=["cpu", "cpu"])
    assert str(e.value) == f"{secret}: a policy must be a mapping with the key 'heads', got text of 42 characters"

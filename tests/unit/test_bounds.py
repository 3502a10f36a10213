"""Every size a user writes in a policy or plan file is bounded by what a device could hold: a bad value is refused
when the file is read, naming the file, the field, the value and the bound, before anything is built; files too big
or nested too deep are refused with a message, and ppll-plan says so in one line."""

import copy
import json
import textwrap

import pytest
import torch
from torch import nn

import ppll_compile
import ppll_compile.cli.command
from ppll_compile import Plan, PlanError, PolicyError
from ppll_compile.cli.command import main
from ppll_compile.cli.model_file import load_model
from ppll_compile.errors import ModelFileError
from ppll_compile.heads.build import build_head
from ppll_compile.heads.policy import check_plan_heads, load_policy
from ppll_compile.heads.types import head_type
from ppll_compile.plans.specs import TensorSpec
from tests.helpers import Net, cli_error, policy_file

W = "an integer from {low} to 1048576 (a width x width layer this wide holds 4 TiB of parameters)"
D = "an integer from {low} to 1024 (deeper than ResNet-1001's trunk)"
S = "an integer from {low} to 256 (more than the side of any map a head reads)"
EVERY = "an integer from 1 to 1000000 (more steps than a training run takes)"
RATIO = "a number > 0 and at most 64 (ViT's MLP is 4 x D wide)"

# (where in the policy, head config, option, what it must be, the value written)
OPTIONS = [
    ("feature_map", {"type": "conv"}, "depth", D.format(low=0), 2**70),
    ("feature_map", {"type": "conv"}, "depth", D.format(low=0), 10**6),
    ("feature_map", {"type": "conv"}, "width", W.format(low=0), 2**40),
    ("feature_map", {"type": "conv"}, "max_width", W.format(low=0), 2**21),
    ("feature_map", {"type": "conv"}, "pool", S.format(low=1), 10**6),
    ("feature_map", {"type": "conv"}, "hidden", W.format(low=0), 2**30),
    ("feature_map", {"type": "infopro"}, "width", W.format(low=1), 2**62),
    ("feature_map", {"type": "infopro"}, "cls_width", W.format(low=0), 2**21),
    ("feature_map", {"type": "infopro"}, "cls_stride", S.format(low=0), 257),
    ("feature_map", {"type": "infopro"}, "hidden", W.format(low=1), 0),
    ("vector", {"type": "mlp"}, "hidden", W.format(low=1), 2**70),
    ("vector", {"type": "mlp"}, "depth", D.format(low=0), 1025),
    ("sequence", {"type": "momentum"}, "depth", D.format(low=1), 2**70),
    ("sequence", {"type": "momentum"}, "every", EVERY, 10**7),
    ("sequence", {"type": "transformer"}, "depth", D.format(low=0), 2**70),
    ("sequence", {"type": "transformer"}, "heads", W.format(low=0), 2**21),
    ("sequence", {"type": "transformer"}, "mlp_ratio", RATIO, 1e30),
    ("per_token", {"type": "lm"}, "rank", W.format(low=0), 2**70),
    ("feature_map", {"type": "conv"}, "depth", D.format(low=0), True),
    ("feature_map", {"type": "conv"}, "width", W.format(low=0), 64.0),
]


def refused(path):
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    return str(e.value)


def policy_of(where, config):
    return {"per_token": config, "heads": {"sequence": {"type": "token"}}} if where == "per_token" else \
        {"heads": {where: config}}


@pytest.mark.parametrize("where, config, option, expected, value", OPTIONS,
                         ids=[f"{c['type']}.{o}={v!r:.12}" for _, c, o, _, v in OPTIONS])
def test_each_head_size_option_names_the_file_the_field_the_value_and_the_bound(tmp_path, where, config, option,
                                                                                expected, value):
    path = policy_file(tmp_path, policy_of(where, {**config, option: value}))
    field = "per_token" if where == "per_token" else f"heads.{where}"
    assert refused(path) == f"{path}: {field}.{option} must be {expected}, got {value!r}"


def test_the_largest_values_are_accepted(tmp_path):
    path = policy_file(tmp_path, {"heads": {"feature_map": {"type": "conv", "depth": 1024, "width": 16, "pool": 256},
                                            "vector": {"type": "mlp", "hidden": 2**20, "depth": 1}}})
    policy = load_policy(path)
    assert policy.heads["feature_map"]["depth"] == 1024 and policy.heads["vector"]["hidden"] == 2**20


def test_depth_2_70_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    def no_layers(*args, **kwargs):
        raise AssertionError("a layer was built")

    monkeypatch.setattr(nn, "Conv2d", no_layers)
    path = policy_file(tmp_path, {"heads": {"feature_map": {"type": "conv", "depth": 2**70}}})
    assert refused(path) == (f"{path}: heads.feature_map.depth must be an integer from 0 to 1024 (deeper than "
                             f"ResNet-1001's trunk), got 1180591620717411303424")


def test_a_head_too_big_for_the_largest_device_gives_its_parameters_and_bytes(tmp_path):
    w = 2**17  # two conv3x3 layers: 9 w + 2 w (from one channel), 9 w^2 + 2 w, then Linear(4 w, 1)
    count = 11 * w + 9 * w * w + 2 * w + 4 * w + 1
    path = policy_file(tmp_path, {"heads": {"feature_map": {"type": "conv", "width": w, "depth": 2}}})
    assert count == 154_621_050_881
    assert refused(path) == (
        f"{path}: heads.feature_map: a head of type conv with width 131072, max_width 0, depth 2, pool 2, hidden 0 "
        f"has at least 154,621,050,881 parameters on any boundary, 576.0 GiB in float32, more than the 178.8 GiB of "
        f"the largest device (mi300x); make it narrower or shallower")
    path = policy_file(tmp_path, {"heads": {"vector": {"type": "mlp", "hidden": 2**19, "depth": 3}}})
    assert refused(path).startswith(f"{path}: heads.vector: a head of type mlp with hidden 524288, depth 3 has at "
                                    f"least 549,758,435,329 parameters on any boundary, 2.0 TiB in float32")


SMALL = [  # (kind, boundary shape, input shape, config): heads whose least_params is their exact size at one channel
    ("feature_map", (2, 1, 6, 6), None, {"type": "conv", "width": 5, "depth": 3, "pool": 2, "hidden": 7}),
    ("feature_map", (2, 1, 6, 6), None, {"type": "conv", "width": 0, "depth": 0, "pool": 3, "hidden": 0}),
    ("feature_map", (2, 1, 6, 6), (2, 1, 6, 6), {"type": "infopro", "width": 4, "cls_width": 3, "hidden": 5,
                                                 "mean": [0.5], "std": [0.5]}),
    ("vector", (2, 1), None, {"type": "mlp", "hidden": 6, "depth": 2}),
    ("sequence", (2, 3, 2), None, {"type": "transformer", "depth": 2, "heads": 2, "mlp_ratio": 3.0}),
]


@pytest.mark.parametrize("kind, shape, input_shape, config", SMALL, ids=[c["type"] for *_, c in SMALL])
def test_the_least_parameters_are_those_of_the_head_on_a_one_channel_boundary(kind, shape, input_shape, config):
    spec = TensorSpec(name="x", shape=shape, dtype="float32", bytes=4 * torch.Size(shape).numel())
    head = build_head(config, spec, 1, input_shape)
    options = {k: o.default for k, o in head_type(config["type"]).options.items()} | config
    assert head_type(config["type"]).least_params(options) == sum(p.numel() for p in head.parameters())


def test_the_lm_head_least_parameters_match_its_build():
    spec = TensorSpec(name="x", shape=(2, 3, 1), dtype="float32", bytes=24)
    for rank in (0, 5):
        head = build_head({"type": "lm", "rank": rank}, spec, 1, per_token=True)
        assert head_type("lm").least_params({"rank": rank}) == sum(p.numel() for p in head.parameters())


def test_a_deeply_nested_policy_is_refused_with_a_message(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text("heads: " + "[" * 20000 + "]" * 20000 + "\n")
    assert refused(path) == (f"{path}: the policy is nested deeper than the YAML reader can follow (a policy nests a "
                             f"few levels: section, entry, option); pass the right file, or flatten it")


def test_a_policy_over_one_mib_is_refused_unread(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:
        f.truncate(2**20 + 1)  # sparse: nothing written, nothing read
    assert refused(path) == (f"{path}: the policy file is 1.0 MiB, over the 1.0 MiB a policy may take (a policy is a "
                             f"few configs; the shipped ones are under 4 KiB); pass the right file, or trim it")


# -- plan files ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good() -> dict:
    """A 2-stage plan of :class:`Net`, as a plan file's mapping."""
    made = ppll_compile.plan(Net(), 2, example_inputs=(torch.randn(2, 3, 4, 4),), devices=["cpu", "cpu"],
                             profile="flops", split_points=["a"])
    return made.to_dict()


def _set(d, path, value):
    *parents, last = path
    for key in parents:
        d = d[key]
    d[last] = value


PLAN_FIELDS = [
    (("stages", 0, "replicas"), 2**70, "stages[0].replicas must be an integer from 1 to 4096 (the most devices a plan "
                                       "may use), got 1180591620717411303424"),
    (("stages", 1, "replicas"), 0, "stages[1].replicas must be an integer from 1 to 4096 (the most devices a plan may "
                                   "use), got 0"),
    (("stages", 0, "replicas"), 2.0, "stages[0].replicas must be an integer from 1 to 4096 (the most devices a plan "
                                     "may use), got 2.0"),
    (("batch_size",), 2**70, "batch_size must be an integer from 1 to 2147483647 (torch indexes a batch with 32-bit "
                             "integers), got 1180591620717411303424"),
    (("num_classes",), 2**30, "num_classes must be an integer from 1 to 16777216 (64 x the largest vocabulary of "
                              "today's models), got 1073741824"),
    (("gpus_per_node",), 10**6, "gpus_per_node must be an integer from 1 to 4096 (the most devices a plan may use), "
                                "got 1000000"),
    (("inputs", 0, "shape", 1), 2**70, "inputs[0].shape[1] must be an integer from 0 to 4611686018427387904 (a "
                                       "dimension's length), got 1180591620717411303424"),
    (("stages", 0, "boundary", 0, "shape", 2), -1, "stages[0].boundary[0].shape[2] must be an integer from 0 to "
                                                   "4611686018427387904 (a dimension's length), got -1"),
    (("stages", 0, "boundary", 0, "bytes"), 2**50, "stages[0].boundary[0].bytes must be an integer from 0 to "
                                                   "192000000000 (178.8 GiB, the memory of the largest device, "
                                                   "mi300x), got 1125899906842624"),
]
WAY_OUT = "; fix the plan file, or re-create it with `ppll-plan MODEL.py --yaml plan.yaml`"


@pytest.mark.parametrize("path, value, message", PLAN_FIELDS, ids=[".".join(map(str, p)) for p, _, _ in PLAN_FIELDS])
def test_each_plan_size_names_the_field_the_value_and_the_bound(good, tmp_path, path, value, message):
    d = copy.deepcopy(good)
    _set(d, path, value)
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(d))
    with pytest.raises(PlanError) as e:
        Plan.load(file)
    assert str(e.value) == f"{file}: {message}{WAY_OUT}"


def test_replicas_add_up_to_at_most_4096_devices(good):
    d = copy.deepcopy(good)
    d["stages"][0]["replicas"] = d["stages"][1]["replicas"] = 3000
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert str(e.value) == ("the stages' replicas add up to 6000 devices, more than 4096, the most a plan may use; "
                            "lower stages[*].replicas")
    d["stages"] = [{}] * 4097
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert str(e.value) == ("stages lists 4097 stages, more than 4096, the most devices a plan may use (one device a "
                            "stage); merge stages")


def test_a_batch_whose_inputs_exceed_the_largest_device_gives_the_bytes(good):
    d = copy.deepcopy(good)
    d["batch_size"] = 2**30  # 3 x 4 x 4 float32 = 192 bytes an example
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert str(e.value) == ("batch_size 1073741824 makes the inputs alone 192.0 GiB (192 bytes an example), more than "
                            "the 178.8 GiB of the largest device (mi300x); plan a smaller batch")


def test_a_plan_head_config_is_bounded_with_its_stage(good):
    d = copy.deepcopy(good)
    d["stages"][0]["head"]["config"] = {"type": "conv", "depth": 2**70}
    with pytest.raises(PolicyError) as e:
        check_plan_heads(d, "plan.yaml")
    assert str(e.value) == ("plan.yaml: stages[0].head.config.depth must be an integer from 0 to 1024 (deeper than "
                            "ResNet-1001's trunk), got 1180591620717411303424")
    d["stages"][0]["head"]["config"].update(depth=2, width=2**17)
    with pytest.raises(PolicyError, match=r"^plan.yaml: stages\[0\].head.config: a head of type conv with width "
                                          r"131072, max_width 0, depth 2, pool 2, hidden 0 has at least "
                                          r"154,621,050,881 parameters"):
        check_plan_heads(d, "plan.yaml")


def test_a_deeply_nested_or_huge_plan_file_is_refused(tmp_path):
    for name, text in (("nested.yaml", "stages: " + "[" * 20000 + "]" * 20000),
                       ("nested.json", '{"stages": ' + "[" * 200000 + "]" * 200000 + "}")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(PlanError) as e:
            Plan.load(path)
        assert str(e.value) == (f"{path}: the plan is nested deeper than the reader can follow (a plan nests a few "
                                f"levels: stages, a stage's head, its config); pass a plan written by `ppll-plan "
                                f"MODEL.py --yaml plan.yaml`")
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:
        f.truncate(64 * 2**20 + 1)
    with pytest.raises(PlanError) as e:
        Plan.load(path)
    assert str(e.value) == (f"{path}: the plan file is 64.0 MiB, over the 64.0 MiB a plan may take (a plan lists each "
                            f"traced node once or twice: about 50 MiB for a million nodes); pass a plan written by "
                            f"`ppll-plan MODEL.py --yaml plan.yaml` (or --json)")


# -- ppll-plan ----------------------------------------------------------------------------------------------------

MODEL = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

def example_inputs():
    return (torch.randn(2, 3, 4, 4),)
"""


def test_ppll_plan_prints_no_cpp_frames(tmp_path, capsys, monkeypatch):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(MODEL))
    frames = "\nException raised from compute at aten/src/ATen/native/X.cpp:12 (most recent call first):\n" + \
        "".join(f"frame #{i}: c10::f{i}() + 0x{i}\n" for i in range(25))

    def torch_error(kind):
        def fail(*args, **kwargs):
            raise kind("Storage size calculation overflowed with sizes=[4, 2]" + frames)
        return fail

    monkeypatch.setattr(ppll_compile.cli.command, "plan", torch_error(RuntimeError))
    assert cli_error([model, "--gpus", "2"], capsys, status=1) == (
        "ppll-plan: internal error: RuntimeError: Storage size calculation overflowed with sizes=[4, 2]; rerun with "
        "--debug for the traceback\n")
    monkeypatch.setattr(ppll_compile.cli.command, "plan", torch_error(ValueError))
    assert cli_error([model, "--gpus", "2"], capsys) == (
        "ppll-plan: error: Storage size calculation overflowed with sizes=[4, 2]\n")
    huge = tmp_path / "huge.py"
    huge.write_text("from torch import nn\n\ndef build_model():\n    raise RuntimeError('too big' + " + repr(frames) +
                    ")\n\ndef example_inputs():\n    return ()\n")
    assert cli_error([huge, "--gpus", "2"], capsys) == (
        f"ppll-plan: error: build_model() in {huge} raised RuntimeError: too big\n")


def test_a_model_file_error_carries_no_cpp_frames(tmp_path):
    path = tmp_path / "huge.py"
    path.write_text("import torch\n\ndef build_model():\n    return torch.nn.Linear(2**62, 4)\n\n"
                    "def example_inputs():\n    return ()\n")
    torch_message = "Storage size calculation overflowed with sizes=[4, 4611686018427387904]"
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    assert str(e.value) == f"build_model() in {path} raised RuntimeError: {torch_message}"
    path.write_text("def build_model():\n    raise RuntimeError('too big\\nException raised from f at x.cpp:1\\n"
                    "frame #0: c10::f()')\n")
    with pytest.raises(ModelFileError) as e:
        load_model(path)
    assert str(e.value) == f"build_model() in {path} raised RuntimeError: too big"


FLAGS = [
    ("--gpus", "a positive integer, at most 4096 (the most devices a plan may use)"),
    ("--gpus-per-node", "a positive integer, at most 4096 (the most devices a plan may use)"),
    ("--batch-size", "a positive integer, at most 2147483647 (torch's 32-bit batch indices)"),
    ("--num-classes", "a positive integer, at most 16777216 (64 x the largest vocabulary)"),
    ("--steps", "a positive integer, at most 1000000 (more batches take minutes to simulate)"),
    ("--queue-depth", "a positive integer, at most 1000000 (more batches take minutes to simulate)"),
]


@pytest.mark.parametrize("flag, expected", FLAGS, ids=[f for f, _ in FLAGS])
def test_ppll_plan_flags_are_bounded(capsys, flag, expected):
    assert main(["model.py", flag, str(2**70)]) == 2
    _, err = capsys.readouterr()
    assert err.endswith(f"ppll-plan: error: argument {flag}: invalid value '{2**70}'; expected {expected}\n")


def test_ppll_plan_replicas_flag_is_bounded(capsys):
    assert main(["model.py", "--replicas", f"1,{2**70}"]) == 2
    _, err = capsys.readouterr()
    assert err.endswith(f"ppll-plan: error: argument --replicas: invalid replicas '1,{2**70}'; expected auto, none, a "
                        f"cap (e.g. 2) or one count per stage (e.g. 1,2), each from 1 to 4096 (the most devices)\n")


def test_a_head_too_big_on_its_boundary_is_refused_when_built_on_the_meta_device():
    spec = TensorSpec(name="x", shape=(2, 16384, 2, 2), dtype="float32", bytes=2 * 16384 * 4 * 4)
    count = 100 * (9 * 16384**2 + 2 * 16384) + 16384 * 4 + 1  # conv3x3-BN layers keeping 16384 channels, Linear
    with torch.device("meta"), pytest.raises(PolicyError) as e:
        build_head({"type": "conv", "width": 0, "depth": 100}, spec, 1)
    assert str(e.value) == (f"head type 'conv' on the boundary of shape (2, 16384, 2, 2) has {count:,} parameters, "
                            f"900.0 GiB in float32, more than the 178.8 GiB of the largest device (mi300x); make it "
                            f"narrower or shallower")


def test_a_plan_file_given_to_plan_is_bounded_as_ppll_plan_reads_it(good, tmp_path):
    """``plan(model, plan=file)`` reads the file through the same checks as ``Plan.load`` and ``ppll-plan --plan``."""
    d = copy.deepcopy(good)
    d["stages"][0]["replicas"] = 2**70
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(d))
    with pytest.raises(PlanError) as e:
        ppll_compile.plan(Net(), 2, example_inputs=(torch.randn(2, 3, 4, 4),), plan=file)
    assert str(e.value) == f"{file}: {PLAN_FIELDS[0][2]}{WAY_OUT}"
    d = copy.deepcopy(good)
    d["stages"][0]["head"]["config"] = {"type": "conv", "depth": 2**70}
    file.write_text(json.dumps(d))
    with pytest.raises(PolicyError) as e:
        ppll_compile.plan(Net(), 2, example_inputs=(torch.randn(2, 3, 4, 4),), plan=file)
    assert str(e.value) == (f"{file}: stages[0].head.config.depth must be an integer from 0 to 1024 (deeper than "
                            "ResNet-1001's trunk), got 1180591620717411303424")

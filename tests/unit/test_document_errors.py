"""Plan files and distillation policies that are other files, or hold a number too long to read: errors that name the
file and the key, quoting nothing of the file; and the planner's CPU-fallback warning at the user's line."""

import json
import re
import warnings

import pytest
import torch
import yaml
from torch import nn

import ppll_compile
from ppll_compile import Plan, PlanError, PolicyError
from ppll_compile.documents import LongNumber, load_json, load_yaml
from ppll_compile.pipebd.policy import load_distill_policy
from ppll_compile.plans.file import read_plan_document

SECRET = "sk-live-4f9a2c71e0b8d35a"
"""A secret-looking string that the files below hold and no error may quote."""
LONG = "9" * 10_000  # over Python's int-string conversion limit (4300 digits)
X = torch.randn(4, 6)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture(scope="module")
def saved() -> dict:
    """A 2-stage plan of :func:`_mlp` as a plain mapping (planned once for the module)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the stages run on the CPU
        return ppll_compile.plan(_mlp(), gpus=2, example_inputs=(X,)).to_dict()


WAY_OUT = "pass a plan written by `ppll-plan MODEL.py --yaml plan.yaml` (or --json)"
NOT_PLANS = [  # (file name, content, error after the path)
    ("env.yaml", f"API_KEY: {SECRET}\n  token: [{SECRET}\n",
     f"not valid YAML at line 2, column 8: mapping values are not allowed here; fix the file's syntax, or {WAY_OUT}"),
    ("alias.yaml", f"key: *{SECRET}\n",
     (f"not valid YAML at line 1, column 6: found undefined alias a name in the file; fix the file's syntax, or "
     f"{WAY_OUT}")),
    ("tag.yaml", f"key: !{SECRET} 1\n",
     ("not valid YAML at line 1, column 6: could not determine a constructor for the tag a name in the file; fix "
     f"the file's syntax, or {WAY_OUT}")),
    ("env.json", f'{{"API_KEY": "{SECRET}",}}',
     (f"not valid JSON at line 1, column 40: Expecting property name enclosed in double quotes; fix the file's "
     f"syntax, or {WAY_OUT}")),
    ("key.yaml", f"{SECRET}\n", f"a plan must be a mapping, got text of 24 characters; {WAY_OUT}"),
    ("keys.json", json.dumps([SECRET, SECRET]), f"a plan must be a mapping, got a list of 2 items; {WAY_OUT}"),
    ("version.yaml", f"version: {SECRET}\nstages: []\n",
     ("plan version text of 24 characters is not supported; this ppll-compile reads version 1 (re-create the plan "
     "with `ppll-plan MODEL.py --yaml plan.yaml`)")),
]


@pytest.mark.parametrize(("name", "content", "message"), NOT_PLANS, ids=[n for n, _, _ in NOT_PLANS])
def test_a_plan_file_that_is_another_file_is_refused_quoting_none_of_it(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PlanError) as e:
        Plan.load(path)
    assert str(e.value) == f"{path}: {message}"
    assert SECRET not in str(e.value) and "sk-live" not in str(e.value)


@pytest.mark.parametrize("name", ["env.yaml", "alias.yaml", "tag.yaml"])
def test_a_plan_path_that_is_not_yaml_is_refused_by_the_planner_quoting_none_of_it(tmp_path, name):
    path = tmp_path / name
    _, content, message = next(p for p in NOT_PLANS if p[0] == name)
    path.write_text(content)
    with pytest.raises(PlanError) as e:  # read_saved_plan reads every plan file as YAML (JSON is YAML too)
        read_plan_document(path)
    assert str(e.value) == f"{path}: {message}"
    with pytest.raises(PlanError, match=re.escape(f"{path}: not valid YAML at line")) as e:
        ppll_compile.plan(_mlp(), plan=path)
    assert SECRET not in str(e.value)


def test_a_plan_files_count_that_is_text_is_described_not_quoted(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(f"stages: [{{replicas: {SECRET}}}]\n")
    with pytest.raises(PlanError) as e:
        read_plan_document(path)
    assert str(e.value) == (f"{path}: stages[0].replicas must be an integer from 1 to 4096 (the most devices a plan "
                            f"may use), got text of 24 characters; fix the plan file, or re-create it with "
                            f"`ppll-plan MODEL.py --yaml plan.yaml`")


def _long(saved: dict, suffix: str, tmp_path, at: tuple) -> str:
    """The plan ``saved`` written as ``suffix`` with the 10,000-digit number at the field ``at``; its path."""
    d = json.loads(json.dumps(saved))
    target = d
    for key in at[:-1]:
        target = target[key]
    target[at[-1]] = 12345
    text = json.dumps(d, indent=1) if suffix == ".json" else yaml.safe_dump(d, sort_keys=False)
    path = tmp_path / f"plan{suffix}"
    path.write_text(text.replace("12345", LONG))
    return path


LONG_FIELD = "is an integer of 10,000 digits, more than the 4,300 digits Python reads from text, and no plan value is " \
             "that long; fix the plan file, or re-create it with `ppll-plan MODEL.py --yaml plan.yaml`"


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.parametrize(("at", "named"), [
    (("stages", 0, "flops_fwd"), "stages[0].flops_fwd"),
    (("batch_size",), "batch_size"),
    (("stages", 0, "head", "config", "width"), "stages[0].head.config.width"),
], ids=["stage-figure", "batch-size", "head-option"])
def test_a_ten_thousand_digit_number_in_a_plan_file_names_its_key(saved, tmp_path, suffix, at, named):
    path = _long(saved, suffix, tmp_path, at)
    message = f"{path}: {named} {LONG_FIELD}"
    with pytest.raises(PlanError) as e:
        Plan.load(path)
    assert str(e.value) == message
    with pytest.raises(PlanError) as e:
        ppll_compile.plan(_mlp(), plan=path)
    assert str(e.value) == message


def test_documents_are_read_as_json_and_yaml_read_them_but_for_long_numbers(saved, tmp_path):
    text, yaml_text = json.dumps(saved), yaml.safe_dump(saved)
    assert load_json(text) == json.loads(text) == saved and load_yaml(yaml_text) == yaml.safe_load(yaml_text) == saved
    (tmp_path / "plan.json").write_text(text)  # as JSON: YAML 1.1 reads the calibration's 1e-06 as text
    assert read_plan_document(tmp_path / "plan.json") == saved
    assert repr(load_json(f'{{"a": [{LONG}]}}')["a"][0]) == "an integer of 10,000 digits"
    assert isinstance(load_yaml(f"a: -{LONG}")["a"], LongNumber)
    assert load_json(f'[{"9" * 4300}]') == [int("9" * 4300)]  # at the limit: read


DISTILL_WAY_OUT = "pass a shipped name (kl, mse, pipebd) or a distillation policy file"


@pytest.mark.parametrize(("content", "message"), [
    (f"API_KEY: {SECRET}\nTOKEN: {SECRET}\n",
     ("not a distillation policy: a mapping of 2 keys with neither 'loss' nor 'last' and keys other than name, "
     f"description, loss and last; {DISTILL_WAY_OUT}")),
    (f"- {SECRET}\n", (f"a distillation policy is a mapping with 'loss:' and 'last:', got a list of 1 item; "
                      f"{DISTILL_WAY_OUT}")),
    (f"{SECRET}\n", (f"a distillation policy is a mapping with 'loss:' and 'last:', got text of 24 characters; "
                    f"{DISTILL_WAY_OUT}")),
    (f"loss: {SECRET}\n", ("loss must be a mapping with a 'type' (mse, smooth_l1, kl, soft_ce), got text of 24 "
                          "characters")),
    (f"loss: {{{SECRET}: 1}}\n", ("loss must be a mapping with a 'type' (mse, smooth_l1, kl, soft_ce), got a mapping "
                                 "of 1 key without 'type'")),
    (f"loss: {{type: smooth_l1, beta: {LONG}}}\n", ("loss.beta must be a positive number, got an integer of 10,000 "
                                                   "digits")),
], ids=["env", "list", "text", "loss-text", "loss-mapping", "long-number"])
def test_a_distillation_policy_file_that_is_another_file_is_refused_quoting_none_of_it(tmp_path, content, message):
    path = tmp_path / "policy.yaml"
    path.write_text(content)
    with pytest.raises(PolicyError) as e:
        load_distill_policy(path)
    assert str(e.value) == f"{path}: {message}"
    assert SECRET not in str(e.value)


def test_a_distillation_policys_unknown_keys_are_named(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("loss: {type: mse}\nheads: {}\n")
    with pytest.raises(PolicyError) as e:
        load_distill_policy(path)
    assert str(e.value) == f"{path}: unknown key(s) ['heads']; a distillation policy has name, description, loss and last"


def test_the_cpu_fallback_warning_points_at_the_users_line():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has enough GPUs: no fallback")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ppll_compile.plan(_mlp(), gpus=2, example_inputs=(X,))  # the user's line
    fallback = [w for w in record if "run on the CPU" in str(w.message)]
    assert [(w.filename, w.lineno) for w in fallback] == [(__file__, _line_of("# the user's line"))]


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(marker))

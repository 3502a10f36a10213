"""Hardware presets: the vendors' figures, plans priced with them and nothing timed here, the memory they refuse."""

import json
import math
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from models import conv_student, conv_teacher
from torch import nn

import ppll_compile
from ppll_compile import InfeasibleMemoryError, Plan, PlanError, PlanOptions
from ppll_compile.analysis.analyse import analyse
from ppll_compile.cli.command import main
from ppll_compile.cost import roofline
from ppll_compile.cost.hardware import NAMES, PRESETS, load_hardware
from ppll_compile.cost.oplog import COMPUTE, FAMILIES, OpLog
from ppll_compile.lower import profile
from ppll_compile.options import read_saved_plan
from ppll_compile.place import partition
from ppll_compile.plans.table import format_bytes
from tests.helpers import CONV_X, plan_quietly

GPUS = ("h100", "h200", "a100-80gb", "a100-40gb", "l40s", "mi300x")
MEMORY_GB = {"h100": 80, "h200": 141, "a100-80gb": 80, "a100-40gb": 40, "l40s": 48, "mi300x": 192}
"""Each datasheet's memory per device."""
DENSE_BF16 = {"h100": 989.5e12, "h200": 989.5e12, "a100-80gb": 312e12, "a100-40gb": 312e12, "l40s": 362.05e12,
              "mi300x": 1307.4e12}
"""Each datasheet's dense (not sparsity) bfloat16 tensor-core peak."""
KNOWN = "a100-40gb, a100-80gb, h100, h200, l40s, mi300x, cpu"

# the H100 SXM column of NVIDIA's H100 datasheet, at the fractions hardware.py assumes, written out again here
_FP32, _TF32, _HBM = 67e12, 494.5e12, 3.35e12
H100_RATES = {"matmul": 0.7 * _FP32, "attention": 0.5 * _FP32, "conv": 0.5 * _TF32, "conv_bwd": 0.4 * _TF32,
              "memory": 0.8 * _HBM, "step": 0.8 * _HBM, "math": 0.7 * _HBM, "norm": 0.5 * _HBM, "pool": 0.5 * _HBM}
H100_OVERHEAD = 5e-6


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def _deep(width: int = 64, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


X = torch.randn(8, 32)
XD = torch.randn(8, 64)


@pytest.fixture
def nothing_timed(monkeypatch, tmp_path):
    """Every way of measuring or timing on this machine raises, and no pinned or cached figures are read."""
    monkeypatch.setenv(roofline.FIGURES_ENV, str(tmp_path / "no-such-figures.json"))
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path / "cache"))

    def timed(*args, **kwargs):
        raise AssertionError("timed on this machine")
    for module, name in ((roofline, "measure_device"), (roofline, "measure_calls"), (roofline, "device_figures"),
                         (partition, "device_figures"), (partition, "time_stages"), (profile, "time_stages"),
                         (profile, "time_blocks")):
        monkeypatch.setattr(module, name, timed)


def test_every_preset_loads_with_consistent_figures():
    assert NAMES == ("a100-40gb", "a100-80gb", "h100", "h200", "l40s", "mi300x", "cpu")
    for name in GPUS:
        hw = load_hardware(name)
        fig = hw.figures
        assert hw.name == name and fig is not None and fig.source.startswith(f"preset {name} (")
        assert {f"{f}:float32" for f in FAMILIES} <= set(fig.rates) and all(r > 0 for r in fig.rates.values())
        for family in COMPUTE:  # tensor cores: half precision at least float32's rate
            assert fig.rate(family, "bfloat16") >= fig.rate(family, "float32")
            assert fig.rate(family, "float16") == fig.rate(family, "bfloat16")
        assert fig.rates["matmul:bfloat16"] == pytest.approx(0.7 * DENSE_BF16[name])  # dense, not sparsity
        assert hw.memory_bytes == fig.memory_bytes == MEMORY_GB[name] * 10 ** 9
        assert hw.intra_node_bandwidth > hw.inter_node_bandwidth > 0 and hw.gpus_per_node == 8
        assert 0 < fig.overhead < 1e-4 and fig.calls == {} and hw.sources
    assert load_hardware("h100").figures.rates == pytest.approx(
        {**{f"{f}:float32": r for f, r in H100_RATES.items()},
         **{f"{f}:{d}": 989.5e12 * {"matmul": 0.7, "attention": 0.5, "conv": 0.5, "conv_bwd": 0.4}[f]
            for f in COMPUTE for d in ("bfloat16", "float16")}})
    assert load_hardware("h100").intra_node_bandwidth == pytest.approx(0.8 * 450e9)  # NVLink 4, one direction
    assert load_hardware("a100-80gb").inter_node_bandwidth == pytest.approx(0.8 * 25e9)  # HDR 200 Gb/s
    cpu = load_hardware("cpu")
    assert cpu.local and cpu.figures is None and cpu.memory_bytes == roofline.device_memory(torch.device("cpu")) > 0


def test_a_preset_plan_times_nothing_and_prices_every_operator_by_its_roofline(nothing_timed):
    model = _mlp()
    for gpus in (1, 2):
        plan = plan_quietly(model, X, gpus=gpus, hardware="h100")
        assert plan.hardware == "h100" and plan.profile == "roofline"
        assert plan.calibration["source"] == PRESETS["h100"].figures.source
        assert plan.calibration["rates"] == PRESETS["h100"].figures.rates and plan.calibration["timed_calls"] == 0
        note = next(n for n in plan.notes if n.startswith("costs are seconds on NVIDIA H100 SXM 80GB"))
        assert note.startswith("costs are seconds on NVIDIA H100 SXM 80GB (roofline, preset h100 (NVIDIA H100 Tensor "
                               "Core GPU datasheet, Technical Specifications, H100 SXM column) figures at assumed "
                               "achievable fractions of its peaks: 693 TFLOP/s bfloat16 matmul, 47 TFLOP/s float32 "
                               "matmul, 2680 GB/s memory, 5.0 us per operator, 80 GB per device)")
        assert note.endswith("; nothing was timed on this machine")
        # the last stage: its input arrives detached; its operators as the plan recorded them, and its loss's (the
        # cross-entropy of the model's output on class labels, forward and backward)
        a = analyse(model, (X,), None, PlanOptions.make(gpus=gpus), None)
        last = plan.stages[-1]
        scores = torch.empty(a.output_spec().shape, device="meta", requires_grad=True)
        labels, seed = torch.zeros(len(scores), dtype=torch.long, device="meta"), torch.ones((), device="meta")
        with OpLog() as log:
            torch.nn.functional.cross_entropy(scores, labels).backward(seed)
        ops = a.ops([a.by_name[n] for n in last.nodes]) + log.ops
        work = sum(max(op.flops / H100_RATES[op.kind], op.bytes / H100_RATES["memory"]) if op.kind in COMPUTE
                   else op.bytes / H100_RATES[op.kind] for op in ops) + H100_OVERHEAD * len(ops)
        trained = [p for i in range(int(last.nodes[0].strip("_")), len(model)) for p in model[i].parameters()]
        step = sum(3 * p.numel() * 4 / H100_RATES["step"] + H100_OVERHEAD for p in trained)  # sgd: 3 passes
        assert last.step_cost == pytest.approx(step, rel=1e-12)
        assert last.compute_cost == pytest.approx(work + step, rel=1e-12)


def test_the_preset_sets_the_memory_cap_and_the_link_unless_given():
    plan = plan_quietly(_mlp(), X, gpus=2, hardware="h100")
    assert (plan.memory_limit, plan.link_bandwidth) == (80 * 10 ** 9, pytest.approx(0.8 * 450e9))
    given = plan_quietly(_mlp(), X, gpus=2, hardware="mi300x", memory_limit=2 ** 30, link_bandwidth=1e9)
    assert (given.memory_limit, given.link_bandwidth, given.hardware) == (2 ** 30, 1e9, "mi300x")
    default = plan_quietly(_mlp(), X, gpus=2)
    assert (default.memory_limit, default.link_bandwidth, default.hardware) == (None, 25e9, None)
    assert default.calibration["source"] == str((Path(__file__).parents[1] / "device_figures.json"))


def test_the_cpu_preset_is_this_machines_figures():
    cpu, default = plan_quietly(_mlp(), X, gpus=2, hardware="cpu"), plan_quietly(_mlp(), X, gpus=2)
    assert cpu.calibration == default.calibration  # pinned by the tests' figures, as without hardware=
    assert [s.cost for s in cpu.stages] == [s.cost for s in default.stages] and cpu.cuts == default.cuts
    assert cpu.memory_limit == roofline.device_memory(torch.device("cpu")) and cpu.link_bandwidth == 25e9


def _figures_file(tmp_path: Path, **extra) -> str:
    data = json.loads((Path(__file__).parents[1] / "device_figures.json").read_text())
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({**data, **extra}))
    return str(path)


def test_stages_that_cannot_fit_are_refused_with_the_fewest_devices_that_fit(tmp_path):
    model = _deep()
    free = plan_quietly(model, XD, gpus=4, hardware=_figures_file(tmp_path))
    cap = max(s.memory_bytes for s in free.stages)  # 4 stages fit it
    hw = _figures_file(tmp_path, memory_bytes=cap)
    with pytest.raises(InfeasibleMemoryError) as e:
        plan_quietly(model, XD, gpus=2, hardware=hw)
    m = re.fullmatch(rf"the stages cannot fit the memory of hardware='{re.escape(hw)}' \((.*) per device\) on 2 "
                     rf"device\(s\): the fewest devices that fit it is (\d+) \(gpus=\d+\); on 2 device\(s\) the "
                     rf"smallest memory_limit that works is (.*) \(pass memory_limit= to plan for devices with more "
                     rf"memory\)", str(e.value))
    assert m is not None, str(e.value)
    fewest = int(m.group(2))
    assert 2 < fewest <= 4 and m.group(1) == format_bytes(cap)
    fits = plan_quietly(model, XD, gpus=fewest, hardware=hw)
    assert fits.memory_limit == cap and max(s.memory_bytes for s in fits.stages) <= cap
    with pytest.raises(InfeasibleMemoryError, match=r"the fewest devices that fit it is \d+ "):
        plan_quietly(model, XD, gpus=fewest - 1, hardware=hw)
    # the cap it names works on 2 devices
    two = plan_quietly(model, XD, gpus=2, hardware=hw, memory_limit=math.ceil(e.value.min_limit))
    assert two.num_stages == 2
    with pytest.raises(InfeasibleMemoryError, match=r"^the stages cannot fit .* on 1 device\(s\): the fewest "):
        plan_quietly(model, XD, gpus=1, hardware=hw)
    # without hardware= the solver's own message stands
    with pytest.raises(InfeasibleMemoryError, match=r"^no partition into 2 stages fits a memory limit of "):
        plan_quietly(model, XD, gpus=2, memory_limit=cap)


def test_a_layer_larger_than_the_device_is_refused_with_the_cap_only(tmp_path):
    hw = _figures_file(tmp_path, memory_bytes=1000)
    with pytest.raises(InfeasibleMemoryError, match=r"^the stages cannot fit the memory of hardware=.* \(1000 B per "
                       r"device\) on 2 device\(s\): no number of devices fits it \(a single segment needs more\), so "
                       r"only a larger cap works; on 2 device\(s\) the smallest memory_limit that works is "):
        plan_quietly(_deep(), XD, gpus=2, hardware=hw)


def test_unknown_hardware_lists_the_presets(tmp_path):
    message = (f"unknown hardware 'h900': not a preset and no such file; known presets: {KNOWN}, or the path of a "
               f"JSON figures file (ppll_compile.calibrate(out=...) writes one)")
    with pytest.raises(PlanError, match=f"^{re.escape(message)}$"):
        plan_quietly(_mlp(), X, gpus=2, hardware="h900")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "d", "torch": "t", "rates": {"matmul:float32": 1e12}, "overhead": 1e-6}))
    with pytest.raises(PlanError, match=rf"^hardware={re.escape(str(bad))}: no positive rate for "
                                        rf"attention:float32, conv:float32, "):
        PlanOptions.make(hardware=str(bad))


def test_a_time_profile_is_refused_for_a_preset():
    with pytest.raises(ValueError, match=r"^profile='time' times the stages on this machine, but hardware='h100' "
                                         r"plans for other devices; use profile='roofline' \(the default\) to price "
                                         r"them with its figures, or drop hardware= to time them here$"):
        PlanOptions.make(hardware="h100", profile="time")
    assert PlanOptions.make(hardware="cpu", profile="time").hardware == "cpu"


def test_a_saved_plan_keeps_its_hardware(tmp_path, nothing_timed):
    plan = plan_quietly(_mlp(), X, gpus=2, hardware="a100-40gb", optimizer="adam")
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml())
    loaded = Plan.load(path)
    assert loaded == plan and loaded.hardware == "a100-40gb"
    assert read_saved_plan(path).settings["hardware"] == "a100-40gb"
    again = plan_quietly(_mlp(), X, gpus=None, plan=path)
    assert (again.hardware, again.memory_limit, again.cuts) == ("a100-40gb", 40 * 10 ** 9, plan.cuts)
    assert [s.cost for s in again.stages] == [s.cost for s in plan.stages]
    other = plan_quietly(_mlp(), X, gpus=None, plan=path,
                         hardware="h200")  # the call's hardware wins; the saved cap stays
    assert other.hardware == "h200" and other.calibration["source"].startswith("preset h200 (")


def test_a_calibrated_figures_file_plans_for_its_device(tmp_path, monkeypatch):
    monkeypatch.delenv(roofline.FIGURES_ENV, raising=False)
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(roofline.BUSY_ENV, "inf")
    out = tmp_path / "cpu.json"
    measured = ppll_compile.calibrate(threads=1, out=out)  # on a GPU: calibrate("cuda", out=...), the same path
    written = json.loads(out.read_text())
    assert written["memory_bytes"] == measured.memory_bytes == roofline.device_memory(torch.device("cpu"))
    written.update(intra_node_bandwidth=5e10, gpus_per_node=4)
    out.write_text(json.dumps(written))
    hw = load_hardware(out)
    assert (hw.name, hw.memory_bytes, hw.intra_node_bandwidth, hw.inter_node_bandwidth, hw.gpus_per_node) == (
        str(out), measured.memory_bytes, 5e10, None, 4)
    monkeypatch.setattr(roofline, "measure_calls", lambda *a, **k: pytest.fail("timed on this machine"))
    monkeypatch.setattr(partition, "device_figures", lambda *a, **k: pytest.fail("calibrated on this machine"))
    plan = plan_quietly(_mlp(), X, gpus=2, hardware=out)
    assert (plan.hardware, plan.memory_limit, plan.link_bandwidth) == (str(out), measured.memory_bytes, 5e10)
    assert plan.calibration["source"] == str(out) and plan.calibration["rates"] == measured.rates
    monkeypatch.setenv(roofline.FIGURES_ENV, str(out))  # the link fields do not stop it pinning the figures
    assert roofline.device_figures(torch.device("cpu"), 1).rates == measured.rates


TINY = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def example_inputs():
    return torch.randn(2, 8)
"""


def test_the_command_plans_for_a_preset(tmp_path, capsys, nothing_timed):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(TINY))
    assert main([str(model), "--gpus", "2", "--hardware", "l40s", "--json", "-"]) == 0
    out, _ = capsys.readouterr()
    plan = json.loads(out)
    assert (plan["hardware"], plan["memory_limit"], plan["calibration"]["device"]) == ("l40s", 48 * 10 ** 9,
                                                                                     "NVIDIA L40S 48GB")
    assert main([str(model), "--gpus", "2", "--hardware", "h900"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"ppll-plan: error: unknown hardware 'h900': not a preset and no such file; known "
                                 f"presets: {KNOWN}, or the path of a JSON figures file "
                                 f"(ppll_compile.calibrate(out=...) writes one)\n")
    assert main([str(model), "--gpus", "2", "--hardware", "h100", "--profile", "time"]) == 2
    assert capsys.readouterr().err.startswith("ppll-plan: error: --profile time times the stages on this machine, but --hardware h100 plans for other devices")
    assert main([str(model), "--gpus", "2", "--hardware", "h100", "--memory-limit", "1K"]) == 2
    assert re.fullmatch(r"ppll-plan: error: the stages cannot fit --memory-limit 1.0KiB per device \(--hardware h100\) "
                        r"on 2 device\(s\): no number of devices fits it \(a single segment needs more\), so only a "
                        r"larger cap works; on 2 device\(s\) the smallest memory_limit that works is \d+\.\d KiB "
                        r"\(pass --memory-limit to plan for devices with more memory\)\n", capsys.readouterr().err)


def test_a_distillation_plan_for_a_preset_times_nothing(nothing_timed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ppll_compile.plan(conv_student(), 2, teacher=conv_teacher(), example_inputs=(CONV_X,), hardware="h200")
    assert (plan.mode, plan.hardware, plan.memory_limit) == ("pipebd", "h200", 141 * 10 ** 9)
    assert plan.calibration["source"].startswith("preset h200 (") and plan.calibration["timed_calls"] == 0
    assert any(n.endswith("nothing was timed on this machine") for n in plan.notes)

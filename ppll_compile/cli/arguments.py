"""The ``ppll-plan`` command line: its flags grouped as ``--help`` shows them (with :class:`PlanOptions`' own
defaults, the shipped policies, partitioners and hardware), the examples and notes under them, and the ``plan()``
options the given flags make."""

from __future__ import annotations

import argparse
import os
import textwrap
from typing import Any

from ..cost.hardware import NAMES as HARDWARE_NAMES
from ..cost.optimizers import OPTIMIZERS
from ..draw.graph import DETAILS, MAX_NODES
from ..options import PROFILES, TIED, TRACERS, PlanOptions
from ..partitioners import SOLVERS
from ..plans.precision import FUSIONS, PRECISIONS
from ..policies import distill_names, names
from .model_file import TOP_LEVEL_RULE
from .values import batch as _batch
from .values import batches as _batches
from .values import classes as _classes
from .values import devices as _devices
from .values import names as _names
from .values import pairs as _pairs
from .values import parse_size as _parse_size
from .values import positive_float as _positive_float
from .values import positive_int as _positive_int
from .values import replicas as _replicas
from .values import speeds as _speeds

PROG = "ppll-plan"
"""The command's name, as its usage line and its messages give it."""
_EPILOG = """\
examples:
  ppll-plan examples/resnet32.py --gpus 4
  ppll-plan examples/resnet32.py --gpus 4 --legend    # ... and what every column of the tables means
  ppll-plan examples/vit_small.py --gpus 4 --policy vit --json -
  ppll-plan examples/resnet50.py --gpus 4 --memory-limit 16GiB --optimizer adam --yaml plan.yaml
  ppll-plan examples/resnet50.py --gpus 8 --hardware h100   # plan for 8 H100s from this machine
  ppll-plan examples/resnet50.py --plan plan.yaml --show    # re-apply a saved plan (costs as saved)
  ppll-plan examples/resnet50.py --plan plan.yaml --remeasure   # ... with its costs measured here
  ppll-plan examples/pipebd_mobilenet.py --mode pipebd --gpus 4 --policy kl
  ppll-plan examples/resnet32.py --gpus 4 --simulate --plot cost.png --graph graph.svg --gantt gantt.png
  ppll-plan --gantt measured.png --trace trace.json   # draw a timeline recorded with trainer(trace=True)
  ppll-plan --calibrate --gpus 2      # measure the device figures a 2-stage plan here uses, if not cached
  ppll-plan --recalibrate --figures figures.json   # measure them again; PPLL_DEVICE_FIGURES=figures.json pins them

calibration: the roofline profile costs operators with figures measured on the device (rates per operator
family, the time of each operator shape met), cached per device, CPU thread count and torch version in
$PPLL_CACHE_DIR/devices.json (default ~/.cache/ppll-compile). A plan on a device without cached figures
measures them first; --calibrate does it as a step of its own (the device and a CPU's threads per stage
follow --devices and --gpus, as a plan's), --recalibrate measures again and replaces them. Either warns
when the machine was busy while measuring: a 1-minute load average of 0.5 or more per core, before or after
(PPLL_BUSY_LOAD sets another threshold). Without MODEL.py nothing else is done.

{model_file}

exit status: 0 done, 2 a bad flag or file (one "ppll-plan: error:" message), 1 an internal error (--debug
prints its traceback).
"""


_MODEL_FILE = (
    "MODEL.py defines build_model() returning the nn.Module and example_inputs() returning a tuple of tensors (only "
    "their shapes and dtypes are used); module-level `model` / `example_inputs` work too. With --mode pipebd it "
    "also defines build_teacher() (or `teacher`); build_model() is the student. MODEL.py is imported, never run as "
    f"a script: {TOP_LEVEL_RULE}. A file whose top level does more (a training script: trainer.fit(...) on a line "
    "of its own, a for loop, a with block) is refused, naming the line, before any of it runs; move that work under "
    '`if __name__ == "__main__":` or into a function.')
_EPILOG = _EPILOG.replace("{model_file}", textwrap.fill(_MODEL_FILE, width=108, break_on_hyphens=False))

_DEFAULTS = PlanOptions()


def _default(name: str) -> str:
    """``(default: X)`` for a plan option, ``X`` being :class:`PlanOptions`' own default."""
    value = getattr(_DEFAULTS, name)
    if isinstance(value, float):  # 25e9, as the flag takes it
        mantissa, exponent = f"{value:e}".split("e")
        value = f"{float(mantissa):g}e{int(exponent)}"
    return f"(default: {value})"


def parser() -> argparse.ArgumentParser:
    """The ``ppll-plan`` argument parser."""
    p = argparse.ArgumentParser(
        prog=PROG, description="Compile a PyTorch model into a pipeline plan for local learning.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_file", metavar="MODEL.py", nargs="?",
                   help="Python file defining build_model() and example_inputs()")
    g = p.add_argument_group("devices")
    g.add_argument("--gpus", type=_devices, metavar="N", help="number of devices, one stage each")
    g.add_argument("--devices", type=_names, metavar="DEV,...", help="device per stage, e.g. cuda:0,cuda:1")
    g.add_argument("--device-speeds", type=_speeds, metavar="S,...", help="relative speed per device, e.g. 1,1,0.5,0.5")
    g.add_argument("--memory-limit", type=_parse_size, metavar="SIZE", help="per-device memory cap, e.g. 16GiB")
    g.add_argument("--link-bandwidth", type=_positive_float, metavar="BYTES_PER_S",
                   help=f"bytes per second between neighbouring stages {_default('link_bandwidth')}")
    g.add_argument("--flops-per-second", type=_positive_float, metavar="F", help="device throughput in FLOP/s that "
                   f"--profile flops divides by {_default('flops_per_second')}")
    presets = ", ".join(n if n != "cpu" else "cpu (this machine)" for n in HARDWARE_NAMES)
    g.add_argument("--hardware", metavar="NAME|FILE", help="plan for these devices, priced from their figures and "
                   f"nothing timed here: {presets}, or a figures file (--calibrate --figures on the training machine "
                   "writes one); its memory is the default --memory-limit, its intra-node link the default "
                   "--link-bandwidth")
    g.add_argument("--gpus-per-node", type=_devices, metavar="N",
                   help="devices per node: stage replicas take consecutive devices, device d on node d // N")
    g.add_argument("--intra-node-bandwidth", type=_positive_float, metavar="BYTES_PER_S",
                   help="bytes per second of a link inside a node (default: --link-bandwidth)")
    g.add_argument("--inter-node-bandwidth", type=_positive_float, metavar="BYTES_PER_S",
                   help="bytes per second of a link across nodes (default: --link-bandwidth)")
    g.add_argument("--replicas", type=_replicas, metavar="auto|none|N|R,...",
                   help="data-parallel replicas per stage: auto (the partitioner chooses; pipebd default), none "
                        "(ppll default), a cap N, or one count per stage")
    g = p.add_argument_group("planning")
    g.add_argument("--mode", choices=("ppll", "pipebd"), help="ppll (local learning, default) or pipebd "
                   "(blockwise distillation from MODEL.py's build_teacher())")
    g.add_argument("--blocks", type=_pairs, metavar="T:S,...", help="pipebd: name the aligned block ends, "
                   "teacher:student module pairs")
    g.add_argument("--policy", metavar="NAME|FILE", help=f"aux-head policy: a shipped name ({', '.join(names())}) "
                   f"or a YAML file {_default('policy')}; pipebd: the distillation losses ({', '.join(distill_names())}"
                   f") or a YAML file (default: pipebd)")
    g.add_argument("--batch-size", type=_batch, metavar="B", help="batch size to plan for (default: the example "
                   "inputs' first dimension)")
    g.add_argument("--partitioner", metavar="NAME",
                   help=f"exact or a baseline: {', '.join(sorted(set(SOLVERS) - {'exact'}))} {_default('partitioner')}")
    g.add_argument("--profile", choices=PROFILES, help="how stage costs are priced: roofline (every operator's FLOPs "
                   "and bytes, counted on fake tensors, over the device's calibrated figures or --hardware's), flops "
                   f"(counted FLOPs over --flops-per-second) or time (measured on the device) {_default('profile')}")
    g.add_argument("--optimizer", choices=tuple(OPTIMIZERS), help="optimizer whose state memory and step the costs "
                   f"count: plan with the one you train with {_default('optimizer')}")
    g.add_argument("--precision", choices=tuple(PRECISIONS), help="the precision the model trains in, which the costs, "
                   "memory and boundaries are priced in and the trainer's autocast follows: fp32, bf16 or fp16 (mixed "
                   f"precision: float32 weights, gradients and optimizer state) or bf16-pure {_default('precision')}")
    g.add_argument("--fusion", choices=FUSIONS, help="element-wise chains priced one operator at a time (eager) or "
                   "as one fused kernel each (fused, as torch.compile runs them) (default: fused for bf16 and fp16, "
                   "eager for fp32)")
    g.add_argument("--split-points", type=_names, metavar="A,B", help="cut by hand after these modules or nodes")
    g.add_argument("--leaf-modules", type=_names, metavar="M,...", help="submodules (qualified names, e.g. layer1.0) "
                   "that torch.fx symbolic tracing keeps opaque, one node each")
    g.add_argument("--num-classes", type=_classes, metavar="C", help="classes the aux heads predict (default: "
                   "the size of a 2-D model output)")
    g.add_argument("--tracer", choices=TRACERS, help="capture with torch.fx symbolic tracing (fx), torch.export "
                   f"(export), or auto: fx, else export {_default('tracer')}")
    g.add_argument("--tied", choices=TIED, help="a parameter used on both sides of a cut (tied embeddings): auto (drop "
                   "such cuts while enough others are left, else untie with a warning), error (drop such cuts; refuse "
                   f"when too few are left) or untie (each later stage its own copy) {_default('tied')}")
    g.add_argument("--frozen", type=_names, nargs="+", metavar="NAME", help="parameters (as "
                   "model.named_parameters() names them) or modules (all their own parameters) accepted as never "
                   "trained: a stage holding a trainable parameter that no loss of that stage reaches is refused "
                   "unless it is named here (give MODEL.py before this flag)")
    g.add_argument("--checkpoint-activations", action="store_true", default=None, help="recompute each stage's "
                   "activations in its backward instead of keeping them from its forward: less activation memory, "
                   "one more forward per step, both counted in the plan's memory and costs")
    g.add_argument("--bake-train-mode", action="store_true", default=None,
                   help="accept a forward that branches on self.training: keep the train branch in eval too")
    g.add_argument("--plan", metavar="PLAN.yaml", help="re-apply a saved (possibly hand-edited) plan to MODEL.py, "
                   "keeping its costs as saved unless it was edited, a planning flag is given or --remeasure; a "
                   "pipebd plan also loads MODEL.py's teacher")
    g.add_argument("--remeasure", action="store_true", help="with --plan: measure the saved plan's costs again on "
                   "this machine, in the profile it was made with")
    g = p.add_argument_group("output (default: --show)")
    g.add_argument("--show", action="store_true", help="print the stage table")
    g.add_argument("--legend", action="store_true", help="print what each column of the tables means, with its "
                   "units, under them (implies --show)")
    g.add_argument("--json", metavar="PATH|-", help="write the plan as JSON to PATH, or to stdout with -")
    g.add_argument("--yaml", metavar="PATH|-", help="write the plan as YAML to PATH, or to stdout with -")
    g = p.add_argument_group("simulation and pictures")
    g.add_argument("--simulate", action="store_true", help="print the simulated schedule: throughput, warm-up, "
                   "per-stage utilisation and idle time (links at --link-bandwidth)")
    g.add_argument("--steps", type=_batches, metavar="N", help="batches to simulate (default 64; --gantt: "
                   "4 per stage)")
    g.add_argument("--queue-depth", type=_batches, default=2, metavar="N",
                   help="batches a stage may hold for the next one (default 2, as the trainer)")
    g.add_argument("--cores", type=_positive_int, default=os.cpu_count() or 1, metavar="N",
                   help="CPU cores the simulated CPU stages share (default: this machine's)")
    g.add_argument("--plot", metavar="PATH.png", help="draw per-stage cost bars (fwd, bwd, aux head, all-reduce, "
                   "communication) with the bottleneck marked")
    g.add_argument("--graph", metavar="PATH.svg|png", help="draw the traced graph (a module-level summary for "
                   "big graphs) coloured by stage, cuts marked; graphviz's dot if installed, else matplotlib")
    g.add_argument("--graph-detail", choices=DETAILS, help=f"with --graph: a box per module path above "
                   f"{MAX_NODES} nodes, else per node (auto, default), always per module path (modules), or "
                   f"always per node (nodes)")
    g.add_argument("--gantt", metavar="PATH.png", help="draw the simulated timeline per stage, or with --trace "
                   "a measured one")
    g.add_argument("--trace", metavar="TRACE.json", help="with --gantt: a timeline saved by "
                   "trainer.timeline().save(); MODEL.py is then optional")
    g = p.add_argument_group("calibration (see below)")
    g.add_argument("--calibrate", action="store_true", help="measure this machine's device figures unless cached "
                   "(before planning MODEL.py, if given)")
    g.add_argument("--recalibrate", action="store_true", help="measure the device figures again and replace the "
                   "cached ones (their per-shape operator times too)")
    g.add_argument("--figures", metavar="PATH.json", help="with --calibrate or --recalibrate: also write the figures "
                   "to PATH.json, a file to pin with PPLL_DEVICE_FIGURES=PATH.json")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return p


_OPTION_FLAGS = ("gpus", "devices", "device_speeds", "memory_limit", "link_bandwidth", "flops_per_second",
                 "hardware", "policy", "batch_size", "partitioner", "profile", "optimizer", "precision", "fusion",
                 "split_points", "replicas", "tracer", "tied", "bake_train_mode", "gpus_per_node",
                 "intra_node_bandwidth", "inter_node_bandwidth", "leaf_modules", "num_classes", "frozen",
                 "checkpoint_activations")


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``plan()`` keyword arguments for the flags that were given (the rest keep their defaults)."""
    options = {name: getattr(args, name) for name in _OPTION_FLAGS if getattr(args, name) is not None}
    if "frozen" in options:  # --frozen a b,c: one tuple of names per word
        options["frozen"] = tuple(name for names in options["frozen"] for name in names)
    return options

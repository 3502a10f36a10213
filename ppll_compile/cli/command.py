"""The ``ppll-plan`` command: plan a model defined in a Python file and print or save the plan.

Example::

    ppll-plan examples/resnet32.py --gpus 4 --policy infopro --memory-limit 16GiB --yaml plan.yaml
    ppll-plan examples/resnet32.py --plan plan.yaml --show      # re-apply a (hand-edited) plan, costs as saved
    ppll-plan examples/pipebd_mobilenet.py --mode pipebd --gpus 4 # blockwise distillation
    ppll-plan examples/resnet32.py --gpus 4 --simulate --plot cost.png --graph graph.svg --gantt gantt.png
    ppll-plan --recalibrate --gpus 2 --figures figures.json         # measure this machine's figures again

MODEL.py defines ``build_model()`` and ``example_inputs()``, and for ``--mode pipebd`` also ``build_teacher()``;
:mod:`ppll_compile.cli.model_file` loads it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ..api import compile, plan
from ..cost.calibration import calibrate, summary
from ..cost.hardware import NAMES as HARDWARE_NAMES
from ..cost.optimizers import OPTIMIZERS
from ..cost.roofline import FIGURES_ENV
from ..draw.graph import DETAILS, MAX_NODES
from ..errors import PlanError, PPLLError
from ..heads.policy import check_plan_heads
from ..lower.profile import first_device
from ..options import PROFILES, TIED, TRACERS, PlanOptions, read_saved_plan
from ..partitioners import SOLVERS
from ..plans.file import read_plan_document
from ..plans.plan import Plan
from ..plans.precision import FUSIONS, PRECISIONS
from ..plans.specs import HeadSpec
from ..policies import distill_names, names
from .advice import cli_worded
from .model_file import load_model
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

_PROG = "ppll-plan"
_EPILOG = """\
examples:
  ppll-plan examples/resnet32.py --gpus 4
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

MODEL.py defines build_model() returning the nn.Module and example_inputs() returning a tuple of
tensors (only their shapes and dtypes are used); module-level `model` / `example_inputs` work too.
With --mode pipebd it also defines build_teacher() (or `teacher`); build_model() is the student.

exit status: 0 done, 2 a bad flag or file (one "ppll-plan: error:" message), 1 an internal error (--debug
prints its traceback).
"""

class _UsageError(Exception):
    """A problem with the command line, reported as ``ppll-plan: error: ...``."""


_DEFAULTS = PlanOptions()


def _default(name: str) -> str:
    """``(default: X)`` for a plan option, ``X`` being :class:`PlanOptions`' own default."""
    value = getattr(_DEFAULTS, name)
    if isinstance(value, float):  # 25e9, as the flag takes it
        mantissa, exponent = f"{value:e}".split("e")
        value = f"{float(mantissa):g}e{int(exponent)}"
    return f"(default: {value})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG, description="Compile a PyTorch model into a pipeline plan for local learning.",
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
    g.add_argument("--bake-train-mode", action="store_true", default=None,
                   help="accept a forward that branches on self.training: keep the train branch in eval too")
    g.add_argument("--plan", metavar="PLAN.yaml", help="re-apply a saved (possibly hand-edited) plan to MODEL.py, "
                   "keeping its costs as saved unless it was edited, a planning flag is given or --remeasure; a "
                   "pipebd plan also loads MODEL.py's teacher")
    g.add_argument("--remeasure", action="store_true", help="with --plan: measure the saved plan's costs again on "
                   "this machine, in the profile it was made with")
    g = p.add_argument_group("output (default: --show)")
    g.add_argument("--show", action="store_true", help="print the stage table")
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
                 "intra_node_bandwidth", "inter_node_bandwidth", "leaf_modules", "num_classes")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``plan()`` keyword arguments for the flags that were given (the rest keep their defaults)."""
    return {name: getattr(args, name) for name in _OPTION_FLAGS if getattr(args, name) is not None}


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text if text.endswith("\n") else text + "\n")
    except OSError as e:
        raise _UsageError(f"cannot write {path!r}: {e.strerror or e}; pass a writable path") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse before the (slow) model load what could not be written or drawn."""
    if args.trace is not None and args.gantt is None:
        raise _UsageError("--trace names a recorded timeline to draw; add --gantt PATH.png")
    if args.graph_detail is not None and args.graph is None:
        raise _UsageError("--graph-detail chooses what the --graph picture shows; add --graph PATH.svg")
    if args.calibrate and args.recalibrate:
        raise _UsageError("--calibrate measures the figures unless cached, --recalibrate measures them again; give "
                          "one of them")
    if args.figures is not None and not (args.calibrate or args.recalibrate):
        raise _UsageError("--figures writes the measured device figures; add --calibrate (or --recalibrate)")
    if args.remeasure and args.plan is None:
        raise _UsageError("--remeasure measures a saved plan's costs again; add --plan PLAN.yaml (without --plan "
                          "every plan is measured)")
    for flag, suffixes in (("plot", _PICTURES), ("graph", _PICTURES), ("gantt", _PICTURES)):
        target = getattr(args, flag)
        if target is not None and Path(target).suffix.lower() not in suffixes:
            raise _UsageError(f"--{flag} {target}: unknown picture format; use one of {', '.join(suffixes)}")
    for flag in ("json", "yaml", "plot", "graph", "gantt", "figures"):
        target = getattr(args, flag)
        if target is None or target == "-":
            continue
        if Path(target).is_dir():
            raise _UsageError(f"--{flag}: cannot write {target!r}: it is a directory; pass a file path")
        if not Path(target).parent.is_dir():
            raise _UsageError(f"--{flag}: cannot write {target!r}: directory {str(Path(target).parent)!r} does "
                              f"not exist; create it or pass another path")


_PICTURES = (".png", ".svg", ".pdf")


def _draw_trace(args: argparse.Namespace, err: TextIO) -> None:
    from ..draw import draw_gantt
    from ..plans.timeline import Timeline
    timeline = Timeline.load(args.trace)
    draw_gantt(timeline, args.gantt, batches=args.steps)
    err.write(f"{_PROG}: wrote {args.gantt} ({timeline.source} timeline of {len(timeline.lanes)} lanes)\n")


def _calibrate(args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    """Measure the figures of the device a plan with these flags runs on (``--recalibrate``: again), and say so."""
    device = first_device(args.devices)  # the first of --devices, else the first GPU, else the CPU
    stages = args.gpus or (len(args.devices) if args.devices else 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures = calibrate(device, stages=stages, refresh=args.recalibrate, out=args.figures)
    out.write("\n".join(f"{_PROG}: {line}" for line in summary(figures).splitlines()) + "\n")
    for message in dict.fromkeys(str(w.message) for w in caught):
        err.write(f"{_PROG}: warning: {message}\n")
    if args.figures is not None:
        err.write(f"{_PROG}: wrote {args.figures} (pin it with {FIGURES_ENV}={args.figures})\n")


def _pictures(args: argparse.Namespace, result: Plan, gm: Any, out: TextIO, err: TextIO) -> None:
    """The simulation, plots and graph (of the traced graph module ``gm``) the flags ask for."""
    from ..simulation.simulate import simulate
    if args.simulate:
        sim = simulate(result, steps=args.steps or 64, queue_depth=args.queue_depth, cores=args.cores)
        out.write("\n" + sim.table() + "\n")
    if args.plot is not None:
        from ..draw import plot_costs
        plot_costs(result, args.plot)
        err.write(f"{_PROG}: wrote {args.plot} (cost per stage, bottleneck stage {result.bottleneck_stage})\n")
    if args.graph is not None:
        from ..draw import draw_graph
        desc = draw_graph((gm, result), args.graph, detail=args.graph_detail or "auto").description
        boxes = f"{len(desc.nodes)} boxes grouping {len(gm.graph.nodes)} nodes by module" if desc.summary else \
            f"a box per node, {len(desc.nodes)}"
        err.write(f"{_PROG}: wrote {args.graph} (the traced graph by stage: {boxes})\n")
    if args.gantt is not None and args.trace is None:
        from ..draw import draw_gantt
        steps = args.steps or 4 * result.num_stages
        draw_gantt(simulate(result, steps=steps, queue_depth=args.queue_depth, cores=args.cores).timeline, args.gantt)
        err.write(f"{_PROG}: wrote {args.gantt} (simulated timeline of {steps} batches)\n")


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, parser: argparse.ArgumentParser) -> None:
    to_stdout = [flag for flag in ("json", "yaml") if getattr(args, flag) == "-"]
    if len(to_stdout) > 1:
        raise _UsageError("--json - and --yaml - both ask for stdout; send one of them to a file")
    _check_outputs(args)
    if args.calibrate or args.recalibrate:
        _calibrate(args, out if args.model_file is None else err, err)
    if args.model_file is None:
        if args.calibrate or args.recalibrate:
            return
        if args.trace is None:
            raise _UsageError("the MODEL.py argument is required (only --gantt PATH --trace TRACE.json works "
                              "without it)")
        _draw_trace(args, err)
        return
    options = _options(args)
    PlanOptions.make(**options)  # fail on a bad flag combination before the (slow) model load
    path = Path(args.model_file)
    if args.plan is not None:  # sizes first: a plan asking for more than a device holds fails before the rest
        check_plan_heads(read_plan_document(args.plan), args.plan)
    saved = read_saved_plan(args.plan) if args.plan is not None else None  # a bad plan file fails before the load
    distill = args.mode == "pipebd" or (args.mode is None and saved is not None and saved.mode == "pipebd")
    if args.blocks is not None and not distill:
        raise _UsageError("--blocks aligns a teacher with a student; add --mode pipebd")
    model, inputs, kwargs, teacher = load_model(path, teacher=distill)
    extra = {"teacher": teacher, "blocks": args.blocks} if distill else {}
    with warnings.catch_warnings(record=True) as caught:
        made, result, remark = _planned(args, options, model=model, example_inputs=inputs, example_kwargs=kwargs,
                                        plan=args.plan, **extra)

    show = args.show or (args.json is None and args.yaml is None)
    if to_stdout:
        out.write((result.to_json() + "\n") if to_stdout[0] == "json" else result.to_yaml())
    if show:  # its notes' advice worded as flags
        table = (cli_worded(line, parser) if line.startswith("note: ") else line for line in result.table().split("\n"))
        (err if to_stdout else out).write("\n".join(table) + "\n")
    shown = set(result.notes) if show else set()
    for message in dict.fromkeys(str(w.message) for w in caught):
        if message not in shown:
            err.write(f"{_PROG}: warning: {cli_worded(message, parser)}\n")
    if remark is not None:
        err.write(f"{_PROG}: {remark}\n")
    for flag, text in (("json", result.to_json), ("yaml", result.to_yaml)):
        target = getattr(args, flag)
        if target is not None and target != "-":
            _write(target, text())
            err.write(f"{_PROG}: wrote {target} ({result.num_stages} stages, imbalance {result.imbalance:.3f})\n")
    _pictures(args, result, made.graph_module if args.graph is not None else None, out if not to_stdout else err, err)
    if args.trace is not None:
        _draw_trace(args, err)


def _planned(args: argparse.Namespace, options: dict[str, Any], **call: Any) -> tuple[Any, Plan, str | None]:
    """``plan(**call, **options)``, or ``compile`` when the graph is drawn (it needs the traced graph): what it
    made, its plan, and a remark on a saved plan's costs.

    A ``--plan`` file is shown with its costs as saved (a time profile is not re-timed: it is re-applied with FLOPs
    only, to check it against the model) unless ``--remeasure`` or a planning flag asks for new ones, or it was
    edited: its stages then differ from what re-applying it gives, and it is measured afresh.
    """
    build = compile if args.graph is not None else plan

    def made_and_plan(**more: Any) -> tuple[Any, Plan]:
        made = build(**call, **options, **more)
        return made, (made.plan if args.graph is not None else made)

    if args.plan is None or args.remeasure or options or args.blocks is not None:
        return (*made_and_plan(), None)
    kept, edited = _saved_as_is(args.plan)
    made, result = made_and_plan(profile="flops") if kept is not None else made_and_plan()
    if kept is not None:
        edits = _edits(kept, result)
        if not edits:
            return made, kept, (f"costs as saved in {args.plan} ({kept.profile} profile); --remeasure measures "
                                f"them on this machine")
        edited = f"it differs from what re-applying it gives in {', '.join(edits)}"
        if kept.profile != "flops":
            made, result = made_and_plan()
    return made, result, f"{args.plan} was edited ({edited}), so its costs are measured afresh"


def _saved_as_is(path: str) -> tuple[Plan | None, str | None]:
    """The saved plan at ``path`` with its costs, or ``None`` and why not, when it no longer reads as a whole plan
    (its derived fields disagree after a hand edit, e.g. a moved ``last_node``): such a plan is measured afresh."""
    try:
        return Plan.load(path), None
    except PlanError as e:
        return None, str(e).removeprefix(f"{path}: ")


def _edits(saved: Plan, fresh: Plan) -> list[str]:
    """The fields in which ``saved`` differs from ``fresh``, the plan re-applying it gives (``[]``: the costs saved
    still describe it): the inputs, and every stage's nodes, replicas, boundary and head (its config, and what
    that config builds)."""
    if (saved.mode, saved.inputs, saved.num_stages) != (fresh.mode, fresh.inputs, fresh.num_stages):
        return ["the mode, the inputs or the number of stages"]
    def built(head: HeadSpec) -> tuple[Any, ...]:
        return head.policy, head.kind, head.config, head.param_count  # not its measured costs

    return [f"stages[{s.index}].{name}" for s, f in zip(saved.stages, fresh.stages)
            for name in ("nodes", "replicas", "boundary", "head")
            if (built(s.head) != built(f.head) if name == "head" else getattr(s, name) != getattr(f, name))]


_USER_ERRORS = (_UsageError, PPLLError, ValueError, TypeError)
"""What a bad flag or file raises: reported in one message, exit status 2. Anything else is a bug: exit status 1."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ppll-plan`` on ``argv`` (default: the command line); return the exit status: 0 ok, 2 a bad flag or
    file (one ``ppll-plan: error:`` message), 1 an internal error (its traceback with ``--debug``)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag that argparse already reported
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        _run(args, sys.stdout, sys.stderr, parser)
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        if isinstance(e, _USER_ERRORS):
            text = re.split(r"\n(?:Exception raised from|frame #)", str(e), maxsplit=1)[0].rstrip()  # no C++ frames
            print(f"{_PROG}: error: {cli_worded(text, parser)}", file=sys.stderr)
            return 2
        hint = "" if args.debug else "; rerun with --debug for the traceback"  # and torch's C++ frames, if any
        first = str(e).strip().split("\n")[0]
        print(f"{_PROG}: internal error: {type(e).__name__}: {first}{hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

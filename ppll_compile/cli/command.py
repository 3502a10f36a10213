"""The ``ppll-plan`` command: plan a model defined in a Python file and print or save the plan.

Example::

    ppll-plan examples/resnet32.py --gpus 4 --policy infopro --memory-limit 16GiB --yaml plan.yaml
    ppll-plan examples/resnet32.py --plan plan.yaml --show      # re-apply a (hand-edited) plan, costs as saved
    ppll-plan examples/pipebd_mobilenet.py --mode pipebd --gpus 4 # blockwise distillation
    ppll-plan examples/resnet32.py --gpus 4 --simulate --plot cost.png --graph graph.svg --gantt gantt.png
    ppll-plan --gantt measured.png --trace trace.json               # a timeline recorded with trace=True
    ppll-plan --recalibrate --gpus 2 --figures figures.json         # measure this machine's figures again

MODEL.py defines ``build_model()`` and ``example_inputs()``, and for ``--mode pipebd`` also ``build_teacher()``;
:mod:`ppll_compile.cli.model_file` loads it.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ..api import compile, plan
from ..cost.calibration import calibrate, summary
from ..cost.roofline import FIGURES_ENV
from ..errors import PlanError, PPLLError
from ..heads.policy import check_plan_heads
from ..lower.profile import first_device
from ..options import PlanOptions, read_saved_plan
from ..plans.file import read_plan_document
from ..plans.plan import Plan
from ..plans.specs import HeadSpec
from .advice import cli_worded
from .arguments import PROG
from .arguments import parser as _parser
from .arguments import plan_options as _options
from .model_file import load_model


class _UsageError(Exception):
    """A problem with the command line, reported as ``ppll-plan: error: ...``."""


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


def _check_frozen(args: argparse.Namespace) -> None:
    """Refuse a MODEL.py that ``--frozen NAME ...`` took for a parameter name (it takes every word after it)."""
    files = [name for names in (args.frozen or ()) for name in names if name.endswith(".py")]
    if files and args.model_file is None:
        raise _UsageError(f"--frozen took {files[0]!r} for a parameter name (it takes every word after it); give "
                          f"MODEL.py before --frozen, e.g. ppll-plan {files[0]} --frozen NAME")


def _draw_trace(args: argparse.Namespace, err: TextIO) -> None:
    from ..draw import draw_gantt
    from ..plans.timeline import Timeline
    timeline = Timeline.load(args.trace)
    draw_gantt(timeline, args.gantt, batches=args.steps)
    err.write(f"{PROG}: wrote {args.gantt} ({timeline.source} timeline of {len(timeline.lanes)} lanes)\n")


def _calibrate(args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    """Measure the figures of the device a plan with these flags runs on (``--recalibrate``: again), and say so."""
    device = first_device(args.devices)  # the first of --devices, else the first GPU, else the CPU
    stages = args.gpus or (len(args.devices) if args.devices else 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures = calibrate(device, stages=stages, refresh=args.recalibrate, out=args.figures)
    out.write("\n".join(f"{PROG}: {line}" for line in summary(figures).splitlines()) + "\n")
    for message in dict.fromkeys(str(w.message) for w in caught):
        err.write(f"{PROG}: warning: {message}\n")
    if args.figures is not None:
        err.write(f"{PROG}: wrote {args.figures} (pin it with {FIGURES_ENV}={args.figures})\n")


def _pictures(args: argparse.Namespace, result: Plan, gm: Any, out: TextIO, err: TextIO) -> None:
    """The simulation, plots and graph (of the traced graph module ``gm``) the flags ask for."""
    from ..simulation.simulate import simulate
    if args.simulate:
        sim = simulate(result, steps=args.steps or 64, queue_depth=args.queue_depth, cores=args.cores)
        out.write("\n" + sim.table() + "\n")
    if args.plot is not None:
        from ..draw import plot_costs
        plot_costs(result, args.plot)
        err.write(f"{PROG}: wrote {args.plot} (cost per stage, bottleneck stage {result.bottleneck_stage})\n")
    if args.graph is not None:
        from ..draw import draw_graph
        desc = draw_graph((gm, result), args.graph, detail=args.graph_detail or "auto").description
        boxes = f"{len(desc.nodes)} boxes grouping {len(gm.graph.nodes)} nodes by module" if desc.summary else \
            f"a box per node, {len(desc.nodes)}"
        err.write(f"{PROG}: wrote {args.graph} (the traced graph by stage: {boxes})\n")
    if args.gantt is not None and args.trace is None:
        from ..draw import draw_gantt
        steps = args.steps or 4 * result.num_stages
        draw_gantt(simulate(result, steps=steps, queue_depth=args.queue_depth, cores=args.cores).timeline, args.gantt)
        err.write(f"{PROG}: wrote {args.gantt} (simulated timeline of {steps} batches)\n")


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, parser: argparse.ArgumentParser) -> None:
    to_stdout = [flag for flag in ("json", "yaml") if getattr(args, flag) == "-"]
    if len(to_stdout) > 1:
        raise _UsageError("--json - and --yaml - both ask for stdout; send one of them to a file")
    _check_outputs(args)
    _check_frozen(args)
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

    show = args.show or args.legend or (args.json is None and args.yaml is None)
    if to_stdout:
        out.write((result.to_json() + "\n") if to_stdout[0] == "json" else result.to_yaml())
    if show:  # its notes' advice worded as flags
        table = (cli_worded(line, parser) if line.startswith("note: ") else line for line in result.table().split("\n"))
        (err if to_stdout else out).write("\n".join(table) + "\n")
    if args.legend:
        (err if to_stdout else out).write("\n" + result.legend() + "\n")
    shown = set(result.notes) if show else set()
    for message in dict.fromkeys(str(w.message) for w in caught):
        if message not in shown:
            err.write(f"{PROG}: warning: {cli_worded(message, parser)}\n")
    if remark is not None:
        err.write(f"{PROG}: {remark}\n")
    for flag, text in (("json", result.to_json), ("yaml", result.to_yaml)):
        target = getattr(args, flag)
        if target is not None and target != "-":
            _write(target, text())
            err.write(f"{PROG}: wrote {target} ({result.num_stages} stages, imbalance {result.imbalance:.3f})\n")
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
            print(f"{PROG}: error: {cli_worded(text, parser)}", file=sys.stderr)
            return 2
        hint = "" if args.debug else "; rerun with --debug for the traceback"  # and torch's C++ frames, if any
        first = str(e).strip().split("\n")[0]
        print(f"{PROG}: internal error: {type(e).__name__}: {first}{hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m benchmarks [--quick] [--out results] [--only NAME,...]``: every benchmark, side by side, in one run.

Writes ``results.json`` (all figures, with the date, machine and torch version of each section), ``results.md``
(the tables) and the PNG plots into the results folder. ``--only`` reruns some sections and keeps the others'
results found in the folder. A section that fails is reported and the others still run; the exit status is
then 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback
import warnings
from pathlib import Path

from .report import environment

SECTIONS = {
    "compiler": "compile time against model size, and the partitioner's own speed",
    "quality": "partition quality of exact against the uniform, greedy and params baselines",
    "costmodel": "each stage's predicted time under the flops, roofline and time profiles against the clock",
    "faults": "page faults per step and throughput with glibc's defaults and with the allocator setting",
    "throughput": "PPLL runtimes against E2E, sequential local learning and torch pipelining; simulated vs measured",
    "distill": "Pipe-BD against the strongest 2-process baseline (DDP; DNA two ways), and each technique's share",
    "accuracy": "accuracy on scikit-learn digits: E2E against PPLL with dgl and infopro heads",
    "zoo": "timm and Hugging Face models compiled unmodified: cuts, balance, front end, eval and threads checks",
    "heads": "deeper heads: PPLL vs torch pipelining as the ViT head deepens; digits accuracy per head type",
    "scale": "plan time and peak memory of Llama shapes on 8 to 1,024 devices; exact against framework splits",
    "plan_quality": "predicted speedup / K of one base-size model per family on the H100 preset at K = 2, 4, 8",
    "scale_heads": "per-token auxiliary heads at a large vocabulary: memory, share of the step, tokens/s, MFU",
    "recovery": "seconds from a killed process to the next trained batch under torchrun --max-restarts; work lost",
}
MODULES = {"throughput": "runtime"}
"""Section name -> module of ``benchmarks`` when they differ."""


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown or text!r}; choose from {', '.join(SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="sections:\n" + "\n".join(f"  {k:<11} {v}" for k, v in SECTIONS.items()))
    parser.add_argument("--quick", action="store_true", help="a few-minute version: fewer steps, rounds and models")
    parser.add_argument("--out", default="results", help="folder for results.json, results.md and the plots")
    parser.add_argument("--only", type=_names, default=list(SECTIONS), metavar="NAME,...", help="run these sections")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")  # the compiler's CPU-fallback note, once per compiled pipeline
    results = _previous(out / "results.json")
    failed: dict[str, str] = {}
    for name in args.only:
        print(f"== {name}: {SECTIONS[name]}", flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f".{MODULES.get(name, name)}", __package__)
            section = module.section(quick=args.quick, out=out)
        except Exception:  # noqa: BLE001 - one failing benchmark must not lose the others' results
            failed[name] = traceback.format_exc()
            print(failed[name], flush=True)
            continue
        env = environment()
        results[name] = {"environment": env, "quick": args.quick, "seconds": time.perf_counter() - start,
                         "report": section.report(), "results": section.results}
        print(results[name]["report"], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(_markdown(results, failed))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 1 if failed else 0


def _previous(path: Path) -> dict:
    """The sections a previous run left in ``results.json`` (rerun ones are replaced)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if k in SECTIONS and isinstance(v, dict) and "report" in v}


def _markdown(results: dict, failed: dict[str, str]) -> str:
    parts = ["# Benchmarks\n\n`python -m benchmarks` (see `benchmarks/`); each section says when, where and how "
             "long it ran.\n"]
    for name in SECTIONS:
        if name in results:
            r = results[name]
            env = r["environment"]
            report = r["report"].split("\n", 1)
            parts.append(f"{report[0]}\n\n_Measured {env['date']} on {env['machine']}, torch {env['torch']}; "
                         f"{'--quick, ' if r['quick'] else ''}{r['seconds'] / 60:.1f} min._\n{report[1]}")
    parts += [f"## {name}: failed\n\n```\n{text}```\n" for name, text in failed.items()]
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())

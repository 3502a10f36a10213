"""Plans at the scale users train: plan time and peak memory of Llama shapes on 8, 64 and 1,024 devices, and the exact
plan's simulated throughput against the splits popular frameworks make by default.

Every point (model shape, device count) runs in a fresh Python process, so that its peak memory (max RSS) is its
own: the process builds the model on the meta device (no weights), plans it with the exact partitioner choosing
stages and replicas for the devices (``replicas=True``), and records the seconds of that ``plan()`` call and the
process's max RSS right after it. Then, in the same process, the same model is planned three more ways on the same
devices and the same hardware, and every plan is simulated (``ppll_compile.simulate``, 32 batches):

- ``even``: torchtitan's default split, equal numbers of decoder layers per stage (the embedding with the first,
  the final norm and the output projection with the last);
- ``params``: DeepSpeed's ``partition_method="parameters"``, the contiguous split of the layers (embedding, each
  decoder layer, final norm, output projection) that balances their parameter counts;
- ``exact_same``: the exact partitioner's cuts with the baselines' shape (the same stages and replicas).

The baselines use as many stages as divide the devices and do not exceed the decoder layers, with the devices
shared out evenly as data-parallel replicas (as a framework's pipeline degree times data-parallel degree), at most
as many replicas a stage as the batch has examples (the devices beyond that stay idle, as the exact plan's may).

The hardware and topology the plans are made for pass through one place, :data:`CLUSTER`: of it, the options that
:class:`ppll_compile.options.PlanOptions` knows are passed to every ``plan()``. Without a hardware preset the
costs are those of the pinned figures of ``tests/device_figures.json`` (no calibration on this machine). A model
is built on the meta device and fed meta token ids; if that fails it is tried with token ids on the CPU, then
(small shapes only) with real weights; the row says which worked.

Every simulated plan also reports its model FLOPs utilisation (MFU: the model's own FLOPs per step over step time x
devices x the preset's dense peak in the plan's precision) and the memory of its fullest device by part (weights,
gradients, optimizer state, activations, head, logits), as ``ppll_compile.simulate`` gives them.

``--quick``: one 4-layer Llama shape on 8 devices at sequence 32, without ``exact_same`` (under a minute).
``--precision bf16`` plans in that precision (passed to ``plan()`` only when it is not ``fp32``); ``--devices 8,64``
and ``--models 8B,70B`` run those points only; ``--batch 4`` plans every shape at that many sequences a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .report import Section, standalone

__all__ = ["CLUSTER", "SHAPES", "QUICK_SHAPES", "DEVICES", "QUICK_DEVICES", "llama_config", "plan_kwargs", "point",
           "section", "main"]

CLUSTER: dict[str, Any] = {"hardware": "h100", "gpus_per_node": 8, "optimizer": "adam"}
"""The cluster every plan is made for, and the optimizer (Adam's two moments per weight, as LLMs train); only the
options that ``PlanOptions`` knows are passed (:func:`plan_kwargs`)."""
STEPS = 32
"""Batches each plan is simulated for."""
REAL_WEIGHTS_LIMIT = 2 << 30
"""Largest model (bytes of float32 parameters) that is built with real weights when the meta device fails."""
POINT_TIMEOUT = 1800
"""Seconds one point's process may take before it is recorded as timed out."""
_REPO = Path(__file__).resolve().parent.parent
_FIGURES = _REPO / "tests" / "device_figures.json"

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-shaped configurations of the named sizes (untied output projection; sequence and batch per step)
    "125M": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=2048, vocab_size=32000, seq=2048, batch=8),
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, seq=4096, batch=8),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, seq=4096, batch=8),
    "70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, vocab_size=128256, seq=4096, batch=8),
    "405B": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                 intermediate_size=53248, vocab_size=128256, seq=4096, batch=8),
}
QUICK_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-4L": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, vocab_size=256, seq=32, batch=8),
}
DEVICES = (8, 64, 1024)
QUICK_DEVICES = (8,)
KINDS = ("exact", "exact_same", "even", "params")


def plan_kwargs(precision: str = "fp32") -> dict[str, Any]:
    """The options of :data:`CLUSTER` that this version of ``PlanOptions`` knows, and ``precision`` unless it is
    ``fp32`` (the default of every version)."""
    from ppll_compile.options import PlanOptions
    known = {f.name for f in dataclasses.fields(PlanOptions)}
    extra = {} if precision == "fp32" else {"precision": precision}
    return {**{k: v for k, v in CLUSTER.items() if k in known}, **extra}


def llama_config(shape: dict[str, Any]) -> Any:
    """The transformers ``LlamaConfig`` of a shape of :data:`SHAPES` (its ``seq`` the longest position)."""
    from transformers import LlamaConfig
    spec = {k: v for k, v in shape.items() if k not in ("seq", "batch")}
    return LlamaConfig(**spec, max_position_embeddings=shape["seq"], tie_word_embeddings=False, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0)


def _build(shape: dict[str, Any], how: str) -> tuple[Any, Any]:
    """The model and example token ids, ``how``: ``meta`` (meta model and ids), ``meta+cpu ids`` or ``real``."""
    import torch
    from transformers import LlamaForCausalLM
    config = llama_config(shape)
    if how == "real":
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    ids = torch.zeros(1, shape["seq"], dtype=torch.long, device="meta" if how == "meta" else "cpu")
    return model, ids


def _layers(model: Any) -> list[tuple[str, int]]:
    """The layers a framework splits (module name, parameter count): embedding, decoder layers, norm, output."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    inner = model.model
    return [("model.embed_tokens", count(inner.embed_tokens)),
            *[(f"model.layers.{i}", count(layer)) for i, layer in enumerate(inner.layers)],
            ("model.norm", count(inner.norm)), ("lm_head", count(model.lm_head))]


def _shape(devices: int, layers: int, batch: int) -> tuple[int, int]:
    """The baselines' stages (the most that divide ``devices`` and are at most ``layers``) and replicas each (the
    devices shared out evenly, at most ``batch``: a data-parallel replica trains on one example at least)."""
    stages = max(s for s in range(1, min(devices, layers) + 1) if devices % s == 0)
    return stages, min(devices // stages, batch)


def _even_splits(layers: int, stages: int) -> list[str]:
    """torchtitan: decoder layers ``[round(j L / S), round((j + 1) L / S))`` on stage ``j``; the cut after each."""
    ends = [((j + 1) * 2 * layers + stages) // (2 * stages) for j in range(stages)]
    return [f"model.layers.{e - 1}" for e in ends[:-1]]


def _param_splits(named: list[tuple[str, int]], stages: int) -> list[str]:
    """DeepSpeed ``parameters``: the min-max contiguous split of the layers' parameter counts."""
    from ppll_compile import partitioners
    ends = partitioners.solve(partitioners.Problem(compute=[float(c) for _, c in named]), stages, "exact")
    return [named[e - 1][0] for e in ends[:-1]]


def _simulated(plan: Any) -> dict[str, Any]:
    import ppll_compile
    sim = ppll_compile.simulate(plan, steps=STEPS)
    fullest = max(sim.stages, key=lambda s: s.memory)
    return {"stages": plan.num_stages, "replicas": [s.replicas for s in plan.stages], "cuts": list(plan.cuts),
            "samples_per_s": sim.to_dict()["throughput"], "tokens_per_s": sim.to_dict()["token_throughput"],
            "bubble": sim.bubble, "fill_drain": sim.fill_drain, "peak_memory": sim.peak_memory,
            "bottleneck_s": plan.bottleneck_cost, "step_s": sim.step_time, "mfu": sim.mfu,
            "model_flops": sim.model_flops, "peak_flops": sim.peak_flops, "fullest_stage": fullest.index,
            "fullest_split": dataclasses.asdict(fullest.split), "logits_bytes": sim.stages[-1].split.logits,
            "head_bytes": max(s.split.head for s in sim.stages), "head_share": max(s.head_share for s in sim.stages)}


def point(name: str, shape: dict[str, Any], devices: int, kinds: tuple[str, ...] = KINDS,
          precision: str = "fp32") -> dict[str, Any]:
    """One point, in this process: plan time and max RSS of the exact plan, then the other ``kinds`` simulated."""
    import ppll_compile
    options = dict(batch_size=shape["batch"], **plan_kwargs(precision))
    row: dict[str, Any] = {"model": name, "devices": devices, "options": {k: v for k, v in options.items()}}
    errors = []
    exact = None
    for how in ("meta", "meta+cpu ids", "real"):
        model, ids = _build(shape, how) if how != "real" or _bytes(shape) <= REAL_WEIGHTS_LIMIT else (None, None)
        if model is None:
            break
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exact = ppll_compile.plan(model, devices, example_kwargs={"input_ids": ids}, replicas=True, **options)
        except Exception as e:  # noqa: BLE001 - the next way to build it, and the reason, recorded
            errors.append(f"{how}: {type(e).__name__}: {str(e)[:300]}")
            continue
        row |= {"build": how, "plan_s": time.perf_counter() - start,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "parameters": sum(p.numel() for p in model.parameters())}
        break
    row["errors"] = errors
    if exact is None:
        return row
    layers = shape["num_hidden_layers"]
    stages, replicas = _shape(devices, layers, shape["batch"])
    row |= {"baseline_stages": stages, "baseline_replicas": replicas, "exact": _simulated(exact)}
    same = dict(example_kwargs={"input_ids": ids}, replicas=(replicas,) * stages, **options)
    others = {"exact_same": {},
              "even": {"split_points": _even_splits(layers, stages)},
              "params": {"split_points": _param_splits(_layers(model), stages)}}
    for kind, extra in others.items():
        if kind not in kinds:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row[kind] = _simulated(ppll_compile.plan(model, **same, **extra))
        except Exception as e:  # noqa: BLE001 - a split the hardware refuses is a result too
            row[kind] = {"error": f"{type(e).__name__}: {str(e)[:300]}", **extra}
    return row


def _bytes(shape: dict[str, Any]) -> int:
    h, f, v, n = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    return 4 * (2 * v * h + n * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h)


def _run_point(name: str, shape: dict[str, Any], devices: int, kinds: tuple[str, ...],
               precision: str = "fp32") -> dict[str, Any]:
    """:func:`point` in a fresh process (its own max RSS); a crash or a timeout is recorded in the row."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]))
    if "hardware" not in plan_kwargs():
        env.setdefault("PPLL_DEVICE_FIGURES", str(_FIGURES))
    spec = json.dumps({"name": name, "shape": shape, "devices": devices, "kinds": kinds, "precision": precision})
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--point", spec], capture_output=True,
                              text=True, env=env, timeout=POINT_TIMEOUT, cwd=_REPO)
    except subprocess.TimeoutExpired:
        return {"model": name, "devices": devices, "errors": [f"timed out after {POINT_TIMEOUT} s"]}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"model": name, "devices": devices,
                "errors": [f"exit {done.returncode}: {done.stderr.strip()[-500:]}"]}
    return json.loads(lines[-1])


def _ratio(row: dict[str, Any], kind: str, over: str = "exact") -> float | None:
    a, b = row.get(over, {}), row.get(kind, {})
    if not a.get("samples_per_s") or not b.get("samples_per_s"):
        return None
    return a["samples_per_s"] / b["samples_per_s"]


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "plan_s" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    devices = sorted({r["devices"] for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (time_size, mem_size), (time_dev, ratio_dev) = axes
    for d in devices:
        pts = sorted((r["parameters"], r["plan_s"], r["peak_rss"]) for r in ok if r["devices"] == d)
        if pts:
            time_size.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{d} devices")
            mem_size.plot([p[0] for p in pts], [p[2] / 2**30 for p in pts], marker="o", label=f"{d} devices")
    for m in models:
        pts = sorted((r["devices"], r["plan_s"]) for r in ok if r["model"] == m)
        if pts:
            time_dev.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        for kind, style in (("even", "-"), ("params", "--")):
            rs = sorted((r["devices"], _ratio(r, kind)) for r in ok if r["model"] == m and _ratio(r, kind))
            if rs:
                ratio_dev.plot([p[0] for p in rs], [p[1] for p in rs], style, marker="o", label=f"{m} exact/{kind}")
    for ax, title, xlabel, ylabel in (
            (time_size, "plan() time against model size", "parameters", "seconds"),
            (mem_size, "peak memory (max RSS) against model size", "parameters", "GiB"),
            (time_dev, "plan() time against device count", "devices", "seconds"),
            (ratio_dev, "simulated throughput, exact plan over the framework split", "devices", "ratio")):
        ax.set_xscale("log")
        if ax is not ratio_dev:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    ratio_dev.axhline(1.0, color="gray", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _count(n: int) -> str:
    """``181K``, ``134M``, ``70.6B``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _cell(row: dict[str, Any], kind: str) -> str:
    r = row.get(kind)
    if not r:
        return "-"
    if "error" in r:
        return "refused"
    return f"{r['samples_per_s']:.3g}" if r["samples_per_s"] is not None else "inf"


def _mfu(row: dict[str, Any], kind: str) -> str:
    r = row.get(kind)
    return "-" if not r or r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _markdown(results: dict[str, Any]) -> str:
    kwargs = results["plan_kwargs"]
    hardware = ", ".join(f"`{k}={v!r}`" for k, v in kwargs.items()) or \
        "no hardware preset (pinned figures of `tests/device_figures.json`)"
    batches = sorted({r["options"]["batch_size"] for r in results["rows"]})
    lines = [f"`plan()` of Llama shapes at {' or '.join(map(str, batches))} sequences a step with the exact "
             f"partitioner choosing stages and replicas, {hardware}; each "
             f"point in a fresh process (max RSS). Throughput simulated over {STEPS} batches (samples/s); the "
             f"baselines use the stages x replicas shown, `exact_same` the exact cuts at that shape. MFU: the "
             f"model's own FLOPs per step over step time x devices x the preset's dense peak in the plan's "
             f"precision.", "",
             "| model | params | devices | built | plan s | peak RSS | exact stages | exact | bubble | even | params "
             "| exact_same | exact/even | exact/params | MFU exact | MFU even | MFU params | stages x replicas |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    split = ["| model | devices | plan | fullest stage | weights | grads | optimizer | activations | head | logits "
             "| total GiB | last stage's logits GiB | largest head GiB | largest head share of step |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        if "plan_s" not in r:
            lines.append(f"| {r['model']} | | {r['devices']} | failed: {'; '.join(r['errors'])[:200]} "
                         f"| | | | | | | | | | | | | |")
            continue
        ratios = [_ratio(r, k) for k in ("even", "params")]
        lines.append(
            f"| {r['model']} | {_count(r['parameters'])} | {r['devices']} | {r['build']} | {r['plan_s']:.2f} | "
            f"{r['peak_rss'] / 2**30:.2f} GiB | {r['exact']['stages']} | {_cell(r, 'exact')} | "
            f"{r['exact']['bubble'] * 100:.1f}% | {_cell(r, 'even')} | {_cell(r, 'params')} | "
            f"{_cell(r, 'exact_same')} | " + " | ".join("-" if x is None else f"{x:.2f}x" for x in ratios)
            + f" | {_mfu(r, 'exact')} | {_mfu(r, 'even')} | {_mfu(r, 'params')}"
            + f" | {r['baseline_stages']} x {r['baseline_replicas']} |")
        for kind in ("exact", "even", "params"):
            k = r.get(kind)
            if not k or "fullest_split" not in k:
                continue
            m = k["fullest_split"]
            split.append(f"| {r['model']} | {r['devices']} | {kind} | {k['fullest_stage']} | "
                         + " | ".join(_gib(m[p]) for p in ("weights", "gradients", "optimizer", "activations", "head",
                                                           "logits"))
                         + f" | {_gib(sum(m.values()))} | {_gib(k['logits_bytes'])} | {_gib(k['head_bytes'])} | "
                           f"{100 * k['head_share']:.1f}% |")
    return "\n".join(lines + ["", "Memory of the fullest device of each plan, by part (GiB):", ""] + split) + "\n"


def section(*, quick: bool, out: Path, precision: str = "fp32", devices: tuple[int, ...] | None = None,
            models: tuple[str, ...] | None = None, batch: int | None = None) -> Section:
    """Plan time and peak memory against model size and device count; exact against the framework splits (in
    ``precision``; only ``devices`` and ``models`` when given; ``batch`` sequences a step instead of the shapes')."""
    shapes, counts = (QUICK_SHAPES, QUICK_DEVICES) if quick else (SHAPES, DEVICES)
    shapes = {k: v | ({"batch": batch} if batch else {}) for k, v in shapes.items() if models is None or k in models}
    rows = []
    for name, shape in shapes.items():
        for d in devices or counts:
            row = _run_point(name, shape, d, tuple(k for k in KINDS if not (quick and k == "exact_same")), precision)
            rows.append(row)
            said = f"{row['plan_s']:.2f} s, {row['peak_rss'] / 2**30:.2f} GiB" if "plan_s" in row else \
                f"failed ({'; '.join(row['errors'])[:160]})"
            print(f"  {name} on {d} devices: {said}", flush=True)
    results = {"plan_kwargs": plan_kwargs(precision), "cluster": CLUSTER, "precision": precision, "steps": STEPS,
               "rows": rows}
    _plot(rows, out / "scale.png")
    return Section(key="scale", title="Plans at cluster scale", results=results, markdown=_markdown(results),
                   figures=["scale.png"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--point"]:  # one point, in the fresh process _run_point started
        spec = json.loads(args[1])
        print(json.dumps(point(spec["name"], spec["shape"], spec["devices"], tuple(spec["kinds"]),
                               spec.get("precision", "fp32"))), flush=True)
        return 0
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--devices", type=lambda t: tuple(int(x) for x in t.split(",")), default=None)
    parser.add_argument("--models", type=lambda t: tuple(t.split(",")), default=None)
    parser.add_argument("--batch", type=int, default=None)
    ours, rest = parser.parse_known_args(args)
    return standalone(functools.partial(section, precision=ours.precision, devices=ours.devices, models=ours.models,
                                        batch=ours.batch),
                      rest, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

"""Which auxiliary head to pick at a large vocabulary: a Llama 8B shape (vocabulary 128,256) planned for 64 H100s
with each per-token head of the policies, and what the head costs in memory and time.

Every head is planned the same way as ``benchmarks.scale``'s points (the exact partitioner choosing stages and
replicas, ``hardware="h100"``, nodes of 8, batch 8 x 4,096 tokens) and the plan is simulated over 32 batches; the
row gives the largest head of the plan (its memory, one copy of its per-token scores, its share of the device's
memory), the largest share of a stage's step a head takes, the trained parameters of one head, and the plan's
simulated tokens per second and model FLOPs utilisation (MFU). For reference the last row plans the same decoder
stack as a sequence classifier (the mean of its tokens, then a linear layer to 2 classes per example) with pooled
heads (token mean, then a linear layer): scores of N x 2 instead of N x L x 128,256, for per-example labels only.

``--quick``: the 4-layer shape of ``benchmarks.scale`` on 8 devices. ``--precision bf16``: plan in that precision
(passed to ``plan()`` only when it is not ``fp32``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .report import Section, standalone
from .scale import QUICK_SHAPES, SHAPES, STEPS, llama_config, plan_kwargs

HEADS: dict[str, dict[str, Any]] = {
    "lm rank 64 (auto, lm)": {"type": "lm", "rank": 64},
    "lm rank 256": {"type": "lm", "rank": 256},
    "lm rank 0 (full fresh projection)": {"type": "lm", "rank": 0},
    "lm_output frozen, linear adapter": {"type": "lm_output", "projection": "frozen", "adapter": "linear"},
    "lm_output shared, no adapter": {"type": "lm_output", "projection": "shared", "adapter": "none"},
}
"""The per-token heads compared, as a policy's ``per_token`` entry."""
POOLED = "pooled (token mean), sequence classifier"
DEVICES, QUICK_DEVICES = 64, 8


def _policy(per_token: dict[str, Any] | None) -> Any:
    from ppll_compile.heads.policy import validate_policy
    heads = {"vector": {"type": "mlp"}, "sequence": {"type": "token", "pool": "mean"}}
    return validate_policy({"heads": heads, **({"per_token": per_token} if per_token else {})}, "inline")


def _model(shape: dict[str, Any], pooled: bool) -> Any:
    import torch
    from torch import nn
    from transformers import LlamaForCausalLM, LlamaModel

    class Classifier(nn.Module):
        """The decoder stack, the mean of its tokens and a linear layer to 2 classes per sequence."""

        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaModel(llama_config(shape))
            self.score = nn.Linear(shape["hidden_size"], 2)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.score(self.model(input_ids=input_ids).last_hidden_state.mean(1))

    with torch.device("meta"):
        return Classifier() if pooled else LlamaForCausalLM(llama_config(shape))


def row(name: str, shape: dict[str, Any], devices: int, precision: str) -> dict[str, Any]:
    """One head: the plan's largest head, its scores, its share of memory and of the step, tokens/s and MFU."""
    import torch

    import ppll_compile
    from ppll_compile.plans.report import memory_split
    pooled = name == POOLED
    model = _model(shape, pooled)
    ids = torch.zeros(shape["batch"], shape["seq"], dtype=torch.long, device="meta")
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = ppll_compile.plan(model, devices, example_kwargs={"input_ids": ids}, replicas=True,
                                     batch_size=shape["batch"], policy=_policy(None if pooled else HEADS[name]),
                                     **plan_kwargs(precision))
    except Exception as e:  # noqa: BLE001 - a head the devices cannot hold is a result too
        return {"head": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    sim = ppll_compile.simulate(plan, steps=STEPS)
    heads = [s for s in plan.stages if not s.is_last]
    largest = max(heads, key=lambda s: memory_split(s).head) if heads else None
    device = plan.memory_limit or 0
    return {"head": name, "plan_s": time.perf_counter() - start, "stages": plan.num_stages,
            "replicas": [s.replicas for s in plan.stages], "tokens_per_s": sim.to_dict()["token_throughput"],
            "mfu": sim.mfu, "device_bytes": device,
            "head_bytes": memory_split(largest).head if largest else 0,
            "scores_bytes": largest.head.scores_bytes if largest else 0,
            "head_params": largest.head.param_count if largest else 0,
            "head_share": max(s.head_share for s in sim.stages[:-1]) if heads else 0.0,
            "logits_bytes": memory_split(plan.stages[-1]).logits, "notes": [n for n in plan.notes if "takes" in n]}


def _markdown(results: dict[str, Any]) -> str:
    g = 2 ** 30
    lines = [f"Llama {results['model']} shape (vocabulary {results['vocab']:,}), {results['devices']} devices, "
             f"{', '.join(f'`{k}={v!r}`' for k, v in results['plan_kwargs'].items())}, batch "
             f"{results['batch']} x {results['seq']} tokens, exact partitioner with replicas; the largest head of "
             f"each plan.", "",
             "| head | trained params per head | head memory GiB | of it, one copy of the scores GiB | share of a "
             "device | head share of step | stages | tokens/s | MFU | last stage's logits GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['head']} | refused: {r['error'][:160]} | | | | | | | | |")
            continue
        share = f"{100 * r['head_bytes'] / r['device_bytes']:.0f}%" if r["device_bytes"] else "-"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.2f}%"
        lines.append(f"| {r['head']} | {r['head_params'] / 1e6:.2f}M | {r['head_bytes'] / g:.1f} | "
                     f"{r['scores_bytes'] / g:.1f} | {share} | {100 * r['head_share']:.1f}% | {r['stages']} | "
                     f"{r['tokens_per_s']:.0f} | {mfu} | {r['logits_bytes'] / g:.1f} |")
    return "\n".join(lines) + "\n"


def section(*, quick: bool, out: Path, precision: str = "fp32") -> Section:
    """Each per-token head (and a pooled classifier) on the 8B shape: memory, step share, tokens/s, MFU."""
    name, shape = next(iter(QUICK_SHAPES.items())) if quick else ("8B", SHAPES["8B"])
    devices = QUICK_DEVICES if quick else DEVICES
    rows = []
    for head in (*HEADS, POOLED):
        r = row(head, shape, devices, precision)
        rows.append(r)
        print(f"  {head}: {r['error'] if 'error' in r else format(r['plan_s'], '.1f') + ' s'}", flush=True)
    results = {"model": name, "devices": devices, "batch": shape["batch"], "seq": shape["seq"],
               "vocab": shape["vocab_size"],
               "plan_kwargs": plan_kwargs(precision), "precision": precision, "rows": rows}
    return Section(key="scale_heads", title="Auxiliary heads at a large vocabulary", results=results,
                   markdown=_markdown(results), figures=[])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return standalone(functools.partial(section, precision=ours.precision), rest, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

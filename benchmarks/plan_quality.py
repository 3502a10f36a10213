"""Plan quality per model family: one base-size model of each major family, built on the meta device and planned
for an H100 cluster at K = 2, 4 and 8 stages; the table is the plan's predicted speedup over sequential local
learning divided by K (its efficiency).

Every model is built from a config in code (no download, no weights: ``torch.device("meta")``) at the size of the
family's base (or smallest published) checkpoint, fed meta inputs (text: batch 8 of 128 tokens; images: batch 8 of
224 x 224) and planned with ``ppll_compile.plan(model, K, hardware="h100", batch_size=8)`` and otherwise the
defaults (exact partitioner, ``policy="auto"``, ``tracer="auto"``). Per model and K the row records the legal cuts,
the chosen cuts, every stage's cost, the predicted speedup and the efficiency, and the bottleneck stage's parts
(compute, transfer, optimizer step, and the auxiliary head's share of its FLOPs). The exact partitioner is optimal
over the legal cuts, so an efficiency below :data:`TARGET` is either the model's granularity (too few or too uneven
segments between legal cuts for K stages) or a defect in the cuts or the costs: docs/measured.md says which.

``--quick``: BERT, GPT-2 and ResNet-50 at K = 2 only.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .report import Section, standalone

__all__ = ["FAMILIES", "KS", "TARGET", "build", "row", "section", "main"]

KS = (2, 4, 8)
TARGET = 0.9
"""The efficiency (speedup / K) every family should plan at for K = 2 and 4."""
BATCH, SEQ, IMAGE = 8, 128, 224


def _hf(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    return make


def _tv(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision
        return getattr(torchvision.models, name)()
    return make


_LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, vocab_size=128256, tie_word_embeddings=False)
"""Llama 3.2 1B (the smallest published Llama) without its tied output projection."""
_QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=False)
"""Qwen2 0.5B, output projection untied."""
_T5_BASE = dict(d_model=768, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12, vocab_size=32128)
_BART_BASE = dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=50265)
_DEBERTA_V3_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                        vocab_size=128100, relative_attention=True, position_buckets=256, pos_att_type=["p2c", "c2p"],
                        max_relative_positions=-1, position_biased_input=False, norm_rel_ebd="layer_norm")

FAMILIES: dict[str, tuple[Callable[[], nn.Module], str]] = {
    # name: (the model, built on meta by the caller; its input kind)
    "BERT": (_hf("BertConfig", "BertModel"), "text"),
    "RoBERTa": (_hf("RobertaConfig", "RobertaModel", vocab_size=50265, max_position_embeddings=514), "text"),
    "DistilBERT": (_hf("DistilBertConfig", "DistilBertModel"), "text"),
    "DeBERTa": (_hf("DebertaV2Config", "DebertaV2Model", **_DEBERTA_V3_BASE), "text"),
    "GPT-2": (_hf("GPT2Config", "GPT2LMHeadModel", tie_word_embeddings=False), "text"),
    "Llama": (_hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA_1B), "text"),
    "Mistral": (_hf("MistralConfig", "MistralForCausalLM", tie_word_embeddings=False), "text"),
    "Qwen2": (_hf("Qwen2Config", "Qwen2ForCausalLM", **_QWEN2_05B), "text"),
    "T5": (_hf("T5Config", "T5ForConditionalGeneration", **_T5_BASE, tie_word_embeddings=False), "seq2seq"),
    "BART": (_hf("BartConfig", "BartForConditionalGeneration", **_BART_BASE, tie_word_embeddings=False), "seq2seq"),
    "ViT": (_hf("ViTConfig", "ViTForImageClassification"), "image"),
    "Swin": (_hf("SwinConfig", "SwinForImageClassification"), "image"),
    "ConvNeXt": (_hf("ConvNextConfig", "ConvNextForImageClassification"), "image"),
    "ResNet-50 (torchvision)": (_tv("resnet50"), "tensor"),
    "ViT-B/16 (torchvision)": (_tv("vit_b_16"), "tensor"),
}
QUICK = ("BERT", "GPT-2", "ResNet-50 (torchvision)")


def build(name: str) -> tuple[nn.Module, dict[str, Any]]:
    """The family's model on the meta device and the keyword arguments of ``plan()`` that feed it."""
    make, kind = FAMILIES[name]
    with torch.device("meta"):
        model = make()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    image = torch.zeros(BATCH, 3, IMAGE, IMAGE, device="meta")
    feed: dict[str, Any] = {
        "text": {"example_kwargs": {"input_ids": ids}},
        "seq2seq": {"example_kwargs": {"input_ids": ids, "decoder_input_ids": ids}},
        "image": {"example_kwargs": {"pixel_values": image}},
        "tensor": {"example_inputs": (image,)},
    }[kind]
    return model, feed


def _bound(plan: Any) -> dict[str, Any]:
    """The stages' costs and what the bottleneck stage's cost is made of."""
    costs = [s.cost for s in plan.stages]
    worst = plan.stages[plan.bottleneck_stage]
    parts = {f: getattr(worst, f) for f in ("compute_cost", "comm_cost", "step_cost")}
    parts["head_flops_share"] = worst.aux_flops / max(1, worst.aux_flops + worst.flops_fwd + worst.flops_bwd)
    return {"stage_costs": costs, "bottleneck_stage": plan.bottleneck_stage, "bottleneck_parts": parts}


def row(name: str, ks: tuple[int, ...] = KS) -> dict[str, Any]:
    """Plan the family's model at every K in ``ks``: cuts, stage costs, speedup and efficiency (or the error)."""
    import ppll_compile
    out: dict[str, Any] = {"model": name, "plans": {}}
    try:
        model, feed = build(name)
    except Exception as e:  # noqa: BLE001 - a model this transformers cannot build is a row too
        out["error"] = f"build: {type(e).__name__}: {str(e)[:300]}"
        return out
    out["parameters"] = sum(p.numel() for p in model.parameters())
    out["class"] = type(model).__name__
    for k in ks:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = ppll_compile.plan(model, k, hardware="h100", batch_size=BATCH, **feed)
        except Exception as e:  # noqa: BLE001 - a refusal is a result
            out["plans"][str(k)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
            continue
        speedup = plan.predicted_speedup
        out["plans"][str(k)] = {"seconds": time.perf_counter() - start, "legal_cuts": len(plan.legal_cuts),
                                "cuts": list(plan.cuts), "stages": plan.num_stages, "speedup": speedup,
                                "efficiency": speedup / k, "tracer": plan.tracer, **_bound(plan)}
    return out


def _cell(r: dict[str, Any], k: int) -> str:
    p = r["plans"].get(str(k))
    if p is None:
        return "-"
    if "error" in p:
        return "refused"
    mark = "" if p["efficiency"] >= TARGET or k > 4 else " *"
    return f"{p['efficiency']:.2f}{mark}"


def _markdown(rows: list[dict[str, Any]], ks: tuple[int, ...]) -> str:
    lines = [f"Predicted speedup / K of the exact plan, `hardware=\"h100\"`, batch {BATCH} (text: {SEQ} tokens; "
             f"images {IMAGE} x {IMAGE}), each model built on the meta device. `*`: below {TARGET} at K <= 4 "
             "(see docs/measured.md, \"Plan quality per model family\").", "",
             "| family | class | params | legal cuts | " + " | ".join(f"K={k}" for k in ks) + " |",
             "|---|---|---:|---:|" + "---:|" * len(ks)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | | {r['error'][:200]} |" + " |" * (len(ks) - 1))
            continue
        cuts = next((p["legal_cuts"] for p in r["plans"].values() if "legal_cuts" in p), "-")
        lines.append(f"| {r['model']} | {r['class']} | {r['parameters'] / 1e6:.0f}M | {cuts} | "
                     + " | ".join(_cell(r, k) for k in ks) + " |")
    errors = [(r["model"], k, p["error"]) for r in rows for k, p in r["plans"].items() if "error" in p]
    if errors:
        lines += ["", "Refused:", ""] + [f"- {m} at K={k}: {e}" for m, k, e in errors]
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], ks: tuple[int, ...], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in rows]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        values = [r["plans"].get(str(k), {}).get("efficiency", 0.0) for r in rows]
        ax.bar([i + (j - (len(ks) - 1) / 2) * width for i in range(len(rows))], values, width, label=f"K={k}")
    ax.axhline(TARGET, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("predicted speedup / K")
    ax.set_ylim(0, 1.05)
    ax.set_title("Plan efficiency per model family (H100 preset, meta-built models)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(*, quick: bool, out: Path) -> Section:
    """Every family's plan at K = 2, 4 and 8 (quick: three families at K = 2)."""
    names, ks = (QUICK, (2,)) if quick else (tuple(FAMILIES), KS)
    rows = []
    for name in names:
        r = row(name, ks)
        rows.append(r)
        print(f"  {name}: " + ", ".join(f"K={k} {_cell(r, k)}" for k in ks) + (f" ({r['error']})" if "error" in r
                                                                                 else ""), flush=True)
    results = {"batch": BATCH, "seq": SEQ, "image": IMAGE, "hardware": "h100", "target": TARGET, "ks": list(ks),
               "rows": rows}
    _plot(rows, ks, out / "plan_quality.png")
    return Section(key="plan_quality", title="Plan quality per model family", results=results,
                   markdown=_markdown(rows, ks), figures=["plan_quality.png"])


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

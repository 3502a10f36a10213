"""``python -m benchmarks.precision_layer``: one Llama 3 70B decoder layer's training step as the roofline prices it
in each precision and fusion, against the hand roofline (``2 * params * tokens`` FLOPs forward, twice that
backward, at the preset's achievable bfloat16 matmul rate).

The layer (hidden 8192, intermediate 28672, 64 heads, 8 key/value heads, 8 x 4096 tokens) is built on the meta
device inside a one-layer ``LlamaForCausalLM`` of a 32-token vocabulary (so that the embedding and the output
projection are negligible), measured on fake tensors, and priced with the ``h100`` preset's figures; only the nodes
of ``model.layers.0`` are summed, forward and backward as a stage holding the whole model trains them.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ppll_compile.analysis.analyse import analyse
from ppll_compile.capture.trace import module_path
from ppll_compile.cost.hardware import PRESETS
from ppll_compile.cost.roofline import seconds
from ppll_compile.options import PlanOptions

SHAPE = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
             num_hidden_layers=1, vocab_size=32)
BATCH, TOKENS = 8, 4096
CASES = (("fp32", "eager"), ("bf16", "eager"), ("bf16", "fused"), ("bf16-pure", "fused"))


def measure(hardware: str = "h100") -> list[dict[str, float | str]]:
    """Per precision and fusion: the layer's seconds, memory-bound share and ratio to the hand roofline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    ids = torch.zeros(BATCH, TOKENS, dtype=torch.long)
    figures = PRESETS[hardware].figures
    assert figures is not None
    layer = model.model.layers[0]
    params = sum(p.numel() for p in layer.parameters())
    hand = 6 * params * BATCH * TOKENS / figures.rate("matmul", "bfloat16")
    rows = []
    for precision, fusion in CASES:
        began = time.perf_counter()
        a = analyse(model, None, {"input_ids": ids}, PlanOptions(precision=precision, fusion=fusion))
        nodes = [n for n in a.nodes if module_path(n).startswith("model.layers.0")]
        ops = a.ops(nodes, detached=False)
        total = seconds(ops, figures)
        memory_bound = seconds([op for op in ops if op.kind not in ("matmul", "attention", "conv", "conv_bwd")],
                               figures)
        rows.append({"precision": precision, "fusion": fusion, "seconds": total, "hand_seconds": hand,
                     "ratio": total / hand, "memory_bound_share": memory_bound / total,
                     "operators": len(ops), "plan_seconds": time.perf_counter() - began})
    return rows


def main() -> int:
    rows = measure()
    print(f"Llama 3 70B decoder layer, {BATCH} x {TOKENS} tokens, h100 preset: step seconds against the hand roofline")
    print(f"{'precision':10} {'fusion':6} {'seconds':>9} {'hand':>9} {'ratio':>6} {'mem-bound':>9} {'ops':>5}")
    for r in rows:
        print(f"{r['precision']:10} {r['fusion']:6} {r['seconds']:9.4f} {r['hand_seconds']:9.4f} {r['ratio']:6.2f} "
              f"{100 * r['memory_bound_share']:8.1f}% {r['operators']:5d}")
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Train a small Llama-style causal LM end to end and by PPLL local learning, and compare validation perplexities.

Run ``python examples/train_lm.py`` (a few minutes on two CPU cores) or ``--quick`` for a short demo. The model is
Hugging Face's ``LlamaForCausalLM`` built from a config in code (no download), unmodified; ``ppll_compile`` captures
it with ``torch.export`` and, since the labels are per token, gives every stage but the last (which keeps the model's
own head) a per-token ``lm`` head: LayerNorm and a low-rank projection to the vocabulary. The corpus is
character-level: the source of a few pure-Python standard-library modules, 90% of each for training and 10% for
validation. Every configuration starts from the same weights and sees the same batches: plain backprop
(end-to-end), then PPLL with K=2 and K=4 stages.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

import ppll_compile
from ppll_compile.heads.losses import model_loss

__all__ = ["batches", "build_model", "labels_of", "load_corpus", "main", "perplexity", "table", "train_e2e",
           "train_ppll", "validation_windows"]

MODULES = ("argparse", "difflib", "textwrap", "dataclasses")
"""Standard-library modules whose source is the corpus (about 260k characters, all ASCII)."""


def load_corpus(modules: tuple[str, ...] = MODULES, val_fraction: float = 0.1) -> tuple[Tensor, Tensor, str]:
    """Train and validation character ids (the last ``val_fraction`` of every module's source is validation)."""
    sources = [inspect.getsource(importlib.import_module(name)) for name in modules]
    chars = "".join(sorted(set("".join(sources))))
    index = {c: i for i, c in enumerate(chars)}
    cut = [int(len(s) * (1 - val_fraction)) for s in sources]

    def encode(text: str) -> Tensor:
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    train = encode("".join(s[:c] for s, c in zip(sources, cut)))
    val = encode("".join(s[c:] for s, c in zip(sources, cut)))
    return train, val, chars


def build_model(vocab: int, seq_len: int) -> LlamaForCausalLM:
    """A 4-layer Llama: hidden 64, 4 heads (2 key/value heads), MLP 128, untied embeddings (about 0.16M parameters)."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=seq_len,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def labels_of(ids: Tensor) -> Tensor:
    """Next-token labels: ``labels[:, t] = ids[:, t + 1]``; the last position has none (-100, ignored)."""
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return labels


def batches(data: Tensor, steps: int, batch_size: int, seq_len: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``steps`` batches of random windows (``input_ids``, labels), the same for every configuration."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len, (steps, batch_size), generator=g)
    windows = [torch.stack([data[s:s + seq_len] for s in row.tolist()]) for row in starts]
    return [(ids, labels_of(ids)) for ids in windows]


def validation_windows(data: Tensor, seq_len: int, batch_size: int, max_batches: int) -> list[Tensor]:
    """Consecutive non-overlapping windows of the validation text (at most ``max_batches`` batches of ``batch_size``)."""
    n = min(len(data) // seq_len, max_batches * batch_size)
    return list(data[:n * seq_len].view(n, seq_len).split(batch_size))


@torch.no_grad()
def perplexity(forward: Callable[[Tensor], Any], windows: list[Tensor]) -> float:
    """exp(mean per-token cross-entropy) of ``forward(input_ids).logits`` over every labelled token."""
    total, count = 0.0, 0
    for ids in windows:
        labels = labels_of(ids)
        logits = forward(ids).logits
        total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
    return math.exp(total / count)


def optimizer_factory(lr: float) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """AdamW for every configuration (PPLL: one per stage, over its block and its head)."""
    return lambda params: torch.optim.AdamW(params, lr=lr)


def scheduler_factory(steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """Cosine decay to zero over all ``steps``, stepped after every batch."""
    return lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


def train_e2e(model: LlamaForCausalLM, train: list[tuple[Tensor, Tensor]], val: list[Tensor],
              lr: float) -> dict[str, Any]:
    """Plain backprop through the whole model: validation perplexity before and after, training seconds."""
    model.eval()
    before = perplexity(lambda ids: model(input_ids=ids), val)
    opt = optimizer_factory(lr)(list(model.parameters()))
    sched = scheduler_factory(len(train))(opt)
    model.train()
    losses = []
    start = time.perf_counter()
    for ids, labels in train:
        opt.zero_grad(set_to_none=True)
        loss = model_loss(model(input_ids=ids), labels)  # the loss of PPLL's last stage: per-token CE of .logits
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    return {"untrained_ppl": before, "ppl": perplexity(lambda ids: model(input_ids=ids), val), "train_s": seconds,
            "compile_s": 0.0, "stage_loss": [_tail_mean(losses)], "cuts": []}


def train_ppll(model: LlamaForCausalLM, k: int, train: list[tuple[Tensor, Tensor]], val: list[Tensor], lr: float,
               runtime: str, seed: int) -> dict[str, Any]:
    """Compile ``model`` into ``k`` stages, train every stage on its own local loss, evaluate the final output."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA device.*")  # the CPU fallback is expected here
        compiled = ppll_compile.compile(model, gpus=k, example_kwargs={"input_ids": train[0][0]}, optimizer="adam")
    compile_s = time.perf_counter() - start
    compiled.eval()
    before = perplexity(lambda ids: compiled(input_ids=ids), val)  # the untrained pipeline is the model itself
    with compiled.trainer(optimizer=optimizer_factory(lr), scheduler=scheduler_factory(len(train)),
                          runtime=runtime, seed=seed) as trainer:
        losses: list[list[float]] = [[] for _ in range(k)]
        start = time.perf_counter()
        for ids, labels in train:
            for stage, finished in enumerate(trainer.step({"input_ids": ids}, labels)):
                losses[stage] += finished
        for stage, finished in enumerate(trainer.finish()):
            losses[stage] += finished
        seconds = time.perf_counter() - start
    compiled.eval()
    return {"untrained_ppl": before, "ppl": perplexity(lambda ids: compiled(input_ids=ids), val), "train_s": seconds,
            "compile_s": compile_s, "stage_loss": [_tail_mean(ls) for ls in losses],
            "cuts": [s.last_module or s.last_node for s in compiled.plan.stages[:-1]]}


def _tail_mean(values: list[float]) -> float:
    """Mean of the last tenth of ``values`` (the training loss at the end, less noisy than the last batch)."""
    tail = values[-max(1, len(values) // 10):]
    return sum(tail) / len(tail)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    header = (f"{'method':<12} {'val ppl':>8} {'untrained':>9} {'train s':>7} {'compile s':>9}  "
              f"{'train loss per stage (last 10%)':<32} cuts after")
    lines = [header]
    for r in rows:
        losses = " ".join(f"{x:.3f}" for x in r["stage_loss"])
        lines.append(f"{r['method']:<12} {r['ppl']:>8.3f} {r['untrained_ppl']:>9.2f} {r['train_s']:>7.1f} "
                     f"{r['compile_s']:>9.1f}  {losses:<32} {', '.join(r['cuts']) or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse flags, train every configuration, print the table; return its rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training batches of every configuration (default 300)")
    p.add_argument("--seq-len", type=int, default=128, help="characters per window (default 128)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's initial learning rate (cosine decay)")
    p.add_argument("--quick", action="store_true", help="a short demo run: 40 steps of 16 x 64 (overrides those flags)")
    p.add_argument("--runtime", choices=["sequential", "threads"], default="threads", help="PPLL runtime")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is faster on a busy machine)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.seq_len, args.batch_size = 40, 64, 16
    if min(args.steps, args.seq_len, args.batch_size) < 2 or args.lr <= 0:
        p.error("--steps, --seq-len and --batch-size must be >= 2 and --lr > 0")
    train_text, val_text, chars = load_corpus()
    if args.seq_len > len(val_text):
        p.error(f"--seq-len {args.seq_len} is longer than the validation text ({len(val_text)} characters)")
    train = batches(train_text, args.steps, args.batch_size, args.seq_len, args.seed)
    val = validation_windows(val_text, args.seq_len, args.batch_size, max_batches=4 if args.quick else 16)
    print(f"corpus: source of {', '.join(MODULES)}: {len(train_text)} train / {len(val_text)} validation characters, "
          f"vocabulary {len(chars)}; {args.steps} steps of {args.batch_size} x {args.seq_len}, AdamW lr {args.lr} "
          f"(cosine), seed {args.seed}, PPLL runtime {args.runtime}; validation {sum(len(v) for v in val)} windows")
    rows = []
    for method, k in (("end-to-end", 1), ("PPLL K=2", 2), ("PPLL K=4", 4)):
        torch.manual_seed(args.seed)  # the same initial weights for every configuration
        model = build_model(len(chars), args.seq_len)
        if k == 1:
            result = train_e2e(model, train, val, args.lr)
        else:
            result = train_ppll(model, k, train, val, args.lr, args.runtime, args.seed)
        rows.append({"method": method, "K": k, **result})
        print(f"  {method}: validation perplexity {result['untrained_ppl']:.2f} -> {result['ppl']:.3f} "
              f"({result['train_s']:.1f} s)", flush=True)
    print()
    print(table(rows))
    print(f"""
val ppl: exp(mean per-token cross-entropy) of the model's own output (PPLL: the pipeline's last stage), eval mode.
untrained: the same at step 0 (every configuration starts from the same weights). train s: wall-clock seconds of the
training steps (torch threads: {torch.get_num_threads()} end to end; cpu_count // K per stage under threads); compile s:
capture, planning and lowering. The stages share this machine's cores, so the times show overhead, not a speed-up.""")
    return rows


if __name__ == "__main__":
    main()

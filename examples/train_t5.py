"""Fine-tune a small T5 on a synthetic sequence-to-sequence task end to end and by PPLL local learning (K=2).

Run ``python examples/train_t5.py`` (a minute or two on two CPU cores) or ``--quick`` for a short demo. The model is
Hugging Face's ``T5ForConditionalGeneration`` built from a config in code (no download), unmodified, with random
weights; the task is to reverse (or ``--task copy``) a random sequence of tokens. The labels are a model input (T5
makes its decoder's input from them) and the per-token target. ``ppll_compile`` cuts the model between or inside its
encoder and decoder; the encoder's output travels to decoder stages beside the decoder's hidden state. Both
configurations start from the same weights and see the same batches; the table shows their losses side by side
(PPLL: the last stage's, the model's own per-token cross-entropy).
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch
from torch import Tensor
from transformers import T5Config, T5ForConditionalGeneration

import ppll_compile
from ppll_compile.heads.losses import model_loss

__all__ = ["batches", "build_model", "main", "table", "train_e2e", "train_ppll"]

SPECIAL = 2
"""Token ids below this are T5's pad (0, also the decoder's start) and end of sequence (1); the data never uses them."""


def build_model(vocab: int) -> T5ForConditionalGeneration:
    """A T5 of 2 encoder and 2 decoder layers: d_model 64, 4 heads of 16, feed-forward 128, no dropout."""
    config = T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(config)


def batches(steps: int, batch_size: int, length: int, vocab: int, task: str, seed: int) -> list[dict[str, Tensor]]:
    """``steps`` batches of random token sequences (``input_ids``) and their reversal or copy (``labels``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(SPECIAL, vocab, (batch_size, length), generator=g)
        out.append({"input_ids": ids, "labels": ids.flip(1) if task == "reverse" else ids.clone()})
    return out


def train_e2e(model: T5ForConditionalGeneration, data: list[dict[str, Tensor]], lr: float) -> dict[str, Any]:
    """Plain backprop through the whole model: the loss of every step, training seconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    start = time.perf_counter()
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = model_loss(model(**batch), batch["labels"])  # PPLL's last stage's loss: per-token CE of .logits
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "train_s": time.perf_counter() - start, "cuts": []}


def train_ppll(model: T5ForConditionalGeneration, k: int, data: list[dict[str, Tensor]], lr: float, runtime: str,
               seed: int) -> dict[str, Any]:
    """Compile ``model`` into ``k`` stages and train every stage on its local loss: the last stage's losses."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA device.*")  # the CPU fallback is expected here
        compiled = ppll_compile.compile(model, gpus=k, example_kwargs=data[0], optimizer="adam", tied="untie")
    losses: list[list[float]] = [[] for _ in range(k)]
    with compiled.trainer(optimizer=lambda p: torch.optim.AdamW(p, lr=lr), runtime=runtime, seed=seed) as trainer:
        start = time.perf_counter()
        for batch in data:
            for stage, finished in enumerate(trainer.step(batch, batch["labels"])):
                losses[stage] += finished
        for stage, finished in enumerate(trainer.finish()):
            losses[stage] += finished
        seconds = time.perf_counter() - start
    return {"losses": losses[-1], "train_s": seconds,
            "cuts": [s.last_module or s.last_node for s in compiled.plan.stages[:-1]]}


def table(e2e: list[float], ppll: list[float], every: int) -> str:
    """The two loss curves side by side, every ``every`` steps and the last."""
    lines = [f"{'step':>5} {'end-to-end':>11} {'PPLL K=2':>9}"]
    shown = sorted(set(range(0, len(e2e), every)) | {len(e2e) - 1})
    lines += [f"{i + 1:>5} {e2e[i]:>11.4f} {ppll[i]:>9.4f}" for i in shown]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse flags, train both configurations, print the table; return both results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="training batches of each configuration (default 400)")
    p.add_argument("--length", type=int, default=12, help="tokens per sequence (default 12)")
    p.add_argument("--vocab", type=int, default=24, help="vocabulary, T5's two special tokens included (default 24)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--task", choices=["reverse", "copy"], default="reverse")
    p.add_argument("--quick", action="store_true", help="a short demo: 60 steps of 16 sequences of 8 tokens")
    p.add_argument("--runtime", choices=["sequential", "threads"], default="threads", help="PPLL runtime")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the end-to-end run (default 1: each PPLL stage trains on one thread too)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.length, args.batch_size = 60, 8, 16
    if min(args.steps, args.length, args.batch_size) < 2 or args.vocab <= SPECIAL + 1 or args.lr <= 0:
        p.error(f"--steps, --length and --batch-size must be >= 2, --vocab > {SPECIAL + 1} and --lr > 0")
    data = batches(args.steps, args.batch_size, args.length, args.vocab, args.task, args.seed)
    print(f"task: {args.task} {args.length} random tokens of {args.vocab - SPECIAL}; {args.steps} steps of "
          f"{args.batch_size}, AdamW lr {args.lr}, seed {args.seed}, PPLL runtime {args.runtime}")
    torch.manual_seed(args.seed)
    model = build_model(args.vocab)
    same = {k: v.clone() for k, v in model.state_dict().items()}  # the same initial weights for both
    e2e = train_e2e(model, data, args.lr)
    model.load_state_dict(same)
    ppll = train_ppll(model, 2, data, args.lr, args.runtime, args.seed)
    print(table(e2e["losses"], ppll["losses"], every=max(1, args.steps // 10)))
    print(f"\nloss: the model's per-token cross-entropy on the training batch (PPLL: its last stage's). "
          f"train s: end-to-end {e2e['train_s']:.1f}, PPLL {ppll['train_s']:.1f}; PPLL cut after "
          f"{', '.join(ppll['cuts'])}")
    return {"e2e": e2e, "ppll": ppll, "args": vars(args)}


if __name__ == "__main__":
    main()

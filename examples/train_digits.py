"""Train one small CNN on scikit-learn's digits end to end and by PPLL local learning, and compare test accuracies.

Run ``python examples/train_digits.py`` (a minute or two on two CPU cores) or ``--quick`` for a short demo.
Every run starts from the same initial weights and sees the same batches in the same order; only the
training method differs: plain backprop (E2E) or PPLL with K stages, each trained on its own auxiliary head.
Every row computes with the same torch threads (``--threads``, default 1): E2E on that many, and every PPLL
stage on that many of its own, so the training seconds compare like with like.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import ppll_compile
from ppll_compile.heads.policy import Policy, load_policy, validate_policy

__all__ = ["DigitsCNN", "conv_bn_relu", "load_data", "optimizer_factory", "scheduler_factory", "train_e2e",
           "train_ppll", "table", "main"]

SIZE = 16
"""Side of the upsampled images. 8x8 leaves no room for a stride-2 block followed by 2x2-pooled aux heads; 16x16
(bilinear) does, while 32x32 would quadruple the compute without adding information to an 8x8 source."""
CUTS = {2: ("block2",), 4: ("block1", "block2", "block3")}
"""Hand-picked cuts at block boundaries. The automatic partitioner balances FLOPs including the aux heads, and on a
model this small that puts whole stages on just ``flatten`` or ``fc`` (try ``--auto-cuts``)."""
CONFIGS = [("e2e", 1, None), ("ppll", 2, "dgl"), ("ppll", 2, "infopro"), ("ppll", 4, "dgl"), ("ppll", 4, "infopro")]
"""(method, K, policy) of every row of the table, in order."""


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    """3x3 convolution, batch norm and ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class DigitsCNN(nn.Module):
    """Four conv-BN-ReLU blocks (16x16 with w channels, then 8x8 with 2w), global average pool, linear classifier."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.block1 = conv_bn_relu(1, width)
        self.block2 = conv_bn_relu(width, width)
        self.block3 = conv_bn_relu(width, 2 * width, stride=2)
        self.block4 = conv_bn_relu(2 * width, 2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.block4(self.block3(self.block2(self.block1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def _images(seed: int, test_size: float) -> tuple[Tensor, Tensor, Any, Any]:
    """Digits (1797 8x8 images in [0, 1]) upsampled to SIZE x SIZE, their labels, and a split stratified by ``seed``."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(torch.arange(len(y)).numpy(), test_size=test_size, stratify=y.numpy(),
                                           random_state=seed)
    return x, y, train_idx, test_idx


def image_stats(seed: int, test_size: float = 0.25) -> tuple[float, float]:
    """Mean and std of the train split's images (in [0, 1]): what :func:`load_data` normalises with."""
    x, _, train_idx, _ = _images(seed, test_size)
    return float(x[train_idx].mean()), float(x[train_idx].std())


def load_data(seed: int, test_size: float = 0.25) -> tuple[TensorDataset, TensorDataset]:
    """Digits upsampled to SIZE x SIZE, split stratified by ``seed``, normalised by the train split's stats."""
    x, y, train_idx, test_idx = _images(seed, test_size)
    mean, std = image_stats(seed, test_size)
    x = (x - mean) / std
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def head_policy(name: str, seed: int) -> str | Policy:
    """The policy ``name`` for these images: InfoPro's decoder reconstructs them in [0, 1], so its heads get the
    digits' mean and std to de-normalise with (the shipped file has CIFAR's, for 3 channels)."""
    if name != "infopro":
        return name
    shipped = load_policy("infopro")
    mean, std = image_stats(seed)
    heads = {kind: dict(config) for kind, config in shipped.heads.items()}
    heads["feature_map"] |= {"mean": [mean], "std": [std]}
    return validate_policy({"name": "infopro", "heads": heads, "loss": dict(shipped.loss)}, "infopro for digits")


def optimizer_factory(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer every method uses: Adam.

    SGD with momentum 0.9 works for E2E and DGL, but from lr 0.02 on it diverges in InfoPro's decoder (its last
    conv sees 12 x 3 x 3 ReLU inputs and the reconstruction loss has weight 5); Adam is stable for all methods.
    """
    return lambda params: torch.optim.Adam(params, lr=lr)


def scheduler_factory(steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """Cosine decay to zero over all ``steps``, stepped after every batch.

    The decay matters for local learning: BatchNorm's running statistics in a stage trail its input, which the
    stages before it keep changing; once the learning rate is small, they catch up before evaluation.
    """
    return lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads, then restore the number before."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_e2e(model: nn.Module, train: DataLoader, test: DataLoader, epochs: int, lr: float,
              threads: int = 1) -> dict[str, Any]:
    """Plain backprop through the whole model on ``threads`` torch threads; test accuracy and training seconds."""
    opt = optimizer_factory(lr)(list(model.parameters()))
    sched = scheduler_factory(epochs * len(train))(opt)
    start = time.perf_counter()
    with torch_threads(threads):
        for _ in range(epochs):
            model.train()
            for x, y in train:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        right = sum(int((model(x).argmax(1) == y).sum()) for x, y in test)
    return {"accuracy": right / len(test.dataset), "stage_accuracy": [], "train_s": seconds}


def train_ppll(model: nn.Module, k: int, policy: Any, train: DataLoader, test: DataLoader, epochs: int,
               lr: float, runtime: str, auto_cuts: bool = False, threads: int = 1) -> dict[str, Any]:
    """Compile ``model`` into ``k`` stages with ``policy`` aux heads, train by local learning (every stage on
    ``threads`` torch threads), evaluate every head."""
    example = train.dataset[:train.batch_size][0]  # not next(iter(train)): that would advance the shuffle RNG
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA device.*")  # the CPU fallback is expected here
        compiled = ppll_compile.compile(model, gpus=k, example_inputs=(example,), policy=policy, optimizer="adam",
                                           split_points=None if auto_cuts else CUTS[k])
    with torch_threads(threads), compiled.trainer(  # sequential: the stages run in this thread
            optimizer=optimizer_factory(lr), scheduler=scheduler_factory(epochs * len(train)), runtime=runtime,
            threads_per_stage=threads if runtime == "threads" else None) as trainer:
        history = trainer.fit(train, epochs=epochs, progress=sys.stderr.isatty())
        result = trainer.evaluate(test)
    return {"accuracy": result["accuracy"], "stage_accuracy": result["stage_accuracy"][:-1],
            "train_s": sum(h["seconds"] for h in history),
            "cuts": [s.last_module or s.last_node for s in compiled.plan.stages[:-1]]}


def table(rows: list[dict[str, Any]], threads: int = 1) -> str:
    """The rows as an aligned text table; ``threads``: the torch threads of E2E and of every PPLL stage."""
    seconds = f"train s ({threads} thread{'s' if threads > 1 else ''} each)"
    lines = [f"{'method':<6} {'K':>2} {'policy':<8} {'test acc':>8}  {'aux-head acc (stage 1..K-1)':<28} "
             f"{seconds:>7}  cuts after"]
    for r in rows:
        aux = " ".join(f"{a:.3f}" if a is not None else "n/a" for a in r["stage_accuracy"]) or "-"
        cuts = ", ".join(r.get("cuts", [])) or "-"
        lines.append(f"{r['method']:<6} {r['K']:>2} {r['policy'] or '-':<8} {r['accuracy']:>8.3f}  {aux:<28} "
                     f"{r['train_s']:>{len(seconds)}.1f}  {cuts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse flags, run every configuration, print the table (and save it with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="training epochs of every method (default 10)")
    p.add_argument("--quick", action="store_true", help="a short demo run: 2 epochs")
    p.add_argument("--runtime", choices=["threads", "sequential"], default="threads", help="PPLL runtime")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's initial learning rate (cosine decay)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of E2E and of every PPLL stage (default 1)")
    p.add_argument("--auto-cuts", action="store_true", help="let the partitioner choose the cuts")
    p.add_argument("--json", metavar="PATH", help="also write the table (and the settings) as JSON")
    args = p.parse_args(argv)
    epochs = 2 if args.quick else args.epochs
    if epochs < 1 or args.batch_size < 1 or args.threads < 1 or args.lr <= 0:
        p.error(f"--epochs, --batch-size and --threads must be >= 1 and --lr > 0; got {epochs}, {args.batch_size}, "
                f"{args.threads}, {args.lr}")

    train_set, test_set = load_data(args.seed)
    test = DataLoader(test_set, batch_size=256)
    print(f"digits: {len(train_set)} train / {len(test_set)} test images, {SIZE}x{SIZE}; {epochs} epochs, "
          f"batch {args.batch_size}, Adam lr {args.lr} (cosine), seed {args.seed}, PPLL runtime {args.runtime}, "
          f"{args.threads} torch thread{'s' if args.threads > 1 else ''} for E2E and for every PPLL stage")
    rows = []
    for method, k, policy in CONFIGS:
        torch.manual_seed(args.seed)  # same initial weights for every row
        model = DigitsCNN()
        train = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                           generator=torch.Generator().manual_seed(args.seed))  # same batches for every row
        if method == "e2e":
            result = train_e2e(model, train, test, epochs, args.lr, args.threads)
        else:
            result = train_ppll(model, k, head_policy(policy, args.seed), train, test, epochs, args.lr, args.runtime,
                                args.auto_cuts, args.threads)
        rows.append({"method": method, "K": k, "policy": policy, **result})
        print(f"  {method} K={k} {policy or 'backprop'}: test accuracy {result['accuracy']:.3f} "
              f"({result['train_s']:.1f} s)", flush=True)
    print()
    print(table(rows, args.threads))
    each = f"{args.threads} torch thread{'s' if args.threads > 1 else ''}"
    print(f"""
test acc: the model's own output (PPLL: its last stage). aux-head acc: each earlier stage's head (discarded after).
train s: wall-clock training seconds, E2E on {each} and every PPLL stage on {each} of its own ({args.runtime}).
All stages share this machine's cores, so this shows overhead, not the speed-up of a device per stage; noisy on a
busy machine.""")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args) | {"epochs": epochs, "image_size": SIZE}, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()

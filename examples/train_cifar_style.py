"""Train ResNet-32 on CIFAR-shaped data by pipelined local learning: the template to copy for your own model and data.

One process per stage (one GPU each when there are GPUs), the same script on every process::

    torchrun --nproc-per-node=2 examples/train_cifar_style.py --synthetic

One process, a thread per stage (the default without torchrun), or every stage in turn::

    python examples/train_cifar_style.py --synthetic
    python examples/train_cifar_style.py --synthetic --runtime sequential

Your own data: save ``train.pt`` and ``test.pt`` into a folder, each ``(images, labels)`` with images
N x 3 x 32 x 32 float and labels N int64, and pass ``--data-dir FOLDER`` (or replace ``load_data`` below
with your own Dataset). Two machines: run torchrun on each with ``--nnodes=2 --node-rank=0|1
--master-addr=FIRST_MACHINE --master-port=29500``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # resnet32.py sits next to this file

from resnet32 import build_model  # noqa: E402

import ppll_compile  # noqa: E402
from ppll_compile import CheckpointError  # noqa: E402
from ppll_compile.runtime.checkpoint import latest  # noqa: E402

NUM_CLASSES = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    torchrun = "WORLD_SIZE" in os.environ  # torchrun sets it for every process it starts
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--synthetic", action="store_true",
                      help="generated images: a smooth colour pattern per class, shifted, plus noise")
    data.add_argument("--data-dir", type=Path, help="folder with train.pt and test.pt (see the module docstring)")
    p.add_argument("--runtime", choices=["sequential", "threads", "distributed"],
                   default="distributed" if torchrun else "threads")
    p.add_argument("--gpus", type=int, default=int(os.environ["WORLD_SIZE"]) if torchrun else 2,
                   help="pipeline stages (= processes under torchrun)")
    p.add_argument("--policy", default="dgl", help="aux-head policy: dgl, infopro, mlp, auto or a YAML file")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps-per-epoch", type=int, default=None,
                   help="batches per epoch (default: 20 with --synthetic, the whole training set otherwise)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", type=Path, default=None, help="folder: saved after every epoch, resumed from")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def synthetic_data(n: int, seed: int = 1234, noise: float = 1.0) -> TensorDataset:
    """``n`` CIFAR-shaped images a CNN can learn: each class has its own smooth colour pattern (a random 3 x 4 x 4
    map upsampled to 32 x 32), and every image is its class's pattern, shifted by up to 4 pixels, plus Gaussian
    noise. The same ``seed`` gives the same patterns (and images) on every process."""
    g = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(NUM_CLASSES, 3, 4, 4, generator=g), size=(40, 40), mode="bilinear",
                             align_corners=False)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    dx, dy = torch.randint(0, 9, (2, n), generator=g)
    x = torch.stack([patterns[c, :, i:i + 32, j:j + 32] for c, i, j in zip(y.tolist(), dy.tolist(), dx.tolist())])
    return TensorDataset(x + noise * torch.randn(x.shape, generator=g), y)


def load_data(args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """The training and test sets. Put your own loading here (torchvision.datasets.CIFAR10, ...)."""
    if args.synthetic:
        steps = args.steps_per_epoch or 20
        n_train, n_test = steps * args.batch_size, max(args.batch_size, steps * args.batch_size // 5)
        data = synthetic_data(n_train + n_test)
        return Subset(data, range(n_train)), Subset(data, range(n_train, n_train + n_test))
    train, test = (TensorDataset(*torch.load(args.data_dir / f"{name}.pt", weights_only=True))  # tensors only
                   for name in ("train", "test"))
    if args.steps_per_epoch is not None:
        train = Subset(train, range(min(len(train), args.steps_per_epoch * args.batch_size)))
    return train, test


class PrintEpochs(ppll_compile.Callback):
    """One line per epoch, on the main process (under torchrun: the last stage's): every stage's loss, samples/s."""

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_epoch_end(self, trainer: ppll_compile.Trainer, record: dict) -> None:
        if trainer.is_main:
            losses = "  ".join(f"s{i} {loss:.3f}" for i, loss in enumerate(record["loss"]) if loss is not None)
            print(f"epoch {record['epoch']}/{self.epochs}: loss per stage {losses}  "
                  f"({record['samples_per_s']:.0f} samples/s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # every process must build the same model and aux heads
    train_set, test_set = load_data(args)
    # under torchrun only the first stage's process iterates the loaders; the others only ask their length. With
    # --checkpoint, fit seeds every epoch's order itself (no generator= here), so a resumed run draws the same order
    # as one that never stopped
    order = None if args.checkpoint is not None else torch.Generator().manual_seed(args.seed)
    train = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=order)
    test = DataLoader(test_set, batch_size=args.batch_size)

    # compile: trace the model, cut it into args.gpus stages and give every stage but the last an aux head
    model = build_model(NUM_CLASSES)
    # devices: the CPU where this machine has fewer GPUs than --gpus (said, rather than left to a fallback that
    # warns); optimizer: the one trained below (SGD with momentum), so that the plan counts its state
    devices = None if torch.cuda.device_count() >= args.gpus else ["cpu"] * args.gpus
    compiled = ppll_compile.compile(model, args.gpus, devices=devices, policy=args.policy, optimizer="momentum",
                                    example_inputs=(torch.randn(args.batch_size, 3, 32, 32),))
    trainer = compiled.trainer(
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=5e-4),
        runtime=args.runtime)

    with trainer:  # closes worker threads or the process group, also on errors
        if trainer.is_main:  # under torchrun: the process of the last stage
            print(compiled.plan.table(), flush=True)
        if args.checkpoint is not None and latest(args.checkpoint) is None and trainer.is_main:
            print(f"no checkpoint in {args.checkpoint} yet: training from epoch 1, saving there after every epoch",
                  flush=True)
        try:  # epochs counts from the start of training: a run started again goes on where the checkpoint stands
            trainer.fit(train, epochs=args.epochs, checkpoint=args.checkpoint, callbacks=[PrintEpochs(args.epochs)])
        except CheckpointError as e:  # a checkpoint that cannot be loaded stops the run (it is never overwritten)
            raise SystemExit(f"--checkpoint {args.checkpoint}: {e}\nIt is left as it is: pass another --checkpoint "
                             f"folder, or remove this one to train from scratch") from None
        result = trainer.evaluate(test)
        if trainer.is_main:
            heads = "  ".join(f"s{i} {a:.3f}" for i, a in enumerate(result["stage_accuracy"]) if a is not None)
            print(f"final accuracy {result['accuracy']:.3f} on {result['samples']} test images "
                  f"(per stage head: {heads})", flush=True)


if __name__ == "__main__":
    main()

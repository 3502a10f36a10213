"""Pipe-BD: distil MobileNetV2 into a slimmer MobileNet block by block, with the blocks pipelined over devices.

The teacher is torchvision's MobileNetV2 (random weights with calibrated BatchNorm statistics, or yours with
``--teacher-weights``); the student, below, has the same stage widths (16, 24, 32, 64, 96, 160, 320, then
1280 and the classifier) but fewer inverted-residual blocks per stage and a smaller expansion ratio.
``ppll_compile.compile(student, teacher=...)`` aligns both automatically by stage output shape, so student
block k learns to map the teacher's output of block k-1 to its output of block k, on CIFAR-sized 32x32
images: no labels needed. The script prints the plan, trains on random images, and evaluates the block
losses on held-out random images before and after::

    python examples/pipebd_mobilenet.py                       # a thread per stage (or --runtime sequential|dna)
    torchrun --nproc-per-node=<plan.world_size> examples/pipebd_mobilenet.py --runtime distributed

``plan.world_size`` (one process per replica of every stage) is printed in the plan's first line; see it
without training with ``ppll-plan examples/pipebd_mobilenet.py --mode pipebd --gpus 2 --policy mse --optimizer adam``
(the policy and optimizer this script trains with). Under
torchrun the last stage's process prints, and its step lines show only its own stage's loss.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torchvision
from torch import Tensor, nn

import ppll_compile

__all__ = ["InvertedResidual", "SlimMobileNet", "build_teacher", "build_model", "example_inputs", "main"]

NUM_CLASSES = 10
STAGES = [(1, 16, 1, 1), (4, 24, 1, 2), (3, 32, 2, 2), (4, 64, 2, 2), (4, 96, 2, 1), (3, 160, 2, 2), (4, 320, 1, 1)]
"""Student stages as (expansion, out channels, blocks, stride of the first), like torchvision's table for the
teacher: blocks (1, 2, 3, 4, 3, 3, 1), expansion 6. Only the first block of a stage has legal cuts inside it
(its hidden tensors), and the alignment matches cuts by shape: with the teacher's 6 the hidden tensors match
too and blocks end inside inverted residuals; with 4 everywhere the 32 and 160 stages would have hidden
tensors of a teacher hidden tensor's shape (96x8x8, 384x2x2), a tie the matching breaks the right way only by
luck. With 3 there, no student hidden tensor has the shape of any teacher cut: every block ends at a stage end."""


def conv_bn(cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU6(inplace=True)) if act else nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expansion, 3x3 depthwise (strided), 1x1 linear projection; identity shortcut when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        expand = [conv_bn(cin, hidden)] if expansion != 1 else []
        self.conv = nn.Sequential(*expand, conv_bn(hidden, hidden, 3, stride, groups=hidden),
                                  conv_bn(hidden, cout, act=False))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


class SlimMobileNet(nn.Module):
    """A 16-channel stem, the STAGES of inverted residuals, a 1x1 conv to 1280, pooling and a linear classifier."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        layers, cin = [conv_bn(3, 16, 3, stride=2)], 16  # the teacher's stem has 32 channels: see STAGES
        for t, c, n, s in STAGES:
            layers += [InvertedResidual(cin if i == 0 else c, c, s if i == 0 else 1, t) for i in range(n)]
            cin = c
        self.features = nn.Sequential(*layers, conv_bn(cin, 1280))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(1280, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


@torch.no_grad()
def calibrate(model: nn.Module, batches: int = 8) -> None:
    """Set the BatchNorm running statistics to their mean over random batches, then switch to eval mode.

    With the fresh statistics (mean 0, variance 1) a random teacher's eval-mode block outputs have arbitrary
    scales, many near zero: trivial targets. A teacher loaded from a file keeps its own statistics.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative mean
    model.train()
    for _ in range(batches):
        model(torch.randn(64, 3, 32, 32))
    for m in norms:
        m.momentum = 0.1
    model.eval()


def build_teacher(weights: str | Path | None = None) -> nn.Module:
    """torchvision's MobileNetV2 for NUM_CLASSES classes: random, BatchNorm-calibrated, or from a state_dict file."""
    teacher = torchvision.models.mobilenet_v2(num_classes=NUM_CLASSES)
    if weights is None:
        calibrate(teacher)
    else:
        path = Path(weights)
        if not path.is_file():
            raise SystemExit(f"--teacher-weights: no file {str(path)!r}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: runs no pickled code
        except Exception as e:  # not a file torch.save wrote, or one holding more than tensors
            raise SystemExit(f"--teacher-weights: torch.load cannot read {path}: {type(e).__name__}: {e}") from None
        try:
            teacher.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
        except (RuntimeError, TypeError, AttributeError) as e:  # not a dict, or other names or shapes
            lines = str(e).strip().splitlines()
            more = f"\n\t... {len(lines) - 6} more lines" if len(lines) > 6 else ""
            raise SystemExit(f"--teacher-weights: {path} does not hold a state_dict of torchvision's mobilenet_v2("
                             f"num_classes={NUM_CLASSES}) (save one with torch.save(model.state_dict(), PATH)):\n"
                             + "\n".join(lines[:6]) + more) from None
    return teacher


def build_model() -> nn.Module:
    """The student, freshly initialised."""
    return SlimMobileNet()


def example_inputs() -> tuple[Tensor, ...]:
    """One batch of 32 CIFAR-sized images (planning uses only its shape and dtype)."""
    return (torch.randn(32, 3, 32, 32),)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2, help="devices to plan for (stages times replicas)")
    p.add_argument("--steps", type=int, default=20, help="training batches")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--runtime", choices=["sequential", "threads", "distributed", "dna"], default="threads")
    p.add_argument("--policy", choices=["mse", "kl"], default="mse", help="loss of the last block (mse on all others)")
    p.add_argument("--teacher-weights", metavar="PATH", help="a state_dict of mobilenet_v2(num_classes=10)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a short run (for tests): 50 steps of batch 16")
    args = p.parse_args(argv)
    steps, batch = (50, 16) if args.quick else (args.steps, args.batch_size)
    if steps < 1 or batch < 1 or args.lr <= 0:
        p.error(f"--steps and --batch-size must be >= 1 and --lr > 0; got {steps}, {batch}, {args.lr}")

    torch.manual_seed(args.seed)  # under torchrun every process builds the same student and data
    teacher, student = build_teacher(args.teacher_weights), build_model()
    data = torch.Generator().manual_seed(args.seed + 1)
    held_out = [(torch.randn(4 * batch, 3, 32, 32, generator=data), None)]  # no labels: the teacher gives targets
    # the CPU where this machine has fewer GPUs than --gpus (said, rather than left to a fallback that warns)
    devices = None if torch.cuda.device_count() >= args.gpus else ["cpu"] * args.gpus
    compiled = ppll_compile.compile(student, teacher=teacher, gpus=args.gpus, devices=devices, policy=args.policy,
                                    optimizer="adam", example_inputs=(torch.randn(batch, 3, 32, 32),))
    optimizer = lambda params: torch.optim.Adam(params, lr=args.lr)  # noqa: E731 (the plan's optimizer="adam")
    with compiled.trainer(optimizer=optimizer, runtime=args.runtime) as trainer:
        say = print if trainer.is_main else (lambda *a, **k: None)  # under torchrun: the last stage's process
        say(compiled.plan.table(), flush=True)
        before = trainer.evaluate(held_out)
        latest: list[float | None] = [None] * compiled.plan.num_stages  # a pipeline reports each stage's losses late
        start = time.perf_counter()
        for step in range(1, steps + 1):
            losses = trainer.step(torch.randn(batch, 3, 32, 32, generator=data))  # the same batches on every rank
            if step == steps:
                losses = [a + b for a, b in zip(losses, trainer.finish())]
            latest = [ls[-1] if ls else old for ls, old in zip(losses, latest)]
            if step % max(1, steps // 5) == 0 or step == steps:
                say(f"step {step}/{steps}: latest loss per stage  " + "  ".join(
                    f"s{i} {v:.4f}" if v is not None else f"s{i} -" for i, v in enumerate(latest)), flush=True)
        seconds = time.perf_counter() - start
        after = trainer.evaluate(held_out)
    if trainer.is_main:
        print(f"{steps * batch / seconds:.1f} samples/s ({steps} steps of {batch} in {seconds:.1f} s, runtime "
              f"{args.runtime})")
        print(f"held-out block losses (eval mode, {before['samples']} images), their sum first:")
        for name, result in (("before", before), ("after", after)):
            print(f"block loss {name}: {result['loss']:.4f}  = " + " + ".join(f"{v:.4f}" for v in result["block_loss"]))
    return {"before": before["block_loss"], "after": after["block_loss"]}


if __name__ == "__main__":
    main()

"""Auxiliary heads as deep as the papers use them: (a) PPLL's throughput against torch.distributed.pipelining as the
small ViT's head deepens (0, 1, 2, 4 transformer blocks), on one split; (b) test accuracy on scikit-learn's digits of
every head type: DGL's conv, MLP, InfoPro, momentum (MAN) on the digits CNN, and token, transformer (fresh and copied
blocks) and momentum heads on a tiny ViT.

``python -m benchmarks.heads [--quick] [--out DIR]`` writes ``heads.json``, ``heads.md`` and ``heads.png``; ``--quick``
measures heads of 0 and 2 blocks and trains one epoch on one seed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import ppll_compile
from ppll_compile.heads import MomentumHead
from ppll_compile.heads.policy import Policy, load_policy, validate_policy

from .launch import load_example, one_thread, timed_steps
from .pipelining import best_pipelining
from .report import Section, standalone

__all__ = ["DEPTHS", "TinyViT", "section", "throughput", "accuracy", "main"]

DEPTHS = (0, 1, 2, 4)
"""Transformer blocks in the ViT's auxiliary head, for the throughput part."""
VIT_CUT = "add_6"
"""The split of ``examples/vit_small.py`` in both pipelines: after blocks.2, the middle of its 6 blocks."""
BATCH = 16
LOCAL_LINK = 1e13
"""Bytes/s the simulator assumes between threads of one process (as in the throughput benchmark)."""
LR = 1e-3
DIGITS_BATCH = 32
CNN_CUT = ("blocks_1_2",)
"""The digits CNN's cut for K=2, where ``examples/train_digits.py`` makes it: after its second block."""
TINY_VIT_CUT = ("add_4",)
"""The tiny ViT's cut for K=2: after blocks.1, the middle of its 4 blocks."""
MLP = {"type": "mlp", "hidden": 256, "depth": 1}


def _policy(name: str, **heads: Any) -> Policy:
    """An inline policy: the given head configs by kind, MLP heads for the other kinds."""
    return validate_policy({"name": name, "heads": {"vector": MLP, **heads}}, name)


def _transformer(depth: int, init: str = "fresh") -> Policy:
    return _policy(f"transformer d={depth} {init}",
                   sequence={"type": "transformer", "depth": depth, "init": init, "pool": "cls"})


# ---- (a) throughput --------------------------------------------------------------------------------------------
def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _compiled(policy: Policy | str) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(0)
    vit = load_example("vit_small")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback
        return ppll_compile.compile(vit.build_model(10), 2, example_inputs=(torch.randn(BATCH, 3, 32, 32),),
                                    policy=policy, split_points=[VIT_CUT])


def throughput(*, steps: int, warmup: int, rounds: int, microbatches: tuple[int, ...],
               depths: tuple[int, ...] = DEPTHS) -> dict:
    """PPLL threads (2 stages, one thread each) with a transformer head of every depth in ``depths``, against the
    best torch pipelining schedule on the same split (which has no head, so it is measured once). Each round runs
    every depth once, in turn; figures are medians."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(steps + warmup)]
    runs: dict[int, list[float]] = {d: [] for d in depths}
    plans = {d: _compiled(_transformer(d)).plan for d in depths}
    with one_thread():
        for _ in range(rounds):
            for d in depths:
                runs[d].append(timed_steps(_compiled(_transformer(d)).trainer(optimizer=_sgd, runtime="threads",
                                                                          threads_per_stage=1), data, warmup))
    vit = load_example("vit_small")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback
        split = ppll_compile.plan(vit.build_model(10), 2, example_inputs=vit.example_inputs(), policy="vit",
                                  split_points=[VIT_CUT])  # torch's ranks compile with the example's own inputs
    with tempfile.TemporaryDirectory() as folder:  # the split, for torch's ranks
        torch_runs = best_pipelining("vit_small", microbatch_counts=microbatches, steps=steps, warmup=warmup,
                                     batch=BATCH, world=2, plan=str(split.save(Path(folder) / "plan.json")))
    best_name, best = max(((s, torch_runs[s]) for s in ("gpipe", "1f1b") if s in torch_runs),
                          key=lambda kv: kv[1]["samples_per_s"])
    rows = []
    simulated = {d: ppll_compile.simulate(plans[d], steps=steps + warmup, link_bandwidth=LOCAL_LINK).throughput
                 for d in depths}
    for d in depths:
        p = plans[d]
        head = p.stages[0].head
        ppll = statistics.median(runs[d])
        rows.append({"depth": d, "ppll_threads": ppll, "runs": runs[d], "ppll/torch": ppll / best["samples_per_s"],
                     "head_params": head.param_count, "head_gflop": (head.flops_fwd + head.flops_bwd) / 1e9,
                     "stage_gflop": [(s.flops_fwd + s.flops_bwd + s.aux_flops) / 1e9 for s in p.stages],
                     "measured_vs_d0": ppll / statistics.median(runs[depths[0]]),
                     "planned_vs_d0": simulated[d] / simulated[depths[0]]})
    return {"batch": BATCH, "steps": steps, "warmup": warmup, "rounds": rounds, "cut": VIT_CUT, "rows": rows,
            "torch_best": {"schedule": best_name, **best}, "torch_all": torch_runs["all"]}


# ---- (b) accuracy on digits ------------------------------------------------------------------------------------
class BlocksCNN(nn.Module):
    """``examples/train_digits.py``'s CNN with its four conv-BN-ReLU blocks in a Sequential (a container of blocks,
    which a momentum head needs); built in the same order, so from the same seed it has the same weights."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        block = load_example("train_digits").conv_bn_relu
        self.blocks = nn.Sequential(block(1, width), block(width, width), block(width, 2 * width, stride=2),
                                    block(2 * width, 2 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(x)), 1))


class TinyViT(nn.Module):
    """A ViT for 1-channel 16x16 digits: patches of 4 (16 tokens) plus CLS, width 64, 4 blocks of 2 heads
    (``examples/vit_small.py``'s block), LayerNorm, linear on the CLS token."""

    def __init__(self, num_classes: int = 10, dim: int = 64, depth: int = 4, heads: int = 2) -> None:
        super().__init__()
        block = load_example("vit_small").Block
        self.patch_embed = nn.Conv2d(1, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.Sequential(*[block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def _configs(seed: int) -> list[tuple[str, str, Any]]:
    """(model, row name, policy or None for E2E) of every accuracy row, in table order."""
    mean, std = load_example("train_digits").image_stats(seed)
    infopro = dict(load_policy("infopro").heads["feature_map"]) | {"mean": [mean], "std": [std]}
    momentum = {"type": "momentum", "depth": 1, "momentum": 0.99, "every": 1}
    return [
        ("cnn", "E2E", None),
        ("cnn", "dgl (conv x2)", "dgl"),
        ("cnn", "mlp", "mlp"),
        ("cnn", "infopro (digits mean/std)", _policy("infopro-digits", feature_map=infopro)),
        ("cnn", "momentum (EMA of block 3)", _policy("momentum", feature_map=momentum)),
        ("vit", "E2E", None),
        ("vit", "token (vit, d=0)", "vit"),
        ("vit", "transformer fresh d=1", _transformer(1)),
        ("vit", "transformer fresh d=2", _transformer(2)),
        ("vit", "transformer copy d=1", _transformer(1, "copy")),
        ("vit", "transformer copy d=2", _transformer(2, "copy")),
        ("vit", "momentum d=1", _policy("momentum", sequence=momentum | {"pool": "cls"})),
    ]


def _train_ppll(model: nn.Module, cuts: tuple[str, ...], policy: Any, train: DataLoader, test: DataLoader,
                epochs: int) -> dict[str, Any]:
    digits = load_example("train_digits")
    example = train.dataset[:train.batch_size][0]  # not next(iter(train)): that would advance the shuffle RNG
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback
        compiled = ppll_compile.compile(model, gpus=len(cuts) + 1, example_inputs=(example,), policy=policy,
                                        split_points=list(cuts))
    head = compiled.lowered.heads[0]
    ema = [t.clone() for t in head.ema_tensors()] if isinstance(head, MomentumHead) else []
    with compiled.trainer(optimizer=digits.optimizer_factory(LR), scheduler=digits.scheduler_factory(
            epochs * len(train)), runtime="sequential") as trainer:
        history = trainer.fit(train, epochs=epochs, progress=False)
        result = trainer.evaluate(test)
    out = {"accuracy": result["accuracy"], "aux_accuracy": result["stage_accuracy"][0],
           "train_s": sum(h["seconds"] for h in history), "head_params": compiled.plan.stages[0].head.param_count}
    if ema:  # the runtime pulled the next stage's weights into the EMA trunk
        out["ema_moved"] = any(not torch.equal(a, b) for a, b in zip(ema, head.ema_tensors()))
    return out


def _seed_rows(epochs: int, seed: int) -> list[dict[str, Any]]:
    """Every row of :func:`_configs` from the same initial weights (per model) on the same batches of ``seed``."""
    digits = load_example("train_digits")
    train_set, test_set = digits.load_data(seed)
    test = DataLoader(test_set, batch_size=256)
    torch.manual_seed(seed)
    same = [torch.equal(a, b) for a, b in zip(digits.DigitsCNN().state_dict().values(),
                                              (torch.manual_seed(seed), BlocksCNN())[1].state_dict().values())]
    assert all(same) and len(same) == len(BlocksCNN().state_dict()), "BlocksCNN must start as DigitsCNN"
    rows = []
    for model_name, name, policy in _configs(seed):
        torch.manual_seed(seed)
        model = BlocksCNN() if model_name == "cnn" else TinyViT()
        train = DataLoader(train_set, batch_size=DIGITS_BATCH, shuffle=True,
                           generator=torch.Generator().manual_seed(seed))
        cuts = CNN_CUT if model_name == "cnn" else TINY_VIT_CUT
        if policy is None:
            r = digits.train_e2e(model, train, test, epochs, LR)
            r = {"accuracy": r["accuracy"], "aux_accuracy": None, "train_s": r["train_s"], "head_params": 0}
        else:
            r = _train_ppll(model, cuts, policy, train, test, epochs)
        rows.append({"model": model_name, "name": name, "cut": None if policy is None else cuts[0], **r})
        print(f"  seed {seed} {model_name} {name}: test accuracy {r['accuracy']:.3f} ({r['train_s']:.1f} s)",
              flush=True)
    return rows


def accuracy(*, epochs: int, seeds: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:
    """Per row of :func:`_configs`: test accuracy of the model and of the stage-0 head, mean over ``seeds``."""
    with one_thread():
        runs = [_seed_rows(epochs, seed) for seed in seeds]
    rows = []
    for per_seed in zip(*runs):
        first = per_seed[0]
        aux = [r["aux_accuracy"] for r in per_seed]
        rows.append({**{k: first[k] for k in ("model", "name", "cut", "head_params")},
                     "accuracy": statistics.mean(r["accuracy"] for r in per_seed),
                     "accuracy_per_seed": [r["accuracy"] for r in per_seed],
                     "aux_accuracy": None if None in aux else statistics.mean(aux), "aux_accuracy_per_seed": aux,
                     "train_s": statistics.mean(r["train_s"] for r in per_seed),
                     **({"ema_moved": all(r["ema_moved"] for r in per_seed)} if "ema_moved" in first else {})})
    return rows


# ---- report ----------------------------------------------------------------------------------------------------
def _plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1, 1.5]})
    t = res["throughput"]
    depths = [r["depth"] for r in t["rows"]]
    ax1.plot(depths, [r["ppll_threads"] for r in t["rows"]], "o-", label="PPLL threads (2 stages)")
    base = t["rows"][0]["ppll_threads"]
    ax1.plot(depths, [base * r["planned_vs_d0"] for r in t["rows"]], "k_", markersize=14, markeredgewidth=2,
             label="planned trend (simulated, scaled to d=0)")
    best = t["torch_best"]
    ax1.axhline(best["samples_per_s"], color="C1", ls="--",
                label=f"torch {best['schedule']} ({best['microbatches']} mb), no head")
    ax1.set_xticks(depths)
    ax1.set_xlabel("transformer blocks in the stage-0 head")
    ax1.set_ylabel("samples / s")
    ax1.set_ylim(bottom=0)
    ax1.set_title(f"Small ViT, batch {t['batch']}, one thread per stage", fontsize=9)
    ax1.legend(fontsize=8)
    rows = res["accuracy"]
    colors = ["C0" if r["model"] == "cnn" else "C2" for r in rows]
    ax2.bar(range(len(rows)), [r["accuracy"] for r in rows], color=colors)
    ax2.plot(range(len(rows)), [r["aux_accuracy"] if r["aux_accuracy"] is not None else float("nan") for r in rows],
             "k.", label="stage-0 head")
    ax2.set_xticks(range(len(rows)), [f"{r['model']}: {r['name']}" for r in rows], rotation=35, ha="right",
                   fontsize=7)
    ax2.set_ylim(0, 1.02)
    ax2.set_ylabel("test accuracy (model output; dot: stage-0 head)")
    ax2.set_title(f"Digits, K=2, {res['epochs']} epochs, mean over seeds {res['seeds']}", fontsize=9)
    ax2.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(res: dict) -> str:
    t = res["throughput"]
    best = t["torch_best"]
    lines = [f"(a) `examples/vit_small.py` (6 blocks, width 192) cut after blocks.2 (`{t['cut']}`) into 2 stages, "
             f"batch {t['batch']}, {t['steps']} timed steps after {t['warmup']} warm-up steps, median of "
             f"{t['rounds']} interleaved rounds, one thread per stage, SGD momentum. PPLL (threads runtime) trains a "
             f"transformer head of d fresh blocks on stage 0; torch.distributed.pipelining trains the same split end "
             f"to end (no head): best {best['schedule']} with {best['microbatches']} microbatches, "
             f"{best['samples_per_s']:.1f} samples/s. This machine is shared and noisy: compare figures within a run.",
             "",
             "**stage GFLOP**: forward + backward per batch of stage 0 (with its head) and stage 1, as planned; "
             "**vs d=0**: throughput over that of the 1-layer read-out, measured and as the plan's simulation "
             "predicts it (from FLOPs).", "",
             "| head blocks d | head params | head GFLOP | stage GFLOP | PPLL samples/s | vs d=0 measured | "
             "vs d=0 planned | PPLL/torch |", "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in t["rows"]:
        lines.append(f"| {r['depth']} | {r['head_params']:,} | {r['head_gflop']:.2f} | "
                     f"{' / '.join(f'{v:.1f}' for v in r['stage_gflop'])} | {r['ppll_threads']:.1f} | "
                     f"{r['measured_vs_d0']:.2f} | {r['planned_vs_d0']:.2f} | {r['ppll/torch']:.2f}x |")
    lines += ["", f"(b) scikit-learn digits (16x16, `examples/train_digits.py`'s data and optimizer: Adam lr {LR:g}, "
              f"cosine, batch {DIGITS_BATCH}), {res['epochs']} epochs, mean over seeds "
              f"{', '.join(map(str, res['seeds']))} (each: its own split, initial weights and batches, the same for "
              "every row of a model), K=2, sequential runtime "
              "(the pipelined runtimes compute the same with FIFO queues). cnn: the example's 4-block CNN with its "
              f"blocks in a Sequential (same layers and initial weights), cut after its second block "
              f"(`{CNN_CUT[0]}`, as the example cuts it); vit: a tiny ViT (patch 4, width 64, 4 blocks) cut after "
              f"blocks.1 (`{TINY_VIT_CUT[0]}`). InfoPro de-normalises with the digits' own mean and std; a momentum "
              "head follows the next block (the CNN's third conv-BN-ReLU, the ViT's third block) with momentum 0.99 "
              "at every step. Few seeds: differences of a point or two are noise.", "",
              "| model | head | test acc | per seed | stage-0 head acc | head params | train s |",
              "|---|---|---:|---|---:|---:|---:|"]
    for r in res["accuracy"]:
        aux = "-" if r["aux_accuracy"] is None else f"{r['aux_accuracy']:.3f}"
        moved = "" if "ema_moved" not in r else (" (EMA followed)" if r["ema_moved"] else " (EMA never pulled)")
        seeds = " / ".join(f"{a:.3f}" for a in r["accuracy_per_seed"])
        lines.append(f"| {r['model']} | {r['name']}{moved} | {r['accuracy']:.3f} | {seeds} | {aux} | "
                     f"{r['head_params']:,} | {r['train_s']:.1f} |")
    return "\n".join(lines) + "\n"


def section(*, quick: bool, out: Path) -> Section:
    """Throughput against head depth, then digits accuracy per head type (about 5 minutes; ``quick``: about 2)."""
    out = Path(out)
    steps, warmup, rounds = (3, 1, 1) if quick else (12, 3, 3)
    epochs, seeds = (1, (0,)) if quick else (8, (0, 1))
    start = time.perf_counter()
    res: dict[str, Any] = {"throughput": throughput(steps=steps, warmup=warmup, rounds=rounds,
                                                    microbatches=(2,) if quick else (2, 4),
                                                    depths=(0, 2) if quick else DEPTHS)}
    res |= {"epochs": epochs, "seeds": list(seeds), "accuracy": accuracy(epochs=epochs, seeds=seeds)}
    res["seconds"] = time.perf_counter() - start
    _plot(res, out / "heads.png")
    return Section(key="heads", title="Auxiliary heads: depth against throughput, and accuracy per head type",
                   results=res, markdown=_markdown(res), figures=["heads.png"])


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

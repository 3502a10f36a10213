"""Accuracy on real data: end-to-end backprop against PPLL (K = 2 and 4, ``dgl`` and ``infopro`` heads) on digits.

The model, data split, initial weights, batches, optimizer (Adam, cosine decay) and epochs are those of
``examples/train_digits.py`` and the same for every configuration of a seed; only the training method differs.
PPLL trains in the sequential runtime, which with FIFO queues computes exactly what the pipelined runtimes do.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .launch import load_example, one_thread
from .report import Section, standalone

__all__ = ["CONFIGS", "section", "run_seed", "main"]

CONFIGS = (("e2e", 1, None), ("ppll", 2, "dgl"), ("ppll", 2, "infopro"), ("ppll", 4, "dgl"), ("ppll", 4, "infopro"))
"""(method, K, head policy) of every configuration, in table order."""
BATCH = 32
LR = 1e-3
TEST_BATCH = 256


def _name(method: str, k: int, policy: str | None) -> str:
    return "E2E" if method == "e2e" else f"PPLL K={k} {policy}"


def run_seed(seed: int, epochs: int, order: list[tuple[str, int, str | None]]) -> dict[str, dict[str, Any]]:
    """Train every configuration of ``order`` from the same weights on the same batches of split ``seed``."""
    digits = load_example("train_digits")
    train_set, test_set = digits.load_data(seed)
    test = DataLoader(test_set, batch_size=TEST_BATCH)
    out = {}
    for method, k, policy in order:
        torch.manual_seed(seed)
        model = digits.DigitsCNN()
        train = DataLoader(train_set, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU fallback of a machine without GPUs
            if method == "e2e":
                result = digits.train_e2e(model, train, test, epochs, LR)
            else:
                result = digits.train_ppll(model, k, digits.head_policy(policy, seed), train, test, epochs, LR,
                                           "sequential")
        out[_name(method, k, policy)] = result
        print(f"  seed {seed} {_name(method, k, policy)}: test accuracy {result['accuracy']:.3f} "
              f"({result['train_s']:.1f} s)", flush=True)
    return out


def _mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def _aggregate(runs: list[dict[str, dict[str, Any]]], seeds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for method, k, policy in CONFIGS:
        name = _name(method, k, policy)
        per_seed = [r[name] for r in runs]
        stages = [[s[i] for s in (p["stage_accuracy"] for p in per_seed)] for i in range(k - 1)]
        rows.append({"name": name, "method": method, "k": k, "policy": policy, "seeds": seeds,
                     "accuracy": _mean_std([p["accuracy"] for p in per_seed]),
                     "accuracy_per_seed": [p["accuracy"] for p in per_seed],
                     "stage_accuracy": [_mean_std(s) if None not in s else None for s in stages],
                     "stage_accuracy_per_seed": [p["stage_accuracy"] for p in per_seed],
                     "train_s": _mean_std([p["train_s"] for p in per_seed]),
                     "train_s_per_seed": [p["train_s"] for p in per_seed],
                     "cuts": per_seed[0].get("cuts", [])})
    return rows


def _pm(v: dict[str, float] | None, places: int = 3, n: int = 1) -> str:
    if v is None:
        return "n/a"
    return f"{v['mean']:.{places}f} ± {v['std']:.{places}f}" if n > 1 else f"{v['mean']:.{places}f}"


def _markdown(res: dict) -> str:
    n = len(res["seeds"])
    spread = "mean ± std over seeds " + ", ".join(map(str, res["seeds"])) if n > 1 else f"seed {res['seeds'][0]}"
    lines = [f"scikit-learn digits ({res['train_size']} train / {res['test_size']} test images, 8x8 upsampled to "
             f"{res['image_size']}x{res['image_size']}, split stratified by the seed), `examples/train_digits.py`'s "
             f"4-block CNN; batch {BATCH}, {res['epochs']} epochs ({res['steps_per_epoch']} steps each), Adam lr "
             f"{LR:g} with cosine decay, the same initial weights and batches for every configuration of a seed; "
             f"{spread}; {res['threads']} torch thread. PPLL: sequential runtime (the pipelined runtimes compute the "
             "same with FIFO queues), cuts at the CNN's block boundaries.", "",
             "**test acc**: top-1 test accuracy of the model's own output (PPLL: the last stage's); **aux-head "
             "acc**: test accuracy of each earlier stage's auxiliary head (stage 1..K-1, discarded after training); "
             "**train s**: wall-clock seconds of the training loop (compilation and evaluation excluded).", "",
             "| configuration | test acc | aux-head acc (stage 1..K-1) | train s | cuts after |",
             "|---|---:|---|---:|---|"]
    for r in res["rows"]:
        aux = " / ".join(_pm(s, n=n) for s in r["stage_accuracy"]) or "-"
        lines.append(f"| {r['name']} | {_pm(r['accuracy'], n=n)} | {aux} | {_pm(r['train_s'], 1, n)} | "
                     f"{', '.join(r['cuts']) or '-'} |")
    return "\n".join(lines) + "\n"


def _plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    xs = range(len(rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax1.bar(xs, [r["accuracy"]["mean"] for r in rows], 0.6, yerr=[r["accuracy"]["std"] for r in rows], capsize=4,
            color=[colors[i % len(colors)] for i in xs])
    for x, r in zip(xs, rows):
        ax1.plot([x] * len(r["accuracy_per_seed"]), r["accuracy_per_seed"], "k.", ms=4)
        top = max(r["accuracy"]["mean"] + r["accuracy"]["std"], max(r["accuracy_per_seed"]))
        ax1.text(x, top + 0.004, f"{r['accuracy']['mean']:.3f}", ha="center", va="bottom", fontsize=8)
    lo = min(min(r["accuracy_per_seed"]) for r in rows)
    ax1.set_ylim(max(0.0, lo - 0.1), 1.02)
    ax1.set_xticks(list(xs), [r["name"].replace("PPLL ", "PPLL\n") for r in rows], fontsize=8)
    ax1.set_ylabel("test accuracy (final head)")
    seeds = len(res["seeds"])
    ax1.set_title(f"Digits, {res['epochs']} epochs, batch {BATCH}: "
                  + (f"mean ± std over {seeds} seeds (dots: seeds)" if seeds > 1 else f"seed {res['seeds'][0]}"),
                  fontsize=9)

    ppll = [r for r in rows if r["method"] == "ppll"]
    kmax = max(r["k"] for r in ppll)
    width = 0.8 / kmax
    for i in range(kmax):
        xs2, ys, es = [], [], []
        for g, r in enumerate(ppll):
            if i >= r["k"]:
                continue
            v = r["accuracy"] if i == r["k"] - 1 else r["stage_accuracy"][i]
            if v is None:
                continue
            xs2.append(g - 0.4 + (i + 0.5) * width)
            ys.append(v["mean"])
            es.append(v["std"])
        ax2.bar(xs2, ys, width, yerr=es, capsize=3, label=f"stage {i + 1}", color=colors[i % len(colors)])
    ax2.set_xticks(range(len(ppll)), [r["name"] for r in ppll], fontsize=8)
    ax2.set_ylim(0.0, 1.05)
    ax2.set_ylabel("test accuracy of the stage's head")
    ax2.set_title("PPLL: accuracy of every stage's head (the last stage's is the model's output)", fontsize=9)
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section(*, quick: bool, out: Path) -> Section:
    """Train every configuration on every seed, tabulate mean ± std and plot."""
    seeds = [0] if quick else [0, 1, 2]
    epochs = 2 if quick else 8
    digits = load_example("train_digits")
    train_set, test_set = digits.load_data(seeds[0])
    start = time.perf_counter()
    runs = []
    with one_thread():
        for i, seed in enumerate(seeds):
            order = list(CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)])  # each seed starts elsewhere
            runs.append(run_seed(seed, epochs, order))
    res: dict[str, Any] = {"seeds": seeds, "epochs": epochs, "batch": BATCH, "lr": LR, "optimizer": "adam, cosine",
                           "threads": 1, "image_size": digits.SIZE, "train_size": len(train_set),
                           "test_size": len(test_set), "steps_per_epoch": -(-len(train_set) // BATCH),
                           "runtime": "sequential", "rows": _aggregate(runs, seeds),
                           "seconds": time.perf_counter() - start}
    _plot(res, Path(out) / "accuracy.png")
    return Section(key="accuracy", title="Accuracy on real data: E2E vs PPLL (digits)", results=res,
                   markdown=_markdown(res), figures=["accuracy.png"])


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

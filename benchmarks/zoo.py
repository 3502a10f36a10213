"""Real models from timm and Hugging Face transformers, compiled unmodified: cuts, balance, front end, and checks.

Every model is built with random weights from a config in code (no download) at a small size, and compiled for 2 and
4 stages (``--quick``: 2, four models, one pair, a sweep of four) at batch 4 with the defaults (``tracer="auto"``,
``policy="auto"``, FLOP profile); GPT-2 with ``tied="untie"`` (its input embedding is its output projection). Per
model and stage count: the ``compile()`` time (one call, after a warm-up compile of another model), the legal cuts,
the stages, the plan's imbalance, the front end that captured it (``export`` when the plan's notes say "captured
with torch.export") and two checks: **eval exact** (``compiled.eval()`` gives the model's own eval output, max abs
error <= 1e-6, and the stages hold the model's own parameters, each exactly once; an untied parameter's copies
aside) and **threads == sequential** (3 training steps, dropout on, SGD lr 0.05, from two deep copies: every stage
and head parameter equal bit for bit; the last batch smaller). Then a Pipe-BD pair from each library: compiled, and
one step under ``sequential`` and ``threads`` with equal student parameters. A check that raises is a ``FAIL`` row
with the error's first line; the section itself does not fail.

The catalogue (:data:`ZOO`, :data:`PAIRS`) and the helpers here are also what ``tests/integration/test_zoo.py`` runs. The section
ends with the sweep of ``benchmarks/zoo_sweep.py`` (one model per timm family and Hugging Face type).
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ppll_compile

from .launch import one_thread
from .report import Section, environment, standalone

__all__ = ["ZOO", "PAIRS", "Entry", "Pair", "Trained", "build", "compile_entry", "call", "logits", "tracer_of",
           "parameter_sharing", "batches", "train_sizes", "trained_parameters", "train", "changed", "compile_pair",
           "train_pair", "all_equal", "section", "main"]

BATCH, SEQ, VOCAB, STEPS = 4, 16, 128, 3
LAST_BATCH = 3
"""The last training batch is smaller: only the batch size may vary."""
TIMM_DROP = {"drop_rate": 0.1, "drop_path_rate": 0.1}
"""Dropout and stochastic depth of a timm model in the training checks."""


@dataclass(frozen=True)
class Entry:
    """One model of the zoo: how to build it, feed it, and compile it."""

    name: str
    library: str
    """``timm`` or ``transformers``."""
    make: Callable[[bool], nn.Module]
    """``make(drop)``: the model with random weights; ``drop=True``: with dropout on for the training checks."""
    batch: Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]
    """``batch(n, generator)``: (the model's input: a tensor or a dict of keyword inputs, the labels)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra ``compile()`` options."""
    note: str = ""

    @property
    def untied(self) -> bool:
        return self.options.get("tied") == "untie"


def _images(size: int, classes: int = 10) -> Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]:
    def batch(n: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
        return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)
    return batch


def _pixels(n: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g)}, torch.randint(0, 10, (n,), generator=g)


def _sentences(classes: int) -> Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]:
    def batch(n: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
        ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        return {"input_ids": ids}, torch.randint(0, classes, (n,), generator=g)
    return batch


def _tokens(n: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:  # N x L labels, the first 3 ignored (-100)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels[:, :3] = -100
    return {"input_ids": ids}, labels


def _timm(name: str, size: int, *, drop: dict[str, float] | None = None,
          **kwargs: Any) -> tuple[str, Callable, Callable]:
    """(name, make, batch) of a timm model with 10 classes; ``drop``: its dropout for training (default TIMM_DROP)."""
    def make(dropout: bool) -> nn.Module:
        import timm
        extra = (TIMM_DROP if drop is None else drop) if dropout else {}
        return timm.create_model(name, pretrained=False, num_classes=10, **{**kwargs, **extra})
    return name, make, _images(size)


_VIT = {"img_size": 32, "patch_size": 8, "depth": 4}
_SWIN = {"img_size": 64, "window_size": 4, "depths": (2, 2, 2, 2), "embed_dim": 32, "num_heads": (1, 2, 4, 8)}
_MOBILEVIT_BLOCKS = ["stages.2.1", "stages.3.1", "stages.4.1"]
"""MobileViT's attention blocks: torch.fx cannot trace them (they branch on the feature map's size)."""


def _bert(layers: int = 4, **kwargs: Any) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=3,
                                                    max_position_embeddings=64, **kwargs))


def _gpt2(drop: bool) -> nn.Module:  # GPT-2's dropout (resid, embd, attn: 0.1) is on by default
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=2, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def _llama(drop: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                        attention_dropout=0.1 if drop else 0.0))


def _hf_vit(drop: bool) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    p = 0.1 if drop else 0.0
    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4,
                                               num_attention_heads=2, intermediate_size=64, num_labels=10,
                                               hidden_dropout_prob=p, attention_probs_dropout_prob=p))


def _catalogue() -> dict[str, Entry]:
    timm_models = [
        _timm("resnet10t", 32),
        _timm("convnext_atto", 32),
        _timm("efficientnet_b0", 32, drop_rate=0.2, drop={"drop_path_rate": 0.1}),
        _timm("vit_tiny_patch16_224", 32, **_VIT),
        _timm("deit_tiny_distilled_patch16_224", 32, **_VIT),
        _timm("cait_xxs24_224", 32, **_VIT),
        _timm("swin_tiny_patch4_window7_224", 64, **_SWIN),
        _timm("coat_lite_tiny", 64, img_size=64),
        _timm("pvt_v2_b0", 64),
        # stochastic depth makes MobileViT's train and eval graphs differ, which one exported graph cannot
        # follow: the exported entry trains with classifier dropout only, the fx one below with drop-path too
        _timm("mobilevit_xxs", 64, drop={"drop_rate": 0.1}),
        _timm("levit_128s", 64, img_size=64),
        _timm("regnetx_002", 32),
        _timm("mixer_s16_224", 64, img_size=64),
    ]
    zoo = {name: Entry(name, "timm", make, batch) for name, make, batch in timm_models}
    name, make, batch = _timm("mobilevit_xxs", 64)
    zoo["mobilevit_xxs-fx"] = Entry("mobilevit_xxs-fx", "timm", make, batch,
                                    options={"tracer": "fx", "leaf_modules": _MOBILEVIT_BLOCKS},
                                    note="tracer='fx', its 3 attention blocks as leaf modules")
    zoo.update({
        "bert": Entry("bert", "transformers", lambda drop: _bert(), _sentences(3),
                      note="BertForSequenceClassification, 4 layers, width 32"),
        "gpt2": Entry("gpt2", "transformers", _gpt2, _tokens, options={"tied": "untie"},
                      note="GPT2LMHeadModel, 4 layers, width 32, tied='untie'"),
        "llama": Entry("llama", "transformers", _llama, _tokens, note="LlamaForCausalLM, 4 layers, width 32"),
        "hf_vit": Entry("hf_vit", "transformers", _hf_vit, _pixels, note="ViTForImageClassification, 4 layers"),
    })
    return zoo


ZOO: dict[str, Entry] = _catalogue()


@dataclass(frozen=True)
class Pair:
    """A Pipe-BD pair: a frozen teacher and a student whose block outputs match the teacher's in shape."""

    name: str
    library: str
    teacher: Callable[[], nn.Module]
    student: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Any]
    options: dict[str, Any] = field(default_factory=dict)


def _resnet(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import timm
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    return make


def _bert_tuple(layers: int) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = _bert(layers)
        model.config.return_dict = False  # a tuple output instead of a SequenceClassifierOutput
        return model
    return make


PAIRS: dict[str, Pair] = {
    # resnet10t has resnet18's stage widths with one block per stage: 6 aligned blocks
    "resnet18>resnet10t": Pair("resnet18>resnet10t", "timm", _resnet("resnet18"), _resnet("resnet10t", **TIMM_DROP),
                               lambda n, g: torch.randn(n, 3, 32, 32, generator=g)),
    "bert4>bert2": Pair("bert4>bert2", "transformers", lambda: _bert(4), lambda: _bert(2),
                        lambda n, g: {"input_ids": torch.randint(1, VOCAB, (n, SEQ), generator=g)}),
    "bert4>bert2-tuple": Pair("bert4>bert2-tuple", "transformers", _bert_tuple(4), _bert_tuple(2),
                              lambda n, g: {"input_ids": torch.randint(1, VOCAB, (n, SEQ), generator=g)}),
}


# ---- helpers ------------------------------------------------------------------------------------------

def build(entry: Entry, drop: bool = False, seed: int = 0) -> nn.Module:
    """``entry``'s model with weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return entry.make(drop)


def _compile_args(inputs: Any) -> dict[str, Any]:
    return {"example_kwargs": inputs} if isinstance(inputs, dict) else \
        {"example_inputs": inputs if isinstance(inputs, tuple) else (inputs,)}


def compile_entry(entry: Entry, model: nn.Module, stages: int, inputs: Any, seed: int | None = None,
                  **options: Any) -> ppll_compile.CompiledPipeline:
    """``ppll_compile.compile`` of ``model`` for ``stages`` stages (heads drawn after ``manual_seed(seed)``)."""
    if seed is not None:
        torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback of a machine without GPUs
        return ppll_compile.compile(model, gpus=stages, **_compile_args(inputs), **{**entry.options, **options})


def call(module: Any, inputs: Any) -> Any:
    """``module`` (a model or a compiled pipeline) called on a tensor, a tuple or a dict of keyword inputs."""
    return module(**inputs) if isinstance(inputs, dict) else \
        module(*inputs) if isinstance(inputs, tuple) else module(inputs)


def logits(out: Any) -> torch.Tensor:
    """The tensor to compare: a Hugging Face ``ModelOutput``'s ``logits``, else the output itself."""
    return out.logits if hasattr(out, "logits") else out


def tracer_of(plan: ppll_compile.Plan) -> str:
    """The front end that captured the model: ``export`` when the plan's notes say so, else ``fx``."""
    return "export" if any("captured with torch.export" in n for n in plan.notes) else "fx"


def parameter_sharing(compiled: ppll_compile.CompiledPipeline, model: nn.Module) -> dict[str, Any]:
    """How the stages hold the model's parameters.

    ``missing``/``repeated``: names of model parameters no stage holds / more than one stage holds; ``copies``:
    stage parameters that are not the model's (``tied="untie"``), each ``(stage, name, owner)`` where ``owner``
    is the model parameter it equals at compile time (``None``: equals none).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, int] = {}
    copies = []
    for i, stage in enumerate(compiled.stages):
        for n, p in stage.named_parameters():
            if id(p) in names:
                seen[id(p)] = seen.get(id(p), 0) + 1
            else:
                owner = next((m for m, q in model.named_parameters() if q.shape == p.shape and torch.equal(q, p)),
                             None)
                copies.append((i, n, owner))
    return {"missing": [n for i, n in names.items() if i not in seen],
            "repeated": [names[i] for i, k in seen.items() if k > 1], "copies": copies}


def batches(entry_or_pair: Entry | Pair, sizes: list[int], seed: int = 1) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [entry_or_pair.batch(n, g) for n in sizes]


def train_sizes(steps: int = STEPS) -> list[int]:
    return [BATCH] * (steps - 1) + [LAST_BATCH]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def trained_parameters(compiled: ppll_compile.CompiledPipeline) -> list[torch.Tensor]:
    """Copies of every stage's parameters, then every auxiliary head's, in order."""
    stages = [p for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]
    heads = [p for h in compiled.heads if h is not None for p in h.parameters()]
    return [p.detach().clone() for p in stages + heads]


@dataclass
class Trained:
    """What :func:`train` leaves: every stage and head parameter, which stages drew random numbers, the model."""

    parameters: list[torch.Tensor]
    draws_random: list[bool]
    model: nn.Module


def train(entry: Entry, model: nn.Module, stages: int, runtime: str, data: list[tuple[Any, torch.Tensor]]) -> Trained:
    """Compile a deep copy of ``model`` (heads drawn after ``manual_seed(1)``) and train it under ``runtime``."""
    copied = copy.deepcopy(model)
    compiled = compile_entry(entry, copied, stages, data[0][0], seed=1)
    options = {"threads_per_stage": 1} if runtime == "threads" else {}
    with compiled.trainer(optimizer=_sgd, runtime=runtime, **options) as trainer:
        for x, y in data:
            trainer.step(x, y)
    return Trained(trained_parameters(compiled), [r.draws_random for r in trainer.runners], copied)


def changed(trained: nn.Module, model: nn.Module) -> int:
    """How many of ``model``'s parameters training changed in its copy ``trained``."""
    return sum(not torch.equal(p, q) for p, q in zip(trained.parameters(), model.parameters()))


def compile_pair(pair: Pair, stages: int = 2, seed: int = 0) -> tuple[ppll_compile.DistillPipeline, nn.Module,
                                                                         nn.Module]:
    """The pair built after ``manual_seed(seed)``, compiled for ``stages`` devices: (pipeline, student, teacher)."""
    torch.manual_seed(seed)
    teacher, student = pair.teacher(), pair.student()
    x = batches(pair, [BATCH])[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = ppll_compile.compile(student, teacher=teacher, gpus=stages, **_compile_args(x), **pair.options)
    return compiled, student, teacher


def train_pair(pair: Pair, runtime: str, steps: int = 2, stages: int = 2) -> list[torch.Tensor]:
    """The student's parameters after ``steps`` Pipe-BD steps under ``runtime``."""
    compiled, student, _ = compile_pair(pair, stages)
    options = {"threads_per_stage": 1} if runtime == "threads" else {}  # the default: cores / stages
    with compiled.trainer(optimizer=_sgd, runtime=runtime, **options) as trainer:
        for x in batches(pair, [BATCH] * steps):
            trainer.step(x)
    return [p.detach().clone() for p in student.parameters()]


def all_equal(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> bool:
    """Bit for bit, NaN where the other has NaN (a model that diverges must diverge alike)."""
    def same(p: torch.Tensor, q: torch.Tensor) -> bool:
        return torch.equal(p, q) or (p.shape == q.shape and torch.equal(p.isnan(), q.isnan())
                                     and torch.equal(p.nan_to_num(0.0), q.nan_to_num(0.0)))
    return len(ours) == len(ref) and all(same(p, q) for p, q in zip(ours, ref))


# ---- the benchmark ------------------------------------------------------------------------------------

def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _eval_row(entry: Entry, stages: int) -> dict[str, Any]:
    row: dict[str, Any] = {"model": entry.name, "library": entry.library, "stages_asked": stages}
    model = build(entry)
    x = batches(entry, [BATCH], seed=0)[0][0]
    try:
        start = time.perf_counter()
        compiled = compile_entry(entry, model, stages, x)
        row["compile_s"] = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - a failing model is a row of the table
        row.update(compile_s=None, error=_error(e), eval_exact=False)
        return row
    plan = compiled.plan
    row.update(legal_cuts=len(plan.legal_cuts), multi_tensor_cuts=len(plan.multi_tensor_cuts),
               stages=plan.num_stages, imbalance=plan.imbalance, tracer=tracer_of(plan), cuts=list(plan.cuts),
               dropped=[n for n in plan.notes if "legal cuts dropped" in n])
    try:
        compiled.eval()
        with torch.no_grad():
            expected, got = logits(call(model, x)), logits(call(compiled, x))
        row["max_abs_error"] = float((expected - got).abs().max())
        sharing = parameter_sharing(compiled, model)
        row["untied_copies"] = len(sharing["copies"])
        row["eval_exact"] = (row["max_abs_error"] <= 1e-6 and not sharing["missing"] and not sharing["repeated"]
                             and all(owner is not None for *_, owner in sharing["copies"])
                             and (entry.untied or not sharing["copies"]))
    except Exception as e:  # noqa: BLE001
        row.update(eval_exact=False, error=_error(e))
    return row


def _train_check(entry: Entry, stages: int) -> dict[str, Any]:
    model = build(entry, drop=True)
    data = batches(entry, train_sizes())
    try:
        start = time.perf_counter()
        ref = train(entry, model, stages, "sequential", data)
        ours = train(entry, model, stages, "threads", data)
        return {"threads_equal": all_equal(ours.parameters, ref.parameters), "draws_random": ref.draws_random,
                "changed": changed(ref.model, model), "train_s": time.perf_counter() - start}
    except Exception as e:  # noqa: BLE001
        return {"threads_equal": False, "train_error": _error(e)}


def _pair_row(pair: Pair) -> dict[str, Any]:
    row: dict[str, Any] = {"pair": pair.name, "library": pair.library}
    try:
        start = time.perf_counter()
        compiled, _, _ = compile_pair(pair)
        row.update(compile_s=time.perf_counter() - start, blocks=len(compiled.plan.blocks),
                   stages=compiled.plan.num_stages, replicas=[s.replicas for s in compiled.plan.stages])
        ref = train_pair(pair, "sequential", steps=1)
        row["threads_equal"] = all_equal(train_pair(pair, "threads", steps=1), ref)
    except Exception as e:  # noqa: BLE001
        row.update(threads_equal=False, error=_error(e))
    return row


# --quick: a timm CNN and ViT, a Hugging Face encoder and decoder; one Pipe-BD pair; four families of the sweep
QUICK_MODELS, QUICK_PAIRS = ("resnet10t", "vit_tiny_patch16_224", "bert", "gpt2"), ("resnet18>resnet10t",)
QUICK_SWEEP = ("timm:resnet", "timm:vision_transformer", "hf:bert", "hf:gpt2")


def zoo(stages: tuple[int, ...], train_stages: int, quick: bool = False) -> dict[str, Any]:
    """Every model at every stage count (eval checks) and at ``train_stages`` (threads == sequential), the pairs
    (``quick``: :data:`QUICK_MODELS` and :data:`QUICK_PAIRS`)."""
    warm = build(ZOO["resnet10t"])
    compile_entry(ZOO["resnet10t"], warm, 2, torch.randn(2, 3, 32, 32))  # imports and first-call costs
    rows = []
    for entry in (ZOO[name] for name in QUICK_MODELS) if quick else ZOO.values():
        for k in stages:
            row = _eval_row(entry, k)
            if k == train_stages:
                row.update(_train_check(entry, k))
            print(f"  {entry.name} K={k}: {_status(row)}", flush=True)
            rows.append(row)
    pairs = [_pair_row(PAIRS[name]) for name in (QUICK_PAIRS if quick else PAIRS)]
    return {"models": rows, "pairs": pairs}


def _status(row: dict[str, Any]) -> str:
    if row.get("compile_s") is None:
        return f"compile FAIL {row.get('error')}"
    threads = [f"threads {'ok' if row['threads_equal'] else 'FAIL'}"] if "threads_equal" in row else []
    return ", ".join([f"{row['compile_s']:.2f} s", f"eval {'ok' if row['eval_exact'] else 'FAIL'}", *threads])


def _mark(row: dict[str, Any], key: str) -> str:
    return "-" if key not in row else "pass" if row[key] else "**FAIL**"


def _markdown(r: dict[str, Any]) -> str:
    lines = [f"Small random-weight configs (no download), batch {r['batch']}, `compile()` defaults (`tracer='auto'`, "
             f"`policy='auto'`, FLOP profile) plus the model's own options; one torch thread. **eval exact**: "
             f"`compiled.eval()` equals the model's eval output (max abs error <= 1e-6) and the stages hold its own "
             f"parameters once each. **threads = seq**: {r['steps']} SGD steps with dropout on (batches "
             f"{r['train_batches']}), every stage and head parameter bit-equal between the `threads` and "
             f"`sequential` runtimes (at {r['train_stages']} stages). Compile time is one call, after a warm-up "
             f"compile.", "",
             "| model | library | stages | compile s | legal cuts | multi-tensor | imbalance | tracer | eval exact "
             "| threads = seq |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for row in r["models"]:
        name = row["model"] + (f" ({ZOO[row['model']].note})" if ZOO[row["model"]].note else "")
        if row.get("compile_s") is None:
            lines.append(f"| {name} | {row['library']} | {row['stages_asked']} | **FAIL** | | | | | **FAIL** | - |")
            continue
        lines.append(f"| {name} | {row['library']} | {row['stages']} | {row['compile_s']:.2f} | {row['legal_cuts']} "
                     f"| {row['multi_tensor_cuts']} | {row['imbalance']:.3f} | {row['tracer']} "
                     f"| {_mark(row, 'eval_exact')} | {_mark(row, 'threads_equal')} |")
    failures = [(row["model"], row["stages_asked"], row.get("error") or row.get("train_error"))
                for row in r["models"] if row.get("error") or row.get("train_error")]
    lines += ["", "Pipe-BD (2 devices, 1 step each under `sequential` and `threads`):", "",
              "| teacher > student | library | compile s | blocks | stages (replicas) | threads = seq |",
              "|---|---|---:|---:|---|---|"]
    for row in r["pairs"]:
        if "compile_s" not in row:
            lines.append(f"| {row['pair']} | {row['library']} | **FAIL** | | | **FAIL** |")
        else:
            replicas = ", ".join(map(str, row["replicas"]))
            lines.append(f"| {row['pair']} | {row['library']} | {row['compile_s']:.2f} | {row['blocks']} "
                         f"| {row['stages']} ({replicas}) | {_mark(row, 'threads_equal')} |")
        if row.get("error"):
            failures.append((row["pair"], 2, row["error"]))
    if failures:
        lines += ["", "Failures:", ""] + [f"- {name} at {k} stages: `{text}`" for name, k, text in failures]
    return "\n".join(lines) + "\n"


def section(*, quick: bool, out: Path) -> Section:
    """Compile every model of the zoo, check it, tabulate; also writes ``zoo.json`` and ``zoo.md`` into ``out``."""
    stages = (2,) if quick else (2, 4)
    start = time.perf_counter()
    with one_thread():
        results: dict[str, Any] = {"batch": BATCH, "steps": STEPS, "train_batches": train_sizes(),
                                   "stages": list(stages), "train_stages": stages[-1], "threads": 1,
                                   **zoo(stages, stages[-1], quick)}
        sweep_md = _sweep(quick, out, results)
    results["seconds"] = time.perf_counter() - start
    s = Section(key="zoo", title="Model zoo: timm and Hugging Face models compiled unmodified", results=results,
                markdown=_markdown(results) + sweep_md)
    out.mkdir(parents=True, exist_ok=True)  # as a standalone run writes them, under `python -m benchmarks` too
    (out / "zoo.json").write_text(json.dumps({"environment": environment(), **results}, indent=2))
    (out / "zoo.md").write_text(s.report())
    return s


def _sweep(quick: bool, out: Path, results: dict[str, Any]) -> str:
    """The zoo sweep (``--quick``: :data:`QUICK_SWEEP`): rows kept in ``zoo_sweep.jsonl``, the table in markdown."""
    from . import zoo_sweep
    (out / "zoo_sweep.jsonl").unlink(missing_ok=True)  # a fresh sweep (the file keeps rows as they finish)
    rows = zoo_sweep.sweep(list(QUICK_SWEEP if quick else zoo_sweep.SWEEP), out / "zoo_sweep.jsonl")
    results["sweep"] = zoo_sweep.summary(rows)
    return "\nThe sweep (`python -m benchmarks.zoo_sweep`):\n\n" + zoo_sweep.markdown(rows)


def main(argv: list[str] | None = None) -> int:
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())

"""The zoo sweep: one small model per timm family and per Hugging Face causal-LM or sequence-classification type.

A timm family is one of timm's model modules (``timm.list_modules()``); its entry is a small variant (the fewest
parameters of the 4 whose names say atto, femto, ..., tiny, small), random weights, 10 classes, the smallest square
input it runs on (``img_size`` passed where the model takes one). A Hugging Face type is a key of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (the causal LM) or, for the types without one, of
``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES`` (3 labels); its config is the type's default one shrunk in code
(:func:`shrink`: width 32, 2 layers, 2 heads, vocabulary 128, ...) with the overrides of :data:`HF_OVERRIDES`. Each
model is checked at 2 stages, batch 2, ``compile()``'s defaults: **transparency** (``compiled.eval()`` gives the
model's eval output) and **threads == sequential** (:data:`SWEEP_STEPS` SGD steps, every stage and head parameter
equal bit for bit).

What the compiler refuses is listed, with the reason, in :data:`REFUSED` (name -> text its error contains); what
cannot be built from a small config at all is in :data:`NOT_BUILT`; both, with the families' models and the
overrides, live in ``benchmarks/zoo_lists.py``. ``tests/integration/test_zoo_families.py`` holds both
lists to the code: a listed model must fail with its reason, every other one must pass.

``python -m benchmarks.zoo_sweep [--only NAME,...] [--shard I/N] [--out FILE]`` runs the sweep and prints the
table and the ``REFUSED`` / ``NOT_BUILT`` lists that the run suggests; ``--discover`` prints :data:`TIMM_FAMILIES`
afresh from the installed timm.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .zoo import Entry, all_equal, batches, build, call, compile_entry, logits, trained_parameters
from .zoo_lists import HF_OVERRIDES, NOT_BUILT, REFUSED, TESTED, TIMM_FAMILIES

__all__ = ["SWEEP_BATCH", "SWEEP_STEPS", "SWEEP_STAGES", "TIMM_FAMILIES", "HF_OVERRIDES", "REFUSED", "NOT_BUILT",
           "SWEEP", "TESTED", "built", "shrink", "hf_types", "sweep_batches", "check", "run_one", "sweep", "summary",
           "markdown", "suggested", "disagreements", "main"]

SWEEP_BATCH = 2
SWEEP_STEPS = 2
SWEEP_STAGES = 2
SEQ = 16
VOCAB = 128
LABELS = 3
TIMEOUT_S = 300
"""A model whose checks take longer is a ``timeout`` row of the sweep (not of the test)."""

# ---- timm --------------------------------------------------------------------------------------------------------


def _timm_make(model: str, kwargs: dict[str, Any]) -> Callable[[bool], nn.Module]:
    def make(drop: bool) -> nn.Module:
        import timm
        return timm.create_model(model, pretrained=False, num_classes=10, **kwargs)
    return make


def _images(size: int) -> Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]:
    def batch(n: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
        return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)
    return batch


_SMALL_NAMES = ["atto", "femto", "pico", "zepto", "nano", "xxxs", "xxs", "xs", "micro", "tiny", "mini", "small", "s0",
                "b0", "t0", "a0", "t", "s", "m0", "b1", "lite0", "002", "004", "18", "10", "11", "14", "26"]
"""Name parts of small variants, smallest first: :func:`_discover_family` weighs the 4 best-named variants."""


def _name_rank(name: str) -> tuple[int, int]:
    parts = name.replace("-", "_").replace(".", "_").split("_")
    return min((_SMALL_NAMES.index(p) for p in parts if p in _SMALL_NAMES), default=len(_SMALL_NAMES)), len(name)


def _discover_family(family: str) -> tuple[str, int, dict[str, Any]] | str:
    """(small model, input side, options) of a timm family, or why none of its models runs: of the 4 variants whose
    names rank first (:data:`_SMALL_NAMES`), the one with the fewest parameters (counted on the meta device) that
    runs at the smallest of 32, 64, ..., 256 (``img_size`` passed where the model takes it)."""
    import inspect

    import timm
    sized = []
    for name in sorted(timm.list_models(module=family), key=_name_rank)[:4]:
        try:
            with torch.device("meta"):
                model = timm.create_model(name, num_classes=10)
            sized.append((sum(p.numel() for p in model.parameters()), name,
                          "img_size" in inspect.signature(type(model)).parameters))
        except Exception:  # noqa: BLE001 - a variant that does not build is not a candidate
            continue
    errors = []
    for _, name, takes_size in sorted(sized)[:2]:
        for side in (32, 64, 96, 128, 160, 224, 256):
            kwargs = {"img_size": side} if takes_size else {}
            try:
                torch.manual_seed(0)
                with torch.no_grad():
                    out = timm.create_model(name, num_classes=10, **kwargs).eval()(torch.randn(2, 3, side, side))
                if tuple(out.shape) == (2, 10):
                    return name, side, kwargs
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name} at {side}: {_first_line(e)[:120]}")
    return errors[-1] if errors else "no model of the family builds"


# ---- Hugging Face --------------------------------------------------------------------------------------------

_SMALL: dict[str, int] = {
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "dim": 32, "hidden_dim": 32, "n_embed": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 2, "n_head": 2, "num_heads": 2, "n_heads": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 16, "d_kv": 16, "kv_channels": 16, "attention_head_size": 16,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "d_ff": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "ffn_hidden_size": 64,
    "embedding_size": 32, "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "top_k": 2, "n_shared_experts": 1, "num_shared_experts": 1, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_head_dim": 16, "time_step_rank": 4, "n_groups": 1, "mamba_n_groups": 1, "num_memory_blocks": 4,
    "num_encoder_layers": 2, "rotary_dim": 8, "pooler_hidden_size": 32, "attention_hidden_size": 32,
    "num_labels": LABELS,
}
"""The attributes :func:`shrink` sets wherever a config (or a sub-config) has them."""
_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")


def shrink(config: Any) -> Any:
    """``config`` (and every sub-config) with the small sizes of ``_SMALL`` where it has the attribute, per-layer
    lists cut to 2 layers, token ids inside the vocabulary and the pad token 0."""
    from transformers import PretrainedConfig
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in _SMALL.items():
        if isinstance(getattr(config, key, None), int) and not isinstance(getattr(config, key), bool):
            _set(config, key, value)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int) and hasattr(config, "head_dim"):
        _set(config, "head_dim", config.qk_rope_head_dim)  # multi-head latent attention: rotary part only
    keep = _kept_layers(config, layers)
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            shrink(value)
        elif isinstance(value, list) and layers and len(value) == layers and layers > 2:
            _set(config, key, [value[i] for i in keep])
    if layers and layers > 2 and len(keep) > 2:
        _set(config, "num_hidden_layers", len(keep))
    for key, value in zip(_TOKENS[:3], (0, 1, 2)):  # pad 0, bos 1, eos 2 (the sequence batches end with eos)
        if hasattr(config, key):
            _set(config, key, value)
    for key in _TOKENS[3:]:
        if isinstance(getattr(config, key, None), int):
            _set(config, key, min(getattr(config, key), VOCAB - 1))
    return config


def _set(config: Any, key: str, value: Any) -> None:
    """``config.key = value`` unless the config refuses it (a derived property, a fixed size)."""
    try:
        setattr(config, key, value)
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        pass


def _kept_layers(config: Any, layers: int | None) -> list[int]:
    """Which layers a 2-layer config keeps: the first two, or the first of each kind where the per-layer lists
    name more kinds (a hybrid model keeps an attention layer and a linear-attention one)."""
    lists = [v for v in vars(config).values() if isinstance(v, list) and layers and len(v) == layers]
    keep: list[int] = []
    for values in lists:
        if all(isinstance(v, (str, bool)) for v in values):
            firsts = sorted({v: values.index(v) for v in values}.values())
            keep = sorted(set(keep) | set(firsts))
    return sorted(set(keep) | {0, 1}) if layers and layers >= 2 else list(range(layers or 0))


def hf_types() -> dict[str, str]:
    """Every Hugging Face type with a causal LM (``causal``), else with sequence classification (``sequence``)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )
    out = {t: "causal" for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    out.update({t: "sequence" for t in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if t not in out})
    return dict(sorted(out.items()))


def _hf_make(model_type: str, task: str) -> Callable[[bool], nn.Module]:
    def make(drop: bool) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
        config = shrink(AutoConfig.for_model(model_type))
        if task == "causal" and hasattr(config, "is_decoder"):
            config.is_decoder = True  # an encoder type's causal LM (BERT's) attends causally only as a decoder
        for key, value in HF_OVERRIDES.get(model_type, {}).items():
            setattr(config, key, value)
        auto = AutoModelForCausalLM if task == "causal" else AutoModelForSequenceClassification
        return auto.from_config(config).float()
    return make


def _hf_batch(task: str) -> Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]:
    def batch(n: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
        ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        if task == "sequence":
            ids[:, -1] = 2  # eos: the pooling token of the types that classify at it
            return {"input_ids": ids}, torch.randint(0, LABELS, (n,), generator=g)
        labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        labels[:, :3] = -100
        return {"input_ids": ids}, labels
    return batch


def _catalogue() -> dict[str, Entry]:
    out = {f"timm:{family}": Entry(f"timm:{family}", "timm", _timm_make(model, kwargs), _images(side),
                                   note=f"{model} at {side}x{side}")
           for family, (model, side, kwargs) in TIMM_FAMILIES.items()}
    try:
        types = hf_types()
    except ImportError:
        types = {}
    for model_type, task in types.items():
        out[f"hf:{model_type}"] = Entry(f"hf:{model_type}", "transformers", _hf_make(model_type, task),
                                        _hf_batch(task), options={"tied": "untie"} if task == "causal" else {},
                                        note=f"{task} LM" if task == "causal" else "sequence classification")
    return out


SWEEP: dict[str, Entry] = _catalogue()


# ---- the checks ---------------------------------------------------------------------------------------------

class _Timeout(Exception):
    pass


def sweep_batches(entry: Entry) -> list[tuple[Any, torch.Tensor]]:
    """The training batches (the first is also the example input): :data:`SWEEP_STEPS` of :data:`SWEEP_BATCH`."""
    return batches(entry, [SWEEP_BATCH] * SWEEP_STEPS)


def built(entry: Entry) -> nn.Module:
    """``entry``'s model, run once by itself in eval mode on the example input (raises when it cannot)."""
    model = build(entry)
    x = sweep_batches(entry)[0][0]
    model.eval()
    with torch.no_grad():
        call(model, x)
    return model


def check(entry: Entry, model: nn.Module | None = None) -> dict[str, Any]:
    """Compile at :data:`SWEEP_STAGES` stages, then transparency and threads == sequential; raises on a failure.

    Returns the figures: ``compile_s``, ``stages``, ``tracer`` and ``train_s`` (both trainings).
    """
    model = build(entry) if model is None else model
    data = sweep_batches(entry)
    x = data[0][0]
    start = time.perf_counter()
    compiled = compile_entry(entry, model, SWEEP_STAGES, x, seed=1)
    figures: dict[str, Any] = {"compile_s": time.perf_counter() - start, "stages": compiled.plan.num_stages,
                               "tracer": "export" if any("torch.export" in n for n in compiled.plan.notes) else "fx"}
    compiled.eval()
    with torch.no_grad():
        expected, got = logits(call(model, x)), logits(call(compiled, x))
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        gap = float((got - expected).abs().max()) if got.shape == expected.shape else f"shape {tuple(got.shape)}"
        raise AssertionError(f"compiled.eval() differs from the model's eval output: {gap}")
    start = time.perf_counter()
    twin = copy.deepcopy(compiled)  # the same stages and heads: one compile serves both runtimes
    before = trained_parameters(compiled)
    ref, ours = _train(compiled, "sequential", data), _train(twin, "threads", data)
    if all_equal(ref, before):
        raise AssertionError("training changed no parameter")
    if not all_equal(ours, ref):
        raise AssertionError("threads training differs from sequential training")
    figures["train_s"] = time.perf_counter() - start
    return figures


def _train(compiled: Any, runtime: str, data: list[tuple[Any, torch.Tensor]]) -> list[torch.Tensor]:
    options = {"threads_per_stage": 1} if runtime == "threads" else {}
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), runtime=runtime, **options) as trainer:
        for x, y in data:
            trainer.step(x, y)
    return trained_parameters(compiled)


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout(f"the checks took more than {TIMEOUT_S} s")


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def run_one(name: str, timeout_s: int = TIMEOUT_S) -> dict[str, Any]:
    """One row of the sweep: ``status`` is ``ok``, ``refused``, ``not built`` or ``timeout``, with the error."""
    entry = SWEEP[name]
    row: dict[str, Any] = {"name": name, "library": entry.library, "note": entry.note}
    start = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout_s)
    try:
        try:
            model = built(entry)
        except _Timeout:
            raise
        except Exception as e:  # noqa: BLE001 - a model that does not build is a row of the table
            row.update(status="not built", error=_first_line(e), detail=str(e)[:2000])
            return row
        row["parameters"] = sum(p.numel() for p in model.parameters())
        row.update(check(entry, model), status="ok")
    except _Timeout as e:
        row.update(status="timeout", error=str(e))
    except Exception as e:  # noqa: BLE001
        row.update(status="refused", error=_first_line(e), detail=str(e)[:2000])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        row["seconds"] = time.perf_counter() - start
    return row


def sweep(names: list[str], out: Path | None = None) -> list[dict[str, Any]]:
    """Every row; with ``out``, one JSON line per model appended as it finishes (rows found there are kept)."""
    done = {}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    if out is not None and out.exists():
        done = {r["name"]: r for r in map(json.loads, out.read_text().splitlines()) if r.get("name") in names}
    rows = []
    for name in names:
        if name not in done:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                done[name] = run_one(name)
            if out is not None:
                with out.open("a") as f:
                    f.write(json.dumps(done[name]) + "\n")
            print(f"  {name}: {done[name]['status']} {done[name]['seconds']:.1f} s {done[name].get('error', '')}",
                  flush=True)
        rows.append(done[name])
    return rows


def _cause(error: str) -> str:
    return error.split(": ", 1)[0] + ": " + error.split(": ", 1)[-1][:90]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per library: tried, ok, refused / not built / timeout by cause; the seconds of the whole."""
    out: dict[str, Any] = {}
    for lib in sorted({r["library"] for r in rows}):
        mine = [r for r in rows if r["library"] == lib]
        entry: dict[str, Any] = {"tried": len(mine), "ok": sum(r["status"] == "ok" for r in mine)}
        for status in ("refused", "not built", "timeout"):
            causes: dict[str, list[str]] = {}
            for r in mine:
                if r["status"] == status:
                    causes.setdefault(_cause(r["error"]), []).append(r["name"])
            entry[status] = dict(sorted(causes.items(), key=lambda kv: -len(kv[1])))
        out[lib] = entry
    out["seconds"] = sum(r["seconds"] for r in rows)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The sweep's table: per library the counts, then each cause with its models."""
    s = summary(rows)
    lines = [f"One small random-weight model per timm family and per Hugging Face causal-LM / sequence-classification "
             f"type, {SWEEP_STAGES} stages, batch {SWEEP_BATCH}, {SWEEP_STEPS} training steps; "
             f"{s['seconds'] / 60:.1f} min in all.", "",
             "| library | tried | ok | refused | not built | timeout |", "|---|---:|---:|---:|---:|---:|"]
    for lib, e in s.items():
        if lib != "seconds":
            n = {k: sum(map(len, e[k].values())) for k in ("refused", "not built", "timeout")}
            lines.append(f"| {lib} | {e['tried']} | {e['ok']} | {n['refused']} | {n['not built']} | {n['timeout']} |")
    for lib, e in s.items():
        if lib != "seconds":
            for status in ("refused", "not built", "timeout"):
                for cause, names in e[status].items():
                    lines.append(f"- {lib} {status} ({len(names)}): `{cause}`: {', '.join(names)}")
    return "\n".join(lines) + "\n"


def suggested(rows: list[dict[str, Any]]) -> str:
    """``REFUSED`` and ``NOT_BUILT`` as this run finds them, to paste over the lists above."""
    parts = []
    for title, status in (("REFUSED", "refused"), ("NOT_BUILT", "not built")):
        lines = [f"{title}: dict[str, str] = {{"]
        lines += [f"    {r['name']!r}: {r['error'].split(': ', 1)[-1][:70]!r},  # {r['error'].split(':')[0]}"
                  for r in rows if r["status"] == status or (status == "refused" and r["status"] == "timeout")]
        parts.append("\n".join(lines) + "\n}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated names (default: all of SWEEP)")
    parser.add_argument("--library", choices=("timm", "transformers"), help="only this library's models")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th model from the I-th")
    parser.add_argument("--out", type=Path, help="a JSON-lines file of rows, kept and appended to")
    parser.add_argument("--report", action="store_true", help="only print the table of the rows in --out")
    parser.add_argument("--discover", action="store_true", help="print TIMM_FAMILIES from the installed timm")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.discover:
        return _discover()
    names = [n for n in (args.only.split(",") if args.only else SWEEP) if n]
    names = [n for n in names if args.library is None or SWEEP[n].library == args.library]
    i, n = map(int, args.shard.split("/"))
    names = names[i::n]
    if args.report:
        rows = [r for r in map(json.loads, args.out.read_text().splitlines())]
    else:
        rows = sweep(names, args.out)
    print(markdown(rows))
    print(suggested(rows))
    for line in disagreements(rows):
        print(line)
    return 0


def disagreements(rows: list[dict[str, Any]]) -> list[str]:
    """The rows whose outcome the lists do not say: a listed model that passed, or failed for another reason, or an
    unlisted one that failed."""
    out = []
    for r in rows:
        listed = REFUSED.get(r["name"]) if r["status"] != "not built" else NOT_BUILT.get(r["name"])
        if r["status"] == "ok" and (r["name"] in REFUSED or r["name"] in NOT_BUILT):
            out.append(f"{r['name']}: listed, but passes: remove it")
        elif r["status"] != "ok" and (listed is None or listed not in r.get("detail", r["error"])):
            out.append(f"{r['name']}: {r['status']} ({r['error'][:100]}), not as listed: {listed!r}")
    return out


def _discover() -> int:
    import timm
    warnings.simplefilter("ignore")
    print("TIMM_FAMILIES = {")
    for family in timm.list_modules():
        found = _discover_family(family)
        if isinstance(found, str):
            print(f"    # {family}: {found}")
        else:
            print(f"    {family!r}: {found!r},", flush=True)
    print("}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

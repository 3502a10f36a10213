"""Worker of the real-models torchrun test: ``torchrun --nproc-per-node=K tests/hf_dist_worker.py OUT [MODEL ...]``.

Every rank compiles each of :data:`MODELS` (small Hugging Face configs with their default attention, built on the
meta device and built normally) for K stages, trains it on :data:`STEPS` batches under ``runtime="distributed"`` and
gathers the whole trained model; the main rank saves it as ``OUT/<model>-<build>.pt``. The test imports
:func:`pipeline` and :func:`train` to run the sequential reference in-process on the same models and batches.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ppll_compile

__all__ = ["MODELS", "BUILDS", "STEPS", "pipeline", "train", "main"]

VOCAB, BATCH, LENGTH, STEPS = 96, 4, 12, 3


def _decoder(config: str, model: str, **extra: Any) -> Callable[[], nn.Module]:
    """A causal LM of ``transformers``' ``config`` class, 3 layers of width 32, its default attention and no cache."""
    def build() -> nn.Module:
        import transformers
        cfg = getattr(transformers, config)(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                            use_cache=False, **extra)
        return getattr(transformers, model)(cfg)
    return build


def _gpt2() -> nn.Module:
    import transformers
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=3, n_head=4,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    import transformers
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, max_position_embeddings=LENGTH, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _t5() -> nn.Module:
    import transformers
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                use_cache=False)
    return transformers.T5ForConditionalGeneration(cfg)


def _tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(2, VOCAB, (BATCH, LENGTH), generator=g)}


def _masked(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Token ids and an attention mask with padding at the end of every other row."""
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1::2, LENGTH - 3:] = 0
    return {**_tokens(g), "attention_mask": mask}


def _translation(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {**_tokens(g), "labels": torch.randint(2, VOCAB, (BATCH, LENGTH // 2), generator=g)}


def _next_tokens(x: dict[str, torch.Tensor], g: torch.Generator) -> torch.Tensor:
    return x["input_ids"]  # a causal LM's per-token labels: its own tokens (the heads and the loss shift them)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], dict],
                        Callable[[dict, torch.Generator], torch.Tensor]]] = {
    "llama": (_decoder("LlamaConfig", "LlamaForCausalLM"), _masked, _next_tokens),
    "mistral": (_decoder("MistralConfig", "MistralForCausalLM"), _tokens, _next_tokens),
    "qwen2": (_decoder("Qwen2Config", "Qwen2ForCausalLM"), _masked, _next_tokens),
    "gpt2": (_gpt2, _masked, _next_tokens),
    "bert": (_bert, _masked, lambda x, g: torch.randint(0, 3, (BATCH,), generator=g)),
    "t5": (_t5, _translation, lambda x, g: x["labels"]),
}
"""Name -> (builder, batch inputs from a generator, target of a batch): each family with its default attention."""

BUILDS = ("meta", "normal")


def batches(name: str) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The :data:`STEPS` batches ``name`` trains on (the same in every process)."""
    _, inputs, target = MODELS[name]
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = inputs(g)
        out.append((x, target(x, g)))
    return out


def pipeline(name: str, build: str, stages: int) -> Any:
    """``name`` (weights from seed 0) compiled for ``stages`` stages, built on the meta device or normally."""
    builder = MODELS[name][0]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback and untied-weights notes of compile()
        if build == "meta":
            with torch.device("meta"):
                model = builder()
        else:
            model = builder()
        return ppll_compile.compile(model, gpus=stages, example_kwargs=batches(name)[0][0])


def train(compiled: Any, name: str, runtime: str) -> dict[str, torch.Tensor] | None:
    """Train ``compiled`` on ``name``'s batches under ``runtime``: the whole trained model (``None`` off rank 0
    under ``distributed``)."""
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), runtime=runtime, timeout=120) as trainer:
        for x, y in batches(name):
            trainer.step(x, y)
        trainer.finish()
        return trainer.model_state_dict()


def main(out: Path, names: list[str]) -> None:
    torch.set_num_threads(1)
    stages = int(os.environ["WORLD_SIZE"])
    for name in names or MODELS:
        for build in BUILDS:
            print(f"rank {os.environ['RANK']}: {name} {build}", flush=True)
            state = train(pipeline(name, build, stages), name, "distributed")
            if state is not None:
                torch.save(state, out / f"{name}-{build}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

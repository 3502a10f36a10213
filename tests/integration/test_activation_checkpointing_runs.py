"""Activation checkpointing on real models: training equals training without it, with dropout and drop-path, and the
plan keeps less activation memory for one more forward."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.zoo import (
    ZOO,
    batches,
    build,
    changed,
    compile_entry,
    train_sizes,
    trained_parameters,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_quietly")]

pytest.importorskip("timm")
pytest.importorskip("transformers")


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _trained(name: str, model: torch.nn.Module, data: list, **options) -> tuple[list[torch.Tensor], object, dict]:
    """The stage parameters of a copy of ``model`` trained on ``data`` under the sequential runtime, its plan, and
    its buffers (batch norm's running statistics)."""
    copied = copy.deepcopy(model)
    compiled = compile_entry(ZOO[name], copied, 2, data[0][0], seed=1, profile="flops", **options)
    with compiled.trainer(optimizer=_sgd, runtime="sequential", seed=7) as trainer:
        for x, y in data:
            trainer.step(x, y)
    assert changed(copied, model) > 0
    return trained_parameters(compiled), compiled.plan, {k: b.clone() for k, b in copied.named_buffers()}


@pytest.mark.parametrize("name", ["efficientnet_b0", "vit_tiny_patch16_224"])
def test_training_with_checkpointing_equals_training_without(name):
    """Dropout and drop-path on: the recompute draws the masks the forward drew, so the parameters (and batch norm's
    running statistics, updated once per step) after a few steps are the same to the bit (at the same cuts: the partitioner may move them for the recompute's time)."""
    model = build(ZOO[name], drop=True)
    data = batches(ZOO[name], train_sizes())
    plain, plan, plain_buffers = _trained(name, model, data)
    ours, ckpt, our_buffers = _trained(name, model, data, checkpoint_activations=True, split_points=list(plan.cuts))
    assert our_buffers.keys() == plain_buffers.keys()
    assert [k for k, b in plain_buffers.items() if not torch.equal(our_buffers[k], b)] == []  # batch norm: once a step
    assert ckpt.checkpoint_activations and any(s.checkpoints for s in ckpt.stages)
    for i, (p, q) in enumerate(zip(ours, plain)):
        assert torch.equal(p, q), f"parameter {i} differs by {float((p - q).abs().max())}"
    for a, b in zip(plan.stages, ckpt.stages):
        assert b.recompute_cost > 0 and b.compute_cost > a.compute_cost
        if b.checkpoints:  # several segments: less activation memory
            assert b.activation_bytes < a.activation_bytes, (name, b.index)

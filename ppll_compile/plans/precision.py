"""The precisions a plan can be made for (``precision=``): what each computes, keeps and sends in.

``fp32`` (the default) is float32 throughout, as a model built from a config trains without options. ``bf16`` and
``fp16`` are mixed precision as ``torch.autocast`` runs it: matrix products, convolutions and attention compute in
the low precision, and so do the activations they produce and the element-wise operators on them; the parameters
stay float32 (the master weights), their gradients are float32 (autocast's casts are differentiable: the gradient of
a weight arrives at its float32 leaf in float32), and so is the optimizer state; autocast keeps a low-precision copy
of every weight it casts for the backward. ``bf16-pure`` is pure bfloat16: the parameters themselves, their
gradients and the optimizer state (created like the parameters) are bfloat16 too, as after
``model.to(torch.bfloat16)``.

How the costs are priced: the fake-tensor pass measures the model as it is (float32), once; a low precision then
casts the sizes (:func:`~ppll_compile.cost.reprice.cast_costs`) rather than measuring again under ``torch.autocast``. The
pass runs on fake CPU (or meta) tensors, and CPU autocast's operator lists differ from CUDA's (the devices a plan is
for), so a run under autocast here would not measure what a GPU runs either; casting sizes is one rule, the same for
every device, and the fake pass (the expensive part of planning) stays shared by every precision. The rule: every
operator that ran in float32 runs in the low precision (its FLOPs priced at the hardware's rate for that dtype), and
its float32 operands are half the bytes (integer and boolean operands, token ids and masks, keep theirs); every
float32 activation saved for backward and every float32 value that crosses a cut is half the bytes too, in the low
dtype, so the runtimes send and receive them in it. Mixed precision adds autocast's own work: one cast of every
weight a node uses per forward (read 4 bytes, write 2, per element), the copy it saves for backward (2 bytes per
element, counted as a saved activation), and one cast of its gradient back (read 2, write 4). What it leaves out:
the operators autocast keeps in float32 on a GPU (softmax, norms) are priced in the low precision like the rest
inside the model's graph, and the float32 residual stream that type promotion keeps in some models is priced at 2
bytes.

Losses are the exception, as their scores at a large vocabulary are what fills a device: the auxiliary heads and
the last stage's loss are measured in the precision directly (:func:`ppll_compile.heads.build.counted_head`,
:func:`~ppll_compile.heads.build.counted_loss`), a head's layers in the low dtype, and every loss (with the softmaxes)
in float32 on float32 copies of its low-precision operands, as autocast runs them (:class:`~ppll_compile.cost.autocast.MetaAutocast`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class Precision:
    """One precision a plan can be made for."""

    name: str
    """The plan's name for it (``precision=``)."""
    dtype: str
    """The dtype matrix products and activations compute in (``float32``, ``bfloat16``, ``float16``)."""
    pure: bool = False
    """Whether the parameters, gradients and optimizer state are in :attr:`dtype` too (else float32)."""
    meaning: str = ""
    """One line for the docs and errors."""

    @property
    def low(self) -> bool:
        """Whether anything is computed below float32."""
        return self.dtype != "float32"

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype every stage trains under ``torch.autocast`` in (``None``: no autocast). A pure plan trains under
        it too, so that its float32 auxiliary heads take the bfloat16 activations."""
        return getattr(torch, self.dtype) if self.low else None

    def param_bytes(self, numel: int, element_size: int, floating: bool) -> int:
        """Bytes a parameter of ``numel`` elements of ``element_size`` bytes is kept in (and so its gradient and each
        optimizer state tensor): halved from float32 only when :attr:`pure`."""
        if self.pure and floating and element_size == 4:
            return numel * 2
        return numel * element_size


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision(name="fp32", dtype="float32", meaning="float32 throughout (the default)"),
    Precision(name="bf16", dtype="bfloat16", meaning="mixed precision: bfloat16 compute and activations under "
              "torch.autocast, float32 weights, gradients and optimizer state"),
    Precision(name="fp16", dtype="float16", meaning="mixed precision: float16 compute and activations under "
              "torch.autocast with a gradient scaler, float32 weights, gradients and optimizer state"),
    Precision(name="bf16-pure", dtype="bfloat16", pure=True, meaning="pure bfloat16: weights, gradients, "
              "optimizer state, compute and activations all bfloat16"),
)}
"""The precisions a plan can be made for, by name."""
FUSIONS = ("eager", "fused")
"""How element-wise chains are priced (``fusion=``): one operator at a time, or one fused kernel per chain (see
:mod:`~ppll_compile.cost.reprice`)."""


def precision_spec(name: Any) -> Precision:
    """The precision ``name``; a ValueError listing the known ones for any other."""
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; known precisions: "
                         f"{', '.join(f'{p.name} ({p.meaning})' for p in PRECISIONS.values())}")
    return PRECISIONS[name]


def default_fusion(precision: str) -> str:
    """The fusion a plan uses when ``fusion=`` is not given: ``fused`` for a low precision (training at that size
    compiles its element-wise chains: ``torch.compile``, Megatron's and torchtitan's fused kernels), ``eager``
    for float32 (the plans made before precisions existed)."""
    return "fused" if precision_spec(precision).low else "eager"

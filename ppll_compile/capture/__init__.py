"""Capture: an unmodified ``nn.Module`` and example inputs in, an ``fx`` graph out.

Takes: the user's model (possibly built on the meta device) and its example inputs.
Gives: a graph with train/eval behaviour kept switchable (:mod:`.modes`), by symbolic tracing (:mod:`.trace`) or
``torch.export`` (:mod:`.export`), chosen by :mod:`.frontends`; the meta model's tensors (:mod:`.meta`), fake
parameters for measuring (:mod:`.fake_state`) and node signatures that let a repeated layer reuse a measurement
(:mod:`.memo`)."""

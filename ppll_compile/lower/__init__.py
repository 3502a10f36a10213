"""Lowering: a plan in, modules that run it out.

Takes: a :class:`~..plans.plan.Plan` and the user's model.
Gives: stage modules split from the graph sharing the model's parameters, with their heads, on their devices
(:mod:`.split`, handed to the runtime as :mod:`.stages`), a meta model's tensors filled stage by stage
(:mod:`.materialize`), and wall-clock timings of candidate stages (:mod:`.profile`)."""

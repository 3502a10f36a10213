"""Simulation: a plan in, the timeline the runtimes would record out, before anything runs.

Takes: a :class:`~..plans.plan.Plan` and its schedule (:mod:`..plans.schedule`).
Gives: a deterministic discrete-event model of the runtimes (:mod:`.simulate`, exposed as
``ppll_compile.simulate``): batch by batch (:mod:`.equations`), or event by event where replicas share processors
(:mod:`.sharing`)."""

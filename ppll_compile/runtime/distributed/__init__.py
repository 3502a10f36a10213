"""The ``distributed`` runtime: one process per stage replica under torchrun, activations sent point to point.

Takes: lowered stages and a process group. Gives: the runtime (:mod:`.runtime`) on its group (:mod:`.group`), one
plan for every rank (:mod:`.plan_share`), the links to its neighbours (:mod:`.links`, :mod:`.inbox`,
:mod:`.outbox`) in its wire format (:mod:`.wire`), and the fault protocol (:mod:`.faults`)."""

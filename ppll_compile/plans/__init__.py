"""The plan's data, at the bottom of the compiler: what every phase above reads or writes and nothing computes.

Takes: nothing from the phases above (a plan file's bounds and its report read the hardware presets of :mod:`..cost`).
Gives: :class:`~.plan.Plan` and its frozen parts (:mod:`.specs`), its file format (:mod:`.file`), its printed table
and report (:mod:`.table`, :mod:`.report`), the precisions it can be made for (:mod:`.precision`), the schedule of a
local-learning stage as data (:mod:`.schedule`), event timelines (:mod:`.timeline`) and units (:mod:`.units`)."""

"""Placement: the analysed model in, the plan out.

Takes: an :class:`~..analysis.analyse.Analysis`, the heads of :mod:`..heads` and the options.
Gives: the stage layout (:mod:`.partition`: cost vectors to a solver of :mod:`ppll_compile.partitioners`, which
stay torch-free) and the :class:`~..plans.plan.Plan` assembled from it (:mod:`.assemble`), with the parameters
its cuts untie (:mod:`.tied`) and its closing notes (:mod:`.notes`). With ``profile="time"``
it times candidate stages by lowering them (:mod:`..lower.profile`)."""

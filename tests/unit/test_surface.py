"""The public surface: the root, the errors and the extension points declare ``__all__``; internal modules none."""

from tests.helpers import surface_declared


PUBLIC = {
    "ppll_compile": "what users call: plan, compile, calibrate, simulate, the plan types, the trainer, the errors",
    "ppll_compile.errors": "every exception the package raises",
    "ppll_compile.draw": "pictures of plans, graphs and timelines",
    "ppll_compile.phases": "the seconds of each planning phase",
    "ppll_compile.allocator": "the allocator setting the trainers apply, for the user's own baselines",
    "ppll_compile.cost.roofline": "device figures, for pinning and inspecting them",
    "ppll_compile.heads": "the head modules and losses a custom head or loss builds on",
    "ppll_compile.heads.types": "registering a head type",
    "ppll_compile.heads.policy": "reading and checking head policies",
    "ppll_compile.cost.optimizers": "the optimizer kinds a plan costs",
    "ppll_compile.runtime": "the trainer, its runtimes and queue rules",
    "ppll_compile.runtime.base": "the base a new runtime subclasses",
    "ppll_compile.runtime.registry": "registering a runtime",
    "ppll_compile.runtime.checkpoint": "the newest complete checkpoint under a root, for resuming",
    "ppll_compile.plans.schedule": "the schedule as data",
    "ppll_compile.partitioners": "registering and calling solvers",
    "ppll_compile.policies": "the shipped policy files",
}


def test_only_the_public_modules_declare_a_surface():
    assert set(surface_declared()) == set(PUBLIC)


def test_the_root_exports_every_exception():
    import ppll_compile
    from ppll_compile import errors
    exceptions = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert exceptions - {"ModelFileError"} <= set(ppll_compile.__all__)
    assert all(issubclass(getattr(errors, n), errors.PPLLError) for n in exceptions)

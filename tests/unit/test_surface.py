"""The public surface: the root, the errors and the extension points declare ``__all__``; internal modules none."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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


def _declared() -> dict[str, list[str]]:
    found = {}
    # each top-level folder and the name it installs as (pyproject.toml's package-dir)
    for folder, package in {"ppll_compile": "ppll_compile", "partitioners": "ppll_compile.partitioners",
                            "policies": "ppll_compile.policies"}.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                    parts = path.relative_to(ROOT / folder).with_suffix("").parts
                    name = ".".join((package, *parts)).removesuffix(".__init__")
                    found[name] = [ast.literal_eval(e) for e in node.value.elts]
    return found


def test_only_the_public_modules_declare_a_surface():
    assert set(_declared()) == set(PUBLIC)


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_declared_name_exists_and_is_listed_once(module):
    names = _declared()[module]
    loaded = importlib.import_module(module)
    assert [n for n in names if not hasattr(loaded, n)] == []
    assert len(names) == len(set(names))


def test_the_root_exports_every_exception():
    import ppll_compile
    from ppll_compile import errors
    exceptions = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert exceptions - {"ModelFileError"} <= set(ppll_compile.__all__)
    assert all(issubclass(getattr(errors, n), errors.PPLLError) for n in exceptions)

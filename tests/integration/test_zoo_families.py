"""The zoo sweep held to its lists: small random-weight models of many timm families and Hugging Face types compile at
2 stages, equal the model in eval mode and train the same under the threads runtime as under the sequential one;
exactly the models of ``REFUSED`` are refused (with their reason) and exactly those of ``NOT_BUILT`` do not build.

The catalogue and the checks are ``benchmarks/zoo_sweep.py``, the lists ``benchmarks/zoo_lists.py``. The test runs
the representative subset ``TESTED`` (18 timm families, 25 Hugging Face types, refused and unbuilt ones among them;
every family and type would take far longer than the suite allows): ``python -m benchmarks.zoo_sweep`` runs them all
and prints the lists it finds and where they disagree with the ones here.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from benchmarks.zoo_sweep import NOT_BUILT, REFUSED, SWEEP, TESTED, built, check

pytestmark = [pytest.mark.usefixtures("one_thread_quietly"), pytest.mark.slow]  # real models

MISSING = {lib for lib in ("timm", "transformers") if importlib.util.find_spec(lib) is None}
CASES = [pytest.param(name, id=name, marks=pytest.mark.skipif(SWEEP[name].library in MISSING,
                                                              reason=f"{SWEEP[name].library} is not installed"))
         for name in TESTED if name in SWEEP]


def test_the_lists_name_models_of_the_sweep_once():
    assert set(REFUSED) <= set(SWEEP) and set(NOT_BUILT) <= set(SWEEP)
    assert set(REFUSED) & set(NOT_BUILT) == set()
    assert set(TESTED) <= set(SWEEP) or MISSING


@pytest.mark.parametrize("name", CASES)
def test_a_model_passes_or_fails_as_its_list_says(name):
    entry = SWEEP[name]
    if name in NOT_BUILT:
        with pytest.raises(Exception, match=re.escape(NOT_BUILT[name])):
            built(entry)
        return
    model = built(entry)
    if name in REFUSED:
        with pytest.raises(Exception, match=re.escape(REFUSED[name])):
            check(entry, model)
        return
    figures = check(entry, model)  # raises when the compiled model's eval output or its trained parameters differ
    assert figures["stages"] == 2

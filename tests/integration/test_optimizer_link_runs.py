"""The optimizer the trainer builds is compared with the one the plan costed: a mismatch warns once, naming both, each
stage's optimizer-state memory against the plan's, and the way out."""

import warnings

import pytest
import torch

import ppll_compile
from tests.models import Residual


def _compiled(optimizer: str):
    torch.manual_seed(0)
    return ppll_compile.compile(Residual(), 2, example_inputs=(torch.randn(8, 3, 8, 8),), profile="flops",
                                devices=["cpu", "cpu"], optimizer=optimizer)


def _warnings(compiled, factory, **options) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.trainer(optimizer=factory, **options).close()
    return [w for w in caught if "optimizer" in str(w.message)]


@pytest.mark.parametrize("planned,factory", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.0, weight_decay=1e-4)),
    ("momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    ("momentum", lambda p: torch.optim.Adagrad(p)),
    ("adam", lambda p: torch.optim.Adam(p)),
    ("adam", lambda p: torch.optim.AdamW(p, amsgrad=True)),
    ("adam", lambda p: torch.optim.RAdam(p)),
])
def test_no_warning_when_they_match(planned, factory):
    assert _warnings(_compiled(planned), factory) == []
    other = {"sgd": "adam", "momentum": "sgd", "adam": "momentum"}[planned]
    caught = _warnings(_compiled(other),
                                     factory)  # the same optimizer against another plan: one warning
    assert len(caught) == 1 and f"Plan with optimizer={planned!r}" in str(caught[0].message)

"""The unit tier: every test here runs in this process and fails after ``UNIT_TIMEOUT`` seconds (a hang fails fast)
unless it carries its own ``@pytest.mark.timeout(N)``; the suite-wide default (pyproject.toml) is for
tests/integration. The timeout is kept by a thread, not a signal, so that it also stops a test blocked inside a C
call (a rendezvous waiting for peers that never come): it dumps every thread's stack and ends the run."""

from __future__ import annotations

from pathlib import Path

import pytest

UNIT_TIMEOUT = 60
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.resolve().is_relative_to(HERE) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT, method="thread"))

"""Fixtures shared by the runtime tests."""

import os
import warnings
from pathlib import Path

import pytest
import torch

# every plan in the tests is costed with the same pinned roofline figures (workers inherit it), not this machine's
os.environ.setdefault("PPLL_DEVICE_FIGURES", str(Path(__file__).with_name("device_figures.json")))


@pytest.fixture
def quietly():
    """No CPU-fallback warnings of compile (a test that records warnings sets its own filter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def one_thread_quietly():
    """One torch thread (the same reduction order in every runtime) and no CPU-fallback warnings of compile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One torch thread, as every worker process runs: the same reduction order in the reference and the workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

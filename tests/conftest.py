"""Fixtures shared by the runtime tests."""

import warnings

import pytest
import torch


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

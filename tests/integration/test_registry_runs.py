"""The runtime registry: every runtime's declared capabilities, the option errors they drive, and a runtime added by
registering one class."""

from __future__ import annotations


import pytest

from tests.helpers import plain_sgd, registry_pipebd, registry_ppll

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


@pytest.mark.parametrize("compiled,options,message", [
    (registry_ppll, {"runtime": "gpu"}, "runtime='gpu' is not known; choose one of sequential, threads, distributed"),
    (registry_ppll, {"runtime": "dna"}, "runtime='dna' is not known; choose one of sequential, threads, distributed"),
    (registry_pipebd, {"runtime": "gpu"},
     "runtime='gpu' is not known; choose one of sequential, threads, distributed, dna, dna-per-block"),
    (registry_ppll, {"queue": "latest"},
     'queue="latest" needs a pipelined runtime ("threads" or "distributed"); the sequential runtime never waits'),
    (registry_pipebd, {"queue": "reuse", "runtime": "dna"},
     'queue="reuse" needs a pipelined runtime ("threads" or "distributed"); the dna runtime never waits'),
    (registry_pipebd, {"decoupled": False, "runtime": "dna-per-block"},
     'decoupled=False (a barrier of all the stages before every optimizer step) applies to the pipelined runtimes '
     '"threads" and "distributed" with queue="fifo"'),
    (registry_ppll, {"runtime": "threads", "queue": "latest", "decoupled": False},
     'decoupled=False (a barrier of all the stages before every optimizer step) applies to the pipelined runtimes '
     '"threads" and "distributed" with queue="fifo"'),
])
def test_the_options_are_checked_against_the_capabilities(compiled, options, message):
    with pytest.raises(ValueError) as info:
        compiled().trainer(optimizer=plain_sgd, **options)
    assert str(info.value) == message

"""ppll-plan words the library's advice as its own flags, and its --help states the defaults the code has."""

import pytest

from ppll_compile.cli.command import main
from tests.helpers import cli_user_error, gated_model_file


@pytest.fixture
def gated(tmp_path) -> str:
    return gated_model_file(tmp_path)


# ---- errors reached through the command line, worded as flags ----------------------------------

@pytest.mark.slow
def test_a_module_fx_cannot_trace_is_advised_as_leaf_modules_flag_that_works(gated, capsys):
    err = cli_user_error(capsys, [gated, "--gpus", "2", "--devices", "cpu,cpu", "--tracer", "fx"])
    assert err == (
        f"ppll-plan: error: torch.fx cannot trace Sequential: in module '2' at {gated}:10 `if x.sum() > 0:`: "
        f"TraceError: symbolically traced variables cannot be used as inputs to control flow\n"
        f"Ways out: keep that module opaque with --leaf-modules 2, or name the cuts yourself with --split-points "
        f"A,B so that only the modules holding them are traced into.\n")
    # the advice works as printed
    assert main([gated, "--gpus", "2", "--devices", "cpu,cpu", "--tracer", "fx", "--leaf-modules", "2",
                 "--yaml", "-"]) == 0
    assert "leaf_modules" not in capsys.readouterr().err

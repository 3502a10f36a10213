"""The allocator setting: freed memory stays in the process (no page faults per step in worker threads), the
``PPLL_MALLOC=default`` opt-out and the environment's own settings are respected, and every runtime applies it."""

from __future__ import annotations

import os
import sys

import pytest

from ppll_compile.allocator import AllocatorSetting


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="the allocator setting acts on glibc (Linux) only")


def test_setting_reads_well() -> None:
    s = AllocatorSetting(applied=(("M_TOP_PAD", 1 << 26),), kept=(("M_TRIM_THRESHOLD", "MALLOC_TRIM_THRESHOLD_"),))
    assert s.changed and str(s) == ("allocator set: M_TOP_PAD=67108864; left as the environment sets them: "
                                    "M_TRIM_THRESHOLD (MALLOC_TRIM_THRESHOLD_)")
    assert str(AllocatorSetting(reason="PPLL_MALLOC=default")) == "allocator left as it was: PPLL_MALLOC=default"

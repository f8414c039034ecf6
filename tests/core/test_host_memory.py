"""keep_freed_memory: applied once on glibc (a second call answers True without calling mallopt again),
skipped when the user tuned malloc or switched it off (its effect on a real forward: BENCHMARKS, pi0 section)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

SCRIPT = "from mstar_core.runtime.host_memory import keep_freed_memory as k; print(k(), k())"


def _run(**env) -> str:
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", **env}).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so.6" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc only")
def test_applied_once_on_glibc():
    assert _run() == "True True"


def test_switched_off_by_env():
    assert _run(MSTAR_MALLOC_TUNING="0") == "False False"
    assert _run(MALLOC_TRIM_THRESHOLD_="1000000") == "False False"

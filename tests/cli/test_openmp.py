"""`mstar serve` re-executes itself on Intel OpenMP (mstar_core/openmp.py) where it is installed, once, and never with MSTAR_OPENMP=gnu."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mstar_core import openmp
from tests.server.helpers import Server

needs_iomp = pytest.mark.skipif(not any("libiomp5" in lib for lib in openmp.libraries()),
                                reason="intel-openmp is not installed here")


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@needs_iomp
def test_preload_env_puts_intel_openmp_first_and_keeps_what_was_preloaded():
    env = openmp.preload_env({"LD_PRELOAD": "/opt/libmine.so"})
    libs = env["LD_PRELOAD"].split(":")
    assert "libiomp5" in libs[0] and libs[-1] == "/opt/libmine.so"
    assert env[openmp.REEXEC_ENV] == "1"


@needs_iomp
def test_preload_env_asks_for_huge_pages_and_keeps_the_callers_tunables():
    assert openmp.preload_env({})[openmp.TUNABLES_ENV] == "glibc.malloc.hugetlb=1"
    mine = "glibc.malloc.arena_max=2"
    assert openmp.preload_env({openmp.TUNABLES_ENV: mine})[openmp.TUNABLES_ENV] == f"{mine}:glibc.malloc.hugetlb=1"
    off = "glibc.malloc.hugetlb=0"  # the caller's own choice stands
    assert openmp.preload_env({openmp.TUNABLES_ENV: off})[openmp.TUNABLES_ENV] == off


def test_preload_env_leaves_a_process_alone_when_asked_or_already_done():
    assert openmp.preload_env({openmp.MODE_ENV: "gnu"}) is None
    assert openmp.preload_env({openmp.REEXEC_ENV: "1"}) is None
    assert openmp.preload_env({"LD_PRELOAD": ":".join(openmp.libraries())}) is None  # nothing left to add


def test_an_unknown_mode_is_named():
    with pytest.raises(SystemExit, match="MSTAR_OPENMP must be 'auto' or 'gnu', got 'intel'"):
        openmp.preload_env({openmp.MODE_ENV: "intel"})


@needs_iomp
def test_served_process_runs_on_intel_openmp_and_gnu_mode_keeps_torch_own():
    intel, gnu = Server(["toy-chat"], wait=False), Server(["toy-chat"], wait=False, MSTAR_OPENMP="gnu")
    try:
        intel.wait_ready()
        gnu.wait_ready()
        assert "libiomp5" in _maps(intel.proc.pid)  # the same pid: the process replaced itself before serving
        environ = Path(f"/proc/{intel.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
        assert "libiomp5" not in _maps(gnu.proc.pid) and "libgomp" in _maps(gnu.proc.pid)
    finally:
        intel.stop()
        gnu.stop()


def test_huge_pages_stop_after_load_unless_kept():
    assert openmp.stop_huge_pages_after_load({openmp.AFTER_LOAD_ENV: "1"}) is False


@needs_iomp
def test_a_served_process_loads_with_huge_pages_then_turns_them_off():
    served, kept = Server(["toy-chat"], wait=False), Server(["toy-chat"], wait=False, MSTAR_HUGE_PAGES_AFTER_LOAD="1")
    try:
        served.wait_ready()
        kept.wait_ready()
        status = {s: Path(f"/proc/{s.proc.pid}/status").read_text() for s in (served, kept)}
        assert "THP_enabled:\t0" in status[served]  # PR_SET_THP_DISABLE, set once the models were in
        assert "THP_enabled:\t1" in status[kept]
    finally:
        served.stop()
        kept.stop()


def test_a_process_started_after_loading_inherits_huge_pages_off_and_a_worker_turns_them_back_on():
    # (in a child: the flag is the whole process's, and survives fork and exec, as for a replacement worker)
    code = ("import subprocess, sys; from mstar_core import openmp; openmp.stop_huge_pages_after_load({}); "
            "probe = 'from mstar_core import openmp; a = openmp.huge_pages_stopped(); openmp.allow_huge_pages(); "
            "print(a, openmp.huge_pages_stopped())'; "
            "print(subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]

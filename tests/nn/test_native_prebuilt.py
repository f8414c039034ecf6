"""The kernels prebuilt at install, per instruction-set level (native_build.py): which level a CPU gets, that they
load with no compiler on PATH, and that each level this CPU runs computes what the first-use build computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from mstar_attn_torch import lane_kernel

from mstar_core.nn import bf16_linear, cpu_elementwise, fp32_linear, native, native_build, tape

X86 = len(native_build.LEVELS) > 1
AVX2_BOX = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2".split())
ZEN4_BOX = AVX2_BOX | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS_BOX = ZEN4_BOX | {"amx_tile", "amx_bf16", "amx_int8"}
ALL = [level.name for level in native_build.LEVELS]


def _prebuilt_levels(source) -> list[str]:
    """The levels prebuilt for `source`'s current version (none: installed without a compiler, or edited since)."""
    text = native_build.source_text(source)
    folder = source.parent / native_build.PREBUILT
    return [lv for lv in native_build.levels_for(text) if (folder / native_build.library_name(source, lv, text)).exists()]


@pytest.mark.skipif(not X86, reason="the instruction-set levels are x86's")
def test_a_cpu_without_avx512_gets_the_avx2_library():
    assert native_build.select_level(AVX2_BOX, ALL) == "avx2"
    assert native_build.select_level(AVX2_BOX - {"fma"}, ALL) == "portable"  # (AVX2 without FMA: the floor)
    assert native_build.select_level(ZEN4_BOX, ALL) == "avx512bf16"
    assert native_build.select_level(ZEN4_BOX - {"avx512_bf16"}, ALL) == "avx512"
    assert native_build.select_level(SAPPHIRE_RAPIDS_BOX, ALL) == "amx"
    assert native_build.select_level(frozenset(), ALL) == "portable"


@pytest.mark.skipif(not X86, reason="the instruction-set levels are x86's")
def test_the_level_is_the_best_built_one_no_higher_than_the_setting():
    assert native_build.select_level(SAPPHIRE_RAPIDS_BOX, ["portable", "avx2", "avx512"]) == "avx512"
    assert native_build.select_level(SAPPHIRE_RAPIDS_BOX, ALL, cap="avx2") == "avx2"
    assert native_build.select_level(AVX2_BOX, ALL, cap="amx") == "avx2"
    assert native_build.select_level(AVX2_BOX, ["avx512"]) is None  # (nothing it runs: built on first use)


@pytest.mark.skipif(not X86, reason="the instruction-set levels are x86's")
def test_a_source_is_built_at_the_levels_its_ifs_test():
    levels = {source.stem: native_build.levels_for(native_build.source_text(source))
              for source in (tape.SOURCE, fp32_linear.SOURCE, bf16_linear.SOURCE, cpu_elementwise.SOURCE)}
    assert levels["tape"] == ["portable"]  # (no vector code, no header)
    assert levels["fp32_linear"] == levels["cpu_elementwise"] == ["portable", "avx2", "avx512"]
    assert levels["bf16_linear"] == ["portable", "avx2", "avx512", "avx512bf16"]
    amx = native_build.levels_for(native_build.source_text(native_build.HEADER.with_name("amx_linear.cpp")))
    assert amx[-1] == "amx"


_NO_COMPILER_PROBE = """
import json, torch
from mstar_core.nn import cpu_elementwise, fp32_linear, native, tape
from mstar_attn_torch import lane_kernel
x = torch.randn(3, 64)
assert cpu_elementwise.rms_norm(x, torch.ones(64), 1e-5) is not None
assert tape.available()
assert lane_kernel.kernel_for(torch.bfloat16) is not None
fp32_linear.available()
print(json.dumps({"active": native.active(), "summary": native.summary()}))
"""


def test_without_a_compiler_on_path_the_prebuilt_kernels_load(tmp_path):
    """A machine with no `c++`, `cc` or `g++` (PATH: a folder holding only python) and an empty kernel cache:
    the kernels load from the libraries built at install, not the torch ops."""
    if not _prebuilt_levels(cpu_elementwise.SOURCE):
        pytest.skip("no prebuilt kernels here (installed without a compiler, or a kernel edited since)")
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)  # (run by its own path: a venv python finds its venv so)
    cache = tmp_path / "cache"
    env = {key: value for key, value in os.environ.items() if key not in ("CXX", "CC", native.SWITCH_ENV)}
    env.update(PATH=str(bare), **{native.CACHE_ENV: str(cache)})
    done = subprocess.run([sys.executable, "-c", _NO_COMPILER_PROBE], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    active = report["active"]
    assert {"cpu_elementwise", "fp32_linear", "tape", "lane_attention"} <= set(active), report
    assert all(build == "prebuilt" for _, build in active.values()), report
    assert "no C++ compiler" not in done.stderr
    assert not cache.exists() or not any(cache.iterdir())  # nothing built on first use
    assert "cpu_elementwise" in report["summary"]


# one kernel per source: (output, reference, tolerance) for a build variant, or None where it is not built for
# this CPU (the fp32 linear's portable build, the bf16 linear below AVX512-BF16)
def _rms_norm(variant):
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(7, 576, generator=gen) * 3, torch.randn(576, generator=gen) * 0.3 + 1
    got = cpu_elementwise.rms_norm(x, weight, 1e-5, variant)
    return got, weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)), 1e-6


def _fp32_linear(variant):
    if not fp32_linear.available(variant):
        return None
    gen = torch.Generator().manual_seed(4)
    weight, x, b = torch.randn(100, 70, generator=gen), torch.randn(13, 70, generator=gen), torch.randn(100, generator=gen)
    got = fp32_linear.linear(x, fp32_linear.pack(weight, variant), 100, b, variant)
    return got.double(), F.linear(x.double(), weight.double(), b.double()), 1e-5 * 70 ** 0.5


def _bf16_linear(variant):
    if not bf16_linear.available(variant):
        return None
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(5, 64, generator=gen).bfloat16()
    got = bf16_linear.linear(x, bf16_linear.pack(weight, variant), 96, None, variant)
    return got.double(), F.linear(x.double(), weight.double()), 2 ** -8


def _tape(variant):
    size = native.function(tape.SOURCE, "mstar_tape_op_bytes", [], __import__("ctypes").c_int64, variant)
    return torch.tensor([float(size())]), torch.tensor([8.0 * (2 + tape._ARGS)]), 0.0


def _lane_attention(variant):
    from tests.engines.test_lane_kernel import _case

    store_k, store_v, q, k, v, plan = _case(torch.bfloat16, 64, 3, torch.Generator().manual_seed(5))
    out = torch.zeros_like(q)
    lane_kernel.LaneCall(lane_kernel.kernel_for(torch.bfloat16, variant), plan)(q, k, v, store_k, store_v, out, 0.125)
    got = out[plan.rows].float()
    return got, got, 1e-2  # (no torch reference here: tests/engines/test_lane_kernel.py has it; the builds agree)


KERNELS = {"lane_attention": (lane_kernel.SOURCE, _lane_attention),
           "cpu_elementwise": (cpu_elementwise.SOURCE, _rms_norm), "fp32_linear": (fp32_linear.SOURCE, _fp32_linear),
           "bf16_linear": (bf16_linear.SOURCE, _bf16_linear), "tape": (tape.SOURCE, _tape)}


@pytest.mark.parametrize("stem", list(KERNELS))
def test_each_prebuilt_level_this_cpu_runs_computes_what_the_first_use_build_does(stem, monkeypatch):
    source, run = KERNELS[stem]
    flags = native_build.cpu_flags()
    levels = [lv for lv in _prebuilt_levels(source) if native_build.BY_NAME[lv].cpu_flags <= flags]
    if not levels:
        pytest.skip("no prebuilt library of this kernel for this CPU")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_how", {})
    prebuilt = {level: run(level) for level in levels}
    assert all(native._how[(source.stem, level)] == (level, "prebuilt") for level in levels)
    for result in prebuilt.values():
        if result is not None:
            got, want, tolerance = result
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    if native_build.compiler() is None:
        return
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_load_prebuilt", lambda source, variant: None)  # the first-use build, same level
    for level, result in prebuilt.items():
        jit = run(level)
        assert (jit is None) == (result is None), level
        if result is not None:  # (equal but for the sum order: the portable floor is 4 lanes, -march=native's more)
            torch.testing.assert_close(jit[0], result[0], atol=result[2], rtol=result[2], msg=level)


def test_the_banner_and_metrics_say_which_kernels_run_at_which_level():
    from mstar_core.api.server.app import ServerConfig
    from mstar_core.api.server.launch import banner
    from mstar_core.api.server.metrics import Metrics

    if cpu_elementwise.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5) is None:
        pytest.skip("no kernel here (no compiler and nothing prebuilt)")
    level, build = native.active()["cpu_elementwise"]
    assert f"cpu_elementwise {level}" in banner(ServerConfig(models=[]), "127.0.0.1", 8000, {}, {})
    scraped = Metrics(object()).render().decode()
    assert f'mstar_native_kernels{{build="{build}",kernel="cpu_elementwise",level="{level}"}} 1.0' in scraped

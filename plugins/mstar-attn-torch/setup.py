"""Builds the attention kernels (lane_attention.cpp, prefill_attention.cpp) with the package, once per
instruction-set level, with mstar-core's builder (mstar_core/nn/native_build.py: from this checkout, else from the
installed mstar-core; without either the kernels are built on first use, as before). The rest of the configuration
is in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup


def _builder_path() -> Path | None:
    beside = Path(__file__).resolve().parents[2] / "mstar_core/nn/native_build.py"
    if beside.exists():
        return beside
    core = importlib.util.find_spec("mstar_core")  # (finds the package without importing it)
    if core is not None and core.submodule_search_locations:
        installed = Path(next(iter(core.submodule_search_locations))) / "nn/native_build.py"
        return installed if installed.exists() else None
    return None


cmdclass = {}
if (path := _builder_path()) is not None:
    spec = importlib.util.spec_from_file_location("mstar_native_build", path)
    native_build = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
    spec.loader.exec_module(native_build)
    cmdclass = native_build.cmdclass(["mstar_attn_torch"])

setup(cmdclass=cmdclass)

"""Builds the CPU kernels (mstar_core/nn/*.cpp) with the package, once per instruction-set level (native_build.py);
the rest of the configuration is in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

_spec = importlib.util.spec_from_file_location("mstar_native_build", Path(__file__).parent / "mstar_core/nn/native_build.py")
native_build = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # (dataclasses look it up)
_spec.loader.exec_module(native_build)

setup(cmdclass=native_build.cmdclass(["mstar_core.nn"]))

"""The import-linter contracts in pyproject.toml hold on this tree and fail on an upward import.

Each refusal case copies `mstar_core` into a temporary directory, adds one module with a forbidden
import, and runs `lint-imports` with the real contracts over the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the `mstar_core` found first on the path from `root`, with `root`'s pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def copy_with(tmp_path: Path, module: str, source: str) -> Path:
    """A copy of the core (its Python files) plus one module `module` holding `source`."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "mstar_core", tmp_path / "mstar_core",
                    ignore=lambda d, names: [n for n in names if not (n.endswith(".py") or (Path(d) / n).is_dir())
                                             or n == "__pycache__"])
    path = tmp_path / Path(*module.split("."))
    path.with_suffix(".py").write_text(source)
    return tmp_path


def test_the_contracts_hold_on_this_tree():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert "BROKEN" not in result.stdout and result.stdout.count("KEPT") == len(declared)


@pytest.mark.parametrize(
    ("module", "source", "contract", "names"),
    [
        # the in-process runtime reaching up into the multi-process one (what AsyncEngine used to do)
        ("mstar_core.runtime.upward", "from mstar_core.cluster.cluster import Cluster\n", "mstar_core layers",
         "mstar_core.runtime.upward -> mstar_core.cluster.cluster"),
        # the kernel reaching up into the HTTP surface (a function-level import counts too)
        ("mstar_core.graph.upward", "def f():\n    from mstar_core.api import server\n", "mstar_core layers",
         "mstar_core.graph.upward -> mstar_core.api.server"),
        # the model-building library and the in-process runtime are siblings: neither imports the other
        ("mstar_core.nn.sideways", "import mstar_core.runtime.conductor\n", "mstar_core layers",
         "mstar_core.nn.sideways -> mstar_core.runtime.conductor"),
        ("mstar_core.runtime.plugin_by_name", "import mstar_kvcache\n", "imports no plugin or model package",
         "mstar_core.runtime.plugin_by_name -> mstar_kvcache"),
        # two modules of one package importing each other
        ("mstar_core.wire.codec_again", "from mstar_core.wire import cyclic\n", "no import cycles", "cyclic"),
    ],
)
def test_a_contract_fails_on_a_forbidden_import(tmp_path, module, source, contract, names):
    root = copy_with(tmp_path, module, source)
    if module.endswith("codec_again"):  # its partner, importing it back
        (root / "mstar_core" / "wire" / "cyclic.py").write_text("from mstar_core.wire import codec_again\n")
    result = lint(root)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = result.stdout[result.stdout.index("Broken contracts"):]
    assert contract in broken and names in broken, broken  # (an upward import also makes a cycle: both may fail)

"""The import-linter contracts in pyproject.toml hold on this tree and fail on an upward import.

The contracts cover `mstar_core`, every plugin and every model package. Each refusal case copies the one
package it edits (its Python files) into a temporary directory, adds or changes modules there, and runs
`lint-imports` with the real contracts: the copy comes first on the path, every other package is the
installed one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
#: every installable package's import name, found on disk: the core, plugins/*/src/*, mstar_*/src/*, examples/*/src/*
ON_DISK = {"mstar_core"} | {
    p.name for pattern in ("plugins/*/src/*", "mstar_*/src/*", "examples/*/src/*")
    for p in REPO.glob(pattern) if (p / "__init__.py").is_file()
}


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with `root`'s pyproject.toml, the packages under `root` found before the installed ones."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def copy_with(tmp_path: Path, files: dict[str, str]) -> Path:
    """A copy of the package that `files` (module name -> source) edit, its Python files only, with `files` written
    into it; and the real pyproject.toml beside it."""
    (package,) = {module.split(".")[0] for module in files}
    source = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(source, tmp_path / package,
                    ignore=lambda d, names: [n for n in names if not (n.endswith(".py") or (Path(d) / n).is_dir())
                                             or n == "__pycache__"])
    for module, text in files.items():
        (tmp_path / Path(*module.split("."))).with_suffix(".py").write_text(text)
    return tmp_path


def test_the_contracts_cover_every_package_on_disk():
    assert set(CONFIG["root_packages"]) == ON_DISK
    acyclic = next(c for c in CONFIG["contracts"] if c["type"] == "acyclic_siblings")
    assert set(acyclic["ancestors"]) == ON_DISK  # so no package anywhere has a cycle among its modules


def test_the_contracts_hold_on_this_tree():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout
    assert result.stdout.count("KEPT") == len(CONFIG["contracts"]), result.stdout
    assert "no import cycles between sibling packages or modules KEPT" in " ".join(result.stdout.split())


MODELS_BELOW = "surfaces > model packages > engines"


@pytest.mark.parametrize(
    ("files", "contract", "names"),
    [
        # the in-process runtime reaching up into the multi-process one (what AsyncEngine used to do)
        ({"mstar_core.runtime.upward": "from mstar_core.cluster.cluster import Cluster\n"}, "mstar_core layers",
         "mstar_core.runtime.upward -> mstar_core.cluster.cluster"),
        # the kernel reaching up into the HTTP surface (a function-level import counts too)
        ({"mstar_core.graph.upward": "def f():\n    from mstar_core.api import server\n"}, "mstar_core layers",
         "mstar_core.graph.upward -> mstar_core.api.server"),
        # the model-building library and the in-process runtime are siblings: neither imports the other
        ({"mstar_core.nn.sideways": "import mstar_core.runtime.conductor\n"}, "mstar_core layers",
         "mstar_core.nn.sideways -> mstar_core.runtime.conductor"),
        ({"mstar_core.runtime.plugin_by_name": "import mstar_kvcache\n"}, "imports no plugin or model package",
         "mstar_core.runtime.plugin_by_name -> mstar_kvcache"),
        # two modules of one package importing each other
        ({"mstar_core.wire.codec_again": "from mstar_core.wire import cyclic\n",
          "mstar_core.wire.cyclic": "from mstar_core.wire import codec_again\n"}, "no import cycles", "cyclic"),
        # a model package reaching up into the command line and the HTTP server, inside a function too
        ({"mstar_pi05.upward": "from mstar_core.cli import main\n"}, MODELS_BELOW,
         "mstar_pi05.upward -> mstar_core.cli"),
        ({"mstar_pi05.upward": "def serve():\n    from mstar_core.api import server\n"}, MODELS_BELOW,
         "mstar_pi05.upward -> mstar_core.api.server"),
        # one model package borrowing from another
        ({"mstar_pi05.borrowed": "from mstar_llm.prepare import RequestPreparer\n"},
         "no model package imports another model package", "mstar_pi05.borrowed -> mstar_llm.prepare"),
        # an engine importing a model package
        ({"mstar_stateless.special_case": "import mstar_bagel\n"}, MODELS_BELOW,
         "mstar_stateless.special_case -> mstar_bagel"),
        # the cycle pi05 had, hidden behind a function-level import: the split list importing the loader back
        ({"mstar_pi05.split": (REPO / "mstar_pi05/src/mstar_pi05/split.py").read_text()
          + "\n\ndef load_split(*args):\n    from mstar_pi05.parallel import load_policy_tensor_parallel\n"},
         "no import cycles", "No cycles are allowed in mstar_pi05"),
    ],
)
def test_a_contract_fails_on_a_forbidden_import(tmp_path, files, contract, names):
    result = lint(copy_with(tmp_path, files))
    assert result.returncode == 1, result.stdout + result.stderr
    broken = result.stdout[result.stdout.index("Broken contracts"):]
    assert contract in broken and names in broken, broken  # (an upward import also makes a cycle: both may fail)

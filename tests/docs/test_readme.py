"""The README and docs/ stay true to the tree: figures from `tools/loc.py`, every hook named, links that resolve,
module paths in requirements.txt that exist, and a README short enough to read in five minutes."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFRESH = "run `python tools/loc.py --write` and commit the refreshed figures"


def _load_loc():
    spec = importlib.util.spec_from_file_location("mstar_tools_loc", ROOT / "tools" / "loc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


loc = _load_loc()


def test_the_quoted_figures_are_within_ten_percent_of_the_tree():
    drifted = loc.drifts(ROOT)
    assert not drifted, "\n".join(drifted) + f"\n{REFRESH}"


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md"])
def test_the_documents_that_quote_figures_still_have_their_block(doc):
    assert loc.blocks((ROOT / doc).read_text()), f"{doc} lost its figures block (`<!-- figures: ... -->`)"


def test_a_printed_table_reads_back_as_the_counts_it_printed():
    names = list(loc.BY_NAME)
    text = f"<!-- figures: python tools/loc.py {' '.join(names)} -->\n{loc.table(names)}<!-- /figures -->\n"
    [(parsed_names, quoted)] = loc.blocks(text)
    assert parsed_names == names
    assert quoted == {n: loc.count(loc.BY_NAME[n])[1] for n in names}


def test_the_check_command_passes_on_the_tree():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "loc.py"), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr + REFRESH


def test_an_area_counts_no_test_file(tmp_path):
    (tmp_path / "mstar_core" / "api" / "tests").mkdir(parents=True)
    (tmp_path / "mstar_core" / "api" / "route.py").write_text("a = 1\nb = 2\n")
    (tmp_path / "mstar_core" / "api" / "tests" / "test_route.py").write_text("assert True\n")
    assert loc.count(loc.BY_NAME["api"], tmp_path) == (1, 2)


def test_the_readme_reads_in_five_minutes_and_points_onwards():
    assert len(README.splitlines()) <= 200
    for doc in ("docs/ARCHITECTURE.md", "docs/OPERATIONS.md", "docs/MODEL_AUTHORS.md"):
        assert f"]({doc}" in README, f"the README does not link {doc}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_relative_links_of_the_docs_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", doc.read_text()):
            path = doc.parent / target if target else doc
            assert path.exists(), f"{doc.relative_to(ROOT)} links {target}, which does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path.read_text()), f"{doc.relative_to(ROOT)} links {target}#{anchor}: no such heading"


def test_every_hook_is_named_where_the_readme_lists_them():
    source = (ROOT / "mstar_core" / "plugins" / "hookspecs.py").read_text()
    hooks = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    assert len(hooks) == 7  # (issue 51 added mstar_register_compositions)
    listed = set(re.findall(r"`(mstar_register_\w+)`", README))
    assert listed == hooks, f"README names {sorted(listed)}; hookspecs.py declares {sorted(hooks)}"


def _module_exists(dotted: str) -> bool:
    top, *rest = dotted.split(".")
    roots = [ROOT / top, ROOT / top / "src" / top, *ROOT.glob(f"plugins/*/src/{top}")]
    for root in (r for r in roots if r.is_dir()):
        path = root.joinpath(*rest)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
    return False


def test_the_modules_requirements_txt_names_exist():
    named = re.findall(r"\((mstar_\w+(?:\.\w+)*)[):]", (ROOT / "requirements.txt").read_text())
    assert named, "requirements.txt names no module any more: drop this test or its pattern"
    missing = [m for m in named if not _module_exists(m)]
    assert not missing, f"requirements.txt names modules that do not exist: {missing}"

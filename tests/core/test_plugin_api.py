"""The plugin API holds (issue 26): it has a version and a changelog, and a changed behaviour warns for one
minor version before it errors; engine classes declare their options (the 1.0 way warns)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import mstar_core
from mstar_core.compat import CHANGES, PLUGIN_API_VERSION, Change, PluginAPIError, PluginAPIWarning, changed
from mstar_core.errors import GraphValidationError
from mstar_core.graph import Graph, GraphNode, NodeCall, Walk
from mstar_core.graph.options import declare_call_options, known_call_options, node_ref_options
from mstar_core.runtime.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_changelogs_newest_and_the_guide_names_both():
    assert re.fullmatch(r"\d+\.\d+", PLUGIN_API_VERSION) and mstar_core.PLUGIN_API_VERSION == PLUGIN_API_VERSION
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.findall(r"^## (\d+\.\d+)", changelog, flags=re.M)[0] == PLUGIN_API_VERSION
    assert "warns for one minor version before it errors" in changelog
    guide = (ROOT / "docs" / "MODEL_AUTHORS.md").read_text()
    assert "PLUGIN_API_VERSION" in guide and "CHANGELOG.md" in guide


def test_every_change_is_in_the_changelog_under_the_version_that_made_it():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    sections = dict(re.findall(r"^## (\d+\.\d+)[^\n]*\n(.*?)(?=^## |\Z)", changelog, flags=re.M | re.S))
    for key, change in CHANGES.items():
        assert key in sections[change.since], f"CHANGELOG.md's {change.since} section does not list {key}"


def test_a_change_warns_in_its_own_minor_version_and_errors_from_the_next(monkeypatch):
    monkeypatch.setitem(CHANGES, "old_way", Change(what="the old way", instead="use the new way", since="3.4"))
    with pytest.warns(PluginAPIWarning, match=r"the old way changed in plugin API 3.4 \(errors from 3.5\): use the new"):
        changed("old_way", version="3.4")
    for later in ("3.5", "3.12", "4.0"):
        with pytest.raises(PluginAPIError, match="use the new way"):
            changed("old_way", version=later)


def _graph(kind: str, **call_options) -> Graph:
    node = GraphNode("n", inputs="x", outputs="y", engine=kind)
    return Graph.build("m", [node], [Walk(name="w", body=NodeCall("n", options=call_options), inputs="x")])


def test_an_engine_class_declares_its_options_and_graph_build_checks_walks_against_them():
    class Declared(Engine):
        kind = "declared_options_test"
        call_options = frozenset({"cache_label"})
        node_options = frozenset({"schedule"})
        node_ref_options = frozenset({"share_with"})

    assert known_call_options(Declared.kind) == {"cache_label", "schedule"}
    assert node_ref_options(Declared.kind) == {"share_with"}
    _graph(Declared.kind, cache_label="main")
    with pytest.raises(GraphValidationError, match=r"cache_lable.*known options: \['cache_label', 'schedule'\]"):
        _graph(Declared.kind, cache_lable="main")


def test_declare_call_options_still_works_in_1_1_and_warns_what_to_do_instead():
    with pytest.warns(PluginAPIWarning, match="set `call_options`.*on the Engine class") as record:
        declare_call_options("declared_the_old_way", ("cache_label",))
    assert record[0].filename == __file__  # the warning points at the plugin's line, not the core's
    with pytest.raises(GraphValidationError, match="cache_lable"):
        _graph("declared_the_old_way", cache_lable="main")


def test_the_shipped_engines_declare_on_their_classes_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginAPIWarning)
        from mstar_diffusion.engine import DiffusionEngine
        from mstar_kvcache.engine import KVCacheEngine
    assert known_call_options("kvcache") == KVCacheEngine.call_options
    assert node_ref_options("kvcache") == {"share_cache_with"}
    assert known_call_options("diffusion") == DiffusionEngine.call_options | DiffusionEngine.node_options


def test_every_hook_runs_has_a_one_line_docstring_a_row_in_the_guide_and_a_test():
    from mstar_core.plugins import hookspecs
    from mstar_core.plugins.manager import HOOKS

    specs = sorted(name for name in vars(hookspecs) if name.startswith("mstar_register_"))
    assert specs == sorted(HOOKS)
    guide = (ROOT / "docs" / "MODEL_AUTHORS.md").read_text()
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if "compat" not in p.parts)
    for name in specs:
        doc = (getattr(hookspecs, name).__doc__ or "").strip()
        assert doc and "\n" not in doc, f"{name}: its docstring is one line"
        assert f"`{name}(register)`" in guide, f"{name} has no row in docs/MODEL_AUTHORS.md's hook table"
        assert tests.count(name) >= 1, f"no test uses {name}"

"""The HTTP surface keeps its layers: every route module is small and imports no other route; an upward import
inside `mstar_core.api` breaks the `api layers` contract; the import paths plugins of the last release use resolve."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from tests.core.test_layers import copy_with, lint

API = Path(__file__).resolve().parents[2] / "mstar_core" / "api"
ROUTES = API / "routes"


def _imported_modules(tree: ast.Module, package: str) -> set[str]:
    """Every module an `import` or `from ... import` in `tree` names (function-level imports included); a
    `from PACKAGE import name` also counts as `PACKAGE.name`, which may be a module."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_every_route_module_is_small_and_imports_no_other_route():
    modules = sorted(p for p in ROUTES.glob("*.py") if p.name != "__init__.py")
    route_names = {f"mstar_core.api.routes.{p.stem}" for p in modules}
    assert len(route_names) >= 8, route_names
    for path in modules:
        source = path.read_text()
        lines = len(source.splitlines())
        assert lines <= 200, f"{path.name} has {lines} lines; a route module holds at most 200"
        own = f"mstar_core.api.routes.{path.stem}"
        imported = _imported_modules(ast.parse(source), "mstar_core.api.routes")
        others = sorted(m for m in imported if m in route_names and m != own)
        assert not others, f"{path.name} imports other routes {others}; shared code belongs in requests/"


def test_an_upward_import_inside_the_api_breaks_its_layers(tmp_path):
    root = copy_with(tmp_path, {"mstar_core.api.media.upward": "from mstar_core.api.routes import chat\n"})
    result = lint(root)
    assert result.returncode != 0
    assert "api layers" in result.stdout and "mstar_core.api.media.upward -> mstar_core.api.routes.chat" in result.stdout


def test_a_layer_importing_a_compatibility_path_breaks_the_contract(tmp_path):
    root = copy_with(tmp_path, {"mstar_core.api.requests.old_path": "from mstar_core.api.errors import ApiError\n"})
    result = lint(root)
    assert result.returncode != 0 and "compatibility path" in result.stdout, result.stdout


def test_the_last_release_import_paths_still_resolve():
    from mstar_core.api.http.errors import ApiError
    from mstar_core.api.media.video import VideoPart
    from mstar_core.api.requests.adapters import ApiAdapter
    from mstar_core.api.requests.submit import submit

    expected = {
        ("mstar_core.api.adapters", "ApiAdapter"): ApiAdapter,
        ("mstar_core.api.video", "VideoPart"): VideoPart,
        ("mstar_core.api.errors", "ApiError"): ApiError,
        ("mstar_core.api.common", "submit"): submit,
    }
    for (module, name), obj in expected.items():
        assert getattr(importlib.import_module(module), name) is obj, (module, name)
    media = importlib.import_module("mstar_core.api.media")
    for name in ("AudioPart", "ImagePart", "MediaLimits", "TextPart", "resample"):
        assert getattr(media, name) is not None
    assert importlib.import_module("mstar_core.api.realtime.conversation").TokensPart is not None
    api = importlib.import_module("mstar_core.api")
    for name in ("ROUTES", "ApiAdapter", "ApiAdapterProtocol", "TokenizerChatAdapter", "to_int16_pcm", "to_png"):
        assert hasattr(api, name), name

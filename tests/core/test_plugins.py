"""Plugin discovery through entry points, failure isolation, restriction, and one test per hook."""

import types

import pytest

from mstar_core.errors import RegistryLookupError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover, hookimpl
from mstar_core.runtime import AsyncEngine


def test_entry_point_plugins_are_discovered_with_versions():
    registry = discover()
    by_name = {p.name: p for p in registry.plugins}
    assert by_name["core"].distribution == "mstar-core" and by_name["core"].loaded
    fixture = by_name["fixture"]
    assert fixture.distribution == "mstar-fixture-plugin" and fixture.version == "0.0.1" and fixture.loaded
    assert "fixture_echo" in registry.engines and "function" in registry.engines
    assert "fixture-echo" in registry.models


def test_broken_plugin_is_reported_and_the_rest_load():
    registry = discover()
    broken = {p.name: p for p in registry.failed()}["fixture_broken"]
    assert broken.distribution == "mstar-fixture-plugin"
    assert "ImportError: fixture plugin is broken on purpose" in broken.error
    assert "fixture-echo" in registry.models  # the healthy plugin from the same distribution still loaded


def test_plugin_whose_hook_raises_is_reported_and_the_rest_load():
    registry = discover()
    broken = {p.name: p for p in registry.failed()}["fixture_hook_raises"]
    assert broken.distribution == "mstar-fixture-plugin" and not broken.loaded
    assert "RuntimeError: fixture plugin hook fails on purpose (in mstar_register_engines)" in broken.error
    # none of what it registered before raising shows, not even from its hook that succeeded
    assert "fixture_half_registered" not in registry.engines and "fixture-half-registered" not in registry.models
    assert "fixture_echo" in registry.engines and "fixture-echo" in registry.models and "function" in registry.engines


def test_mstar_plugins_lists_a_plugin_whose_hook_raised(capsys):
    from mstar_core.cli import main

    assert main(["plugins"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "fixture_hook_raises" in line)
    assert "mstar-fixture-plugin" in line and "FAILED: RuntimeError: fixture plugin hook fails on purpose" in line


def test_in_process_plugin_whose_hook_raises_is_reported(caplog):
    def explode(register):
        raise KeyError("missing config")

    bad = _plugin(mstar_register_transports=explode, mstar_register_engines=lambda register: register("ghost", object))
    registry = discover(extra_modules=[bad])
    (info,) = [p for p in registry.failed() if p.distribution == "(registered in process)"]
    assert "KeyError: 'missing config' (in mstar_register_transports)" in info.error
    assert "ghost" not in registry.engines and "function" in registry.engines
    assert "failed to register" in caplog.text and "missing config" in caplog.text


def test_environment_variable_restricts_plugins(monkeypatch):
    monkeypatch.setenv("MSTAR_PLUGINS", "core")
    registry = discover()
    assert [p.name for p in registry.plugins] == ["core"]
    assert "fixture_echo" not in registry.engines and not registry.failed()


def test_failed_lookup_lists_known_names():
    registry = discover()
    with pytest.raises(RegistryLookupError, match="unknown engine 'warp'; known: .*fixture_echo.*function"):
        registry.engines.get("warp")
    with pytest.raises(RegistryLookupError, match="unknown model 'nope'; known: .*fixture-echo"):
        registry.models.get("nope")


def _plugin(**hooks):
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def test_hook_register_models():
    spec = types.SimpleNamespace(name="hooked-model")
    registry = discover(extra_modules=[_plugin(mstar_register_models=lambda register: register(spec))])
    assert registry.models.get("hooked-model") is spec


def test_hook_register_engines():
    cls = type("E", (), {})
    registry = discover(extra_modules=[_plugin(mstar_register_engines=lambda register: register("hooked", cls))])
    assert registry.engines.get("hooked") is cls


def test_hook_register_transports():
    t = object()
    registry = discover(extra_modules=[_plugin(mstar_register_transports=lambda register: register("carrier-pigeon", t))])
    assert registry.transports.get("carrier-pigeon") is t


def test_hook_register_attention_backends():
    b = object()
    registry = discover(extra_modules=[_plugin(mstar_register_attention_backends=lambda register: register("naive", b))])
    assert registry.attention_backends.get("naive") is b


def test_hook_register_api_adapters():
    adapter = types.SimpleNamespace(model="x", routes={"speech"})
    registry = discover(extra_modules=[_plugin(mstar_register_api_adapters=lambda register: register(adapter))])
    assert adapter in registry.api_adapters


def test_hook_register_compositions():
    from mstar_core.compose import CompositionSpec

    spec = CompositionSpec("duet", ("left", "right"), build=lambda name, parts, options: None)
    registry = discover(extra_modules=[_plugin(mstar_register_compositions=lambda register: register(spec))])
    assert registry.compositions.get("duet") is spec
    assert "voice_agent" in registry.compositions  # the core's own, registered like any plugin's


def test_conflicting_registrations_name_both_plugins():
    a = _plugin(mstar_register_engines=lambda register: register("function", object()))
    with pytest.raises(ValueError, match="engine 'function' registered twice"):
        discover(extra_modules=[a])


async def test_third_party_model_runs_through_the_engine():
    engine = AsyncEngine(discover())
    loaded = await engine.load_model("fixture-echo", LoadOptions(preset="tiny"))
    assert loaded.random_weights
    outs = [o async for o in engine.submit("fixture-echo", {"x": 41})]
    assert [(o.name, o.value) for o in outs] == [("y", 41)]
    await engine.close()

"""Plugin discovery through entry points (group `mstar`) and the registries the hooks fill."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any

import attrs
import pluggy

from mstar_core.errors import RegistryLookupError
from mstar_core.plugins import hookspecs

log = logging.getLogger("mstar.plugins")

ENTRY_POINT_GROUP = "mstar"
#: Comma-separated entry-point names to load; unset loads every plugin found.
PLUGINS_ENV = "MSTAR_PLUGINS"
#: The registration hooks, in the order they run.
HOOKS = ("mstar_register_models", "mstar_register_engines", "mstar_register_transports",
         "mstar_register_attention_backends", "mstar_register_api_adapters", "mstar_register_routes",
         "mstar_register_compositions")


@attrs.define
class PluginInfo:
    """One discovered plugin: where it came from and whether it loaded."""

    name: str
    distribution: str
    version: str
    module: str
    error: str | None = None

    @property
    def loaded(self) -> bool:
        return self.error is None


class NamedRegistry:
    """Name -> object map whose failed lookups list the names it knows."""

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, Any] = {}
        self.origin: dict[str, str] = {}

    def add(self, name: str, obj: Any, origin: str = "?") -> None:
        if name in self._items and self._items[name] is not obj:
            raise ValueError(
                f"{self.what} '{name}' registered twice (by {self.origin[name]} and {origin}); "
                f"uninstall one or restrict plugins with {PLUGINS_ENV}"
            )
        self._items[name] = obj
        self.origin[name] = origin

    def get(self, name: str) -> Any:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise RegistryLookupError(f"unknown {self.what} '{name}'; known: {known}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self):
        return iter(sorted(self._items))

    def items(self):
        return sorted(self._items.items())


class Registry:
    """What the loaded plugins provide: models, engines, transports, attention backends, API adapters, routes,
    compositions."""

    def __init__(self, pm: pluggy.PluginManager, plugins: list[PluginInfo]):
        self.pm = pm
        self.plugins = plugins
        self.models = NamedRegistry("model")
        self.engines = NamedRegistry("engine")
        self.transports = NamedRegistry("transport")
        self.attention_backends = NamedRegistry("attention backend")
        self.compositions = NamedRegistry("composition")
        self.api_adapters: list[Any] = []
        self.routers: list[tuple[str, Any]] = []  # (plugin, its router factory): the server includes each router
        self._collect()

    def _collect(self) -> None:
        """Run every registration hook, then apply what each plugin registered.

        A plugin whose hook raises is reported like a failed import and none of its registrations
        are applied (a half-registered plugin would be worse than none); the others load. Two
        plugins registering one name still raise: the installation has to choose between them.
        """
        staged: list[tuple[str, Callable[..., None], tuple]] = []  # (plugin, add, arguments), in hook order
        broken: dict[str, str] = {}
        for hook_name in HOOKS:
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                origin = impl.plugin_name
                if origin in broken:
                    continue
                try:
                    impl.function(register=self._recorder(hook_name, origin, staged))
                except Exception as exc:  # one plugin's bug must not take the others down
                    broken[origin] = f"{type(exc).__name__}: {exc} (in {hook_name})"
                    self._mark_failed(origin, broken[origin], exc)
        for origin, add, args in staged:
            if origin not in broken:
                add(*args)

    def _recorder(self, hook_name: str, origin: str, staged: list) -> Callable[..., None]:
        """The `register` a plugin's hook is given: it records each registration for `_collect` to apply."""
        if hook_name == "mstar_register_models":
            return lambda spec: staged.append((origin, self.models.add, (spec.name, spec, origin)))
        if hook_name == "mstar_register_compositions":
            return lambda spec: staged.append((origin, self.compositions.add, (spec.name, spec, origin)))
        if hook_name == "mstar_register_api_adapters":
            return lambda adapter: staged.append((origin, self.api_adapters.append, (adapter,)))
        if hook_name == "mstar_register_routes":
            return lambda router: staged.append((origin, self.routers.append, (_router(router, origin),)))
        registry = {"mstar_register_engines": self.engines, "mstar_register_transports": self.transports,
                    "mstar_register_attention_backends": self.attention_backends}[hook_name]
        return lambda key, obj: staged.append((origin, registry.add, (key, obj, origin)))

    def _mark_failed(self, name: str, error: str, exc: Exception) -> None:
        info = next((p for p in self.plugins if p.name == name), None)
        if info is None:
            info = PluginInfo(name, "?", "?", "?")
            self.plugins.append(info)
        info.error = error
        self.pm.unregister(name=name)  # none of its hooks run again
        # one line, like a failed import; the traceback is for whoever debugs that plugin
        log.warning("plugin %s from distribution %s failed to register: %s", name, info.distribution, error)
        log.debug("traceback of plugin %s's failed registration", name, exc_info=exc)

    def failed(self) -> list[PluginInfo]:
        return [p for p in self.plugins if not p.loaded]


def _router(make_router: Any, origin: str) -> tuple[str, Any]:
    """A registered router factory, checked where it is registered (a wrong object fails its plugin, not the server).

    A factory, not a router: discovery (`mstar plugins`) stays free of the web stack; the server calls it.
    """
    if not callable(make_router):
        raise TypeError("mstar_register_routes takes a no-argument callable returning a fastapi.APIRouter, "
                        f"got {type(make_router).__name__}")
    return origin, make_router


def _allowed() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def discover(extra_modules: Iterable[Any] = ()) -> Registry:
    """Load every `mstar` entry point (as limited by MSTAR_PLUGINS) and build the registry.

    A plugin that fails to import is recorded with its distribution and error; the rest load.
    `extra_modules` are registered too (objects or import paths), for tests and embedding.
    """
    pm = pluggy.PluginManager("mstar")
    pm.add_hookspecs(hookspecs)
    allowed = _allowed()
    infos: list[PluginInfo] = []
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        info = PluginInfo(ep.name, dist, version, ep.value)
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not take the others down
            info.error = f"{type(exc).__name__}: {exc}"
            log.warning("plugin %s from distribution %s failed to load: %s", ep.name, dist, info.error)
        infos.append(info)
    for extra in extra_modules:
        module = importlib.import_module(extra) if isinstance(extra, str) else extra
        name = getattr(module, "__name__", repr(module))
        if not pm.is_registered(module):
            pm.register(module, name=name)
        infos.append(PluginInfo(name, "(registered in process)", "-", name))
    return Registry(pm, infos)


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _default
    if _default is None:
        _default = discover()
    return _default

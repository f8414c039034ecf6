"""Plugins: hook specifications and discovery through the `mstar` entry-point group."""

from mstar_core.plugins.hookspecs import hookimpl, hookspec
from mstar_core.plugins.manager import PluginInfo, Registry, default_registry, discover

__all__ = ["PluginInfo", "Registry", "default_registry", "discover", "hookimpl", "hookspec"]

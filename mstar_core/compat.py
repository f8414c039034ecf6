"""The plugin API's version and its rule: a behaviour that changes warns for one minor version, then errors.

`PLUGIN_API_VERSION` versions the surface docs/MODEL_AUTHORS.md names (CHANGELOG.md says what each
version changed). A change that would break a plugin written for the previous minor version is
registered in `CHANGES` with the version that introduced it; `changed(key)` warns
(`PluginAPIWarning`) while the API is at that version and raises `PluginAPIError` from the next
minor version on, so bumping the version is what turns the warning into an error, for every change.
"""

from __future__ import annotations

import warnings

import attrs

from mstar_core.errors import MStarError

PLUGIN_API_VERSION = "1.1"


class PluginAPIWarning(FutureWarning):
    """A plugin relies on a behaviour that changed: it works this minor version and errors from the next."""


class PluginAPIError(MStarError):
    """A plugin relies on a behaviour whose one minor version of warnings has passed."""


@attrs.frozen
class Change:
    """One behaviour change: what a plugin does, what to do instead, and the version that introduced it."""

    what: str
    instead: str
    since: str

    @property
    def errors_from(self) -> str:
        """The next minor version: the first in which the old behaviour errors."""
        major, minor = (int(p) for p in self.since.split(".")[:2])
        return f"{major}.{minor + 1}"


CHANGES: dict[str, Change] = {
    "declare_call_options": Change(
        what="declaring an engine's call options with mstar_core.graph.options.declare_call_options(kind, ...)",
        instead="set `call_options` (and `node_ref_options`) on the Engine class registered for that kind",
        since="1.1"),
    "n_field_draws_n": Change(
        what="a request schema with a field 'n' but no draws_n, taken to mean the model draws n outputs itself",
        instead="declare RequestSchema(..., draws_n=True) (or rename the field if the model does not)",
        since="1.1"),
}


def _version(text: str) -> tuple[int, int]:
    major, minor = (int(p) for p in text.split(".")[:2])
    return major, minor


def changed(key: str, version: str = PLUGIN_API_VERSION, stacklevel: int = 3) -> None:
    """A plugin used changed behaviour `key`: warn within its first minor version, raise after it."""
    change = CHANGES[key]
    message = (f"{change.what} changed in plugin API {change.since} (errors from {change.errors_from}): "
               f"{change.instead}")
    if _version(version) >= _version(change.errors_from):
        raise PluginAPIError(message)
    warnings.warn(message, PluginAPIWarning, stacklevel=stacklevel)

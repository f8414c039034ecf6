"""Compatibility: `mstar_core.api.common` as plugins of the last release import it (now `requests.submit`)."""

from mstar_core.api.requests.submit import *  # noqa: F403
from mstar_core.api.requests.submit import (  # noqa: F401
    adapter_call,
    cancel_on_exit,
    first_then_rest,
    held_until,
    map_result,
    result_or_disconnect,
    sse,
    stream_error_payload,
    submit,
)

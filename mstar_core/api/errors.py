"""Compatibility: `mstar_core.api.errors` as plugins of the last release import it (now `http.errors`)."""

from mstar_core.api.http.errors import *  # noqa: F403
from mstar_core.api.http.errors import ApiError, error_body, error_response, from_request_error, retry_after  # noqa: F401

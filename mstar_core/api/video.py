"""Compatibility: `mstar_core.api.video` as plugins of the last release import it (now `media.video`)."""

from mstar_core.api.media.video import *  # noqa: F403
from mstar_core.api.media.video import VideoLimits, VideoPart, video_part  # noqa: F401

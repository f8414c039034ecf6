"""Decode and bound what requests carry: chat media (images, audio, video), uploads, tensors, and encoded audio out.

`parts` (what an adapter receives), `limits` (bounds and their environment overrides), `decode` (chat content parts
checked and decoded), `video`, `audio` (the audio encoder for replies), `resample`, `b64`, `tensors` (the native
tensor JSON). Nothing here knows a route or a model. The names below are the ones plugins import from here.
"""

from mstar_core.api.media.decode import (
    check_audio_bytes,
    check_image_bytes,
    decode_audio,
    decode_image,
    decode_messages,
    fetch_remote,
    has_media,
    url_allowed,
)
from mstar_core.api.media.limits import MediaLimits
from mstar_core.api.media.parts import AudioPart, ChatTurn, ImagePart, Part, TextPart
from mstar_core.api.media.resample import resample

__all__ = ["AudioPart", "ChatTurn", "ImagePart", "MediaLimits", "Part", "TextPart", "check_audio_bytes",
           "check_image_bytes", "decode_audio", "decode_image", "decode_messages", "fetch_remote", "has_media",
           "resample", "url_allowed"]

"""Chat content parts decoded for models: text, images (`image_url` data URIs, or allow-listed URLs) and audio
(`input_audio`, base64 WAV or MP3), each checked against limits, every refusal a 4xx naming the part
(`messages[1].content[0].image_url`).

A chat adapter receives the decoded messages as `ChatTurn`s whose `parts` keep the client's order:
`TextPart`, `ImagePart` (an RGB PIL image) and `AudioPart` (mono float32 samples and their rate).
Limits come from the adapter's `media_limits`, then the deploy file's `media:` section of the model, then the
`MSTAR_MEDIA_*` environment variables (the operator's last word); the server resolves them once at startup and a
bad value stops it there. The server never fetches a URL nobody allowed: remote images are a 400 unless their URL
starts with one of `url_prefixes`.
"""

from __future__ import annotations

import io
import urllib.parse
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from mstar_core.api.media.b64 import b64_part
from mstar_core.api.media.limits import MediaLimits
from mstar_core.api.media.parts import AudioPart, ChatTurn, ImagePart, Part, TextPart
from mstar_core.errors import RequestError

#: Content-part type on the wire -> the modality a model declares in `ApiAdapter.chat_media`.
MODALITY_OF_TYPE = {"image_url": "image", "input_audio": "audio", "video_url": "video"}
#: Image containers decoded (what Pillow reports as `Image.format`); the first frame of a GIF only if it has one.
IMAGE_FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
#: `input_audio.format` -> the containers soundfile may report for it.
AUDIO_CONTAINERS = {"wav": {"WAV", "WAVEX", "RF64"}, "mp3": {"MP3"}}
_MIN_RATE, _MAX_RATE = 1000, 384_000


def part_field(i: int, j: int, key: str) -> str:
    return f"messages[{i}].content[{j}].{key}"


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message carries a non-text part (so decoding is worth a thread)."""
    return any(isinstance(m.get("content"), list) and any(
        isinstance(p, Mapping) and p.get("type") != "text" for p in m["content"]) for m in messages)


def check_parts(messages: Sequence[Mapping[str, Any]], accepts: Collection[str], model: str,
                limits: MediaLimits) -> list[tuple[int, int, str, Mapping[str, Any]]]:
    """Every media part as (message, part, type, part) after the checks that need no decoding: known types,
    modalities the model takes, the part count, no stored-audio references."""
    found = []
    for i, message in enumerate(messages):
        if message.get("audio") is not None:
            raise RequestError(f"'messages[{i}].audio' refers to audio this server does not keep; send what was "
                               "said as the message's text content", param=f"messages[{i}].audio")
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(f"'{part_field(i, j, 'text')}' must be a string", param=part_field(i, j, "text"))
                continue
            if kind not in MODALITY_OF_TYPE:
                raise RequestError(f"content part type '{kind}' is not supported; use text, image_url or input_audio",
                                   param=part_field(i, j, "type"))
            modality = MODALITY_OF_TYPE[kind]
            if modality not in accepts:
                takes = ", ".join(["text", *sorted(accepts)])
                raise RequestError(f"model '{model}' does not accept {modality} input in chat (it takes {takes}); "
                                   f"drop '{part_field(i, j, kind)}'", param=part_field(i, j, kind))
            found.append((i, j, kind, part))
    if len(found) > limits.max_parts:
        raise RequestError(f"the messages carry {len(found)} images and audio parts; this server takes at most "
                           f"{limits.max_parts} per request", status=413, param="messages")
    return found


async def fetch_remote(messages: Sequence[Mapping[str, Any]], accepts: Collection[str], model: str,
                       limits: MediaLimits) -> dict[str, bytes]:
    """Bytes of the allow-listed remote image URLs (keyed by part field); a URL not allowed is a 400."""
    fetched: dict[str, bytes] = {}
    for i, j, kind, part in check_parts(messages, accepts, model, limits):
        if kind != "image_url":
            continue
        field = part_field(i, j, "image_url")
        url = _image_url(part, field)
        if not url.lower().startswith(("http://", "https://")):
            continue
        if not url_allowed(url, limits.url_prefixes):
            raise RequestError(f"'{field}.url' is a remote URL, which this server does not fetch; send the image "
                               "inline as a data URI (data:image/png;base64,...)", param=field)
        fetched[field] = await _fetch(url, field, limits)
    return fetched


def decode_messages(messages: Sequence[Mapping[str, Any]], accepts: Collection[str], model: str,
                    limits: MediaLimits, fetched: Mapping[str, bytes] | None = None) -> list[ChatTurn]:
    """The messages as `ChatTurn`s, media decoded and checked (blocking work: call it off the event loop)."""
    check_parts(messages, accepts, model, limits)
    fetched = fetched or {}
    turns = []
    for i, message in enumerate(messages):
        content = message.get("content")
        parts: list[Part] = []
        if isinstance(content, str):
            parts.append(TextPart(content))
        elif isinstance(content, list):
            for j, part in enumerate(content):
                kind = part["type"]
                if kind == "text":
                    parts.append(TextPart(part["text"]))
                elif kind == "image_url":
                    field = part_field(i, j, kind)
                    parts.append(_image_part(part, field, limits, fetched.get(field)))
                elif kind == "video_url":  # frames (and the audio track) decoded with PyAV: mstar_core.api.media.video
                    from mstar_core.api.media.video import video_part

                    parts.append(video_part(part, part_field(i, j, kind)))
                else:
                    parts.append(_audio_part(part, part_field(i, j, kind), limits))
        role = message.get("role")
        turns.append(ChatTurn("system" if role == "developer" else str(role), tuple(parts), message.get("name")))
    return turns


def _image_url(part: Mapping[str, Any], field: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"'{field}' must be an object with a 'url' (a data URI such as data:image/png;base64,...)",
                           param=field)
    return url


def _image_part(part: Mapping[str, Any], field: str, limits: MediaLimits, fetched: bytes | None) -> ImagePart:
    url = _image_url(part, field)
    detail = part["image_url"].get("detail") if isinstance(part["image_url"], Mapping) else None
    if detail is not None and detail not in ("auto", "low", "high"):
        raise RequestError(f"'{field}.detail' must be auto, low or high", param=field)
    if fetched is None:
        mime, raw = _data_uri(url, field, "image/", limits.max_image_bytes)
        if mime not in ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"):
            raise RequestError(f"'{field}' is {mime}; send PNG, JPEG, WebP or GIF", param=field)
    else:
        raw = fetched
    return ImagePart(decode_image(raw, field, limits), field, detail)


def check_image_bytes(raw: bytes, field: str, limits: MediaLimits) -> tuple[int, int]:
    """(width, height) of PNG/JPEG/WebP/GIF bytes read from their header and checked against `limits`.

    Nothing is decoded: a small file declaring a huge canvas (an image bomb) is a 413 in microseconds.
    Every route that takes image bytes calls this first (chat, images, edits, realtime).
    """
    from PIL import Image

    if len(raw) > limits.max_image_bytes:
        raise RequestError(f"'{field}' is {len(raw)} bytes; this server takes at most {limits.max_image_bytes} "
                           "bytes per image", status=413, param=field)
    try:
        with Image.open(io.BytesIO(raw)) as image:
            fmt, (width, height) = image.format, image.size
            frames = getattr(image, "n_frames", 1)
    except Exception as exc:  # not an image, or a header crafted to trip the parser: the input's fault
        raise RequestError(f"'{field}' could not be decoded as an image ({type(exc).__name__}: {exc})",
                           param=field) from None
    if fmt not in IMAGE_FORMATS:
        raise RequestError(f"'{field}' holds a {fmt} image; send PNG, JPEG, WebP or GIF", param=field)
    check_pixels(width, height, field, limits)
    if frames > 1:
        raise RequestError(f"'{field}' is an animation; send a single still image", param=field)
    return width, height


def check_pixels(width: int, height: int, field: str, limits: MediaLimits) -> None:
    """A 413 naming `field` when an image of width x height is over the pixel limit (images, or a video's frames)."""
    if width * height > limits.max_image_pixels:
        raise RequestError(f"'{field}' is {width}x{height} ({width * height} pixels); this server takes at most "
                           f"{limits.max_image_pixels} pixels per image", status=413, param=field)


def decode_image(raw: bytes, field: str, limits: MediaLimits) -> Any:
    """An RGB PIL image from PNG/JPEG/WebP/GIF bytes, its size checked (`check_image_bytes`) before its pixels are
    decoded (blocking work: call it off the event loop)."""
    from PIL import Image, ImageOps

    check_image_bytes(raw, field, limits)
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
        # in place, and RGB kept as it is: each copy of a 4096x4096 image is 48 MB written in the pool (two a
        # picture before, seen beside chaos_media.py's loop stalls)
        ImageOps.exif_transpose(image, in_place=True)
        return image if image.mode == "RGB" else image.convert("RGB")
    except Exception as exc:  # a decoder tripping over crafted bytes: still the input's fault
        raise RequestError(f"'{field}' could not be decoded as an image ({type(exc).__name__}: {exc})",
                           param=field) from None


def _audio_part(part: Mapping[str, Any], field: str, limits: MediaLimits) -> AudioPart:
    value = part.get("input_audio")
    if not isinstance(value, Mapping) or not isinstance(value.get("data"), str):
        raise RequestError(f"'{field}' must be an object {{data: base64 audio, format: wav}}", param=field)
    fmt = value.get("format", "wav")
    if not isinstance(fmt, str) or fmt not in AUDIO_CONTAINERS:
        raise RequestError(f"'{field}.format' is {fmt!r}; this server decodes wav or mp3", param=f"{field}.format")
    raw = b64_part(value["data"], f"{field}.data", field, limits.max_audio_bytes)
    samples, rate = decode_audio(raw, fmt, field, limits)
    return AudioPart(samples, rate, field, fmt)


def check_audio_bytes(raw: bytes, fmt: str, field: str, limits: MediaLimits) -> Any:
    """WAV/MP3 bytes' header (`soundfile.info`) checked against `limits`: container, rate, duration; nothing decoded."""
    import soundfile

    if len(raw) > limits.max_audio_bytes:
        raise RequestError(f"'{field}' is {len(raw)} bytes; this server takes at most {limits.max_audio_bytes} "
                           "bytes per audio part", status=413, param=field)
    if fmt == "mp3" and "MP3" not in soundfile.available_formats():
        raise RequestError(f"'{field}.format' mp3 cannot be decoded here (libsndfile without MP3); send wav",
                           param=f"{field}.format")
    try:
        info = soundfile.info(io.BytesIO(raw))
    except Exception as exc:  # soundfile.LibsndfileError (a RuntimeError), or whatever crafted bytes trip
        raise RequestError(f"'{field}.data' is not decodable {fmt} audio ({exc})", param=field) from None
    if info.format not in AUDIO_CONTAINERS[fmt]:
        raise RequestError(f"'{field}.data' holds {info.format} audio, not {fmt}; set 'format' to match or convert it",
                           param=field)
    if not _MIN_RATE <= info.samplerate <= _MAX_RATE:
        raise RequestError(f"'{field}' has a sample rate of {info.samplerate} Hz; send {_MIN_RATE}-{_MAX_RATE} Hz",
                           param=field)
    check_audio_seconds(info.frames / info.samplerate, field, limits)
    return info


def check_audio_seconds(seconds: float, field: str, limits: MediaLimits) -> None:
    """A 413 naming `field` when audio of this duration is over the limit (one part, or a live stream so far)."""
    if seconds > limits.max_audio_seconds:
        raise RequestError(f"'{field}' is {seconds:.1f} s long; this server takes at most {limits.max_audio_seconds:g} "
                           "s per audio part (what fits the model's context)", status=413, param=field)


def decode_audio(raw: bytes, fmt: str, field: str, limits: MediaLimits) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate from WAV/MP3 bytes, the header checked before decoding (blocking work:
    call it off the event loop)."""
    import soundfile

    check_audio_bytes(raw, fmt, field, limits)
    try:
        data, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except Exception as exc:
        raise RequestError(f"'{field}.data' is not decodable {fmt} audio ({exc})", param=field) from None
    if data.shape[0] == 0:
        raise RequestError(f"'{field}' holds no samples", param=field)
    if not np.isfinite(data).all():  # float WAV can carry NaN / Inf; a model must never see them
        raise RequestError(f"'{field}' holds non-finite samples (NaN or Inf)", param=field)
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    return np.ascontiguousarray(mono, dtype=np.float32), int(rate)


def _data_uri(url: str, field: str, kind: str, max_bytes: int) -> tuple[str, bytes]:
    """(media type, bytes) of a base64 data URI of the given kind (`image/`)."""
    head, comma, payload = url.partition(",")
    if not head.lower().startswith("data:") or not comma:
        raise RequestError(f"'{field}.url' must be a data URI (data:image/png;base64,...); other schemes are not "
                           "fetched", param=field)
    params = head[5:].split(";")
    mime = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise RequestError(f"'{field}.url' must be base64-encoded (data:{mime or 'image/png'};base64,...)", param=field)
    if not mime.startswith(kind):
        raise RequestError(f"'{field}.url' is {mime or 'untyped'} data; send an {kind}* data URI", param=field)
    return mime, b64_part(payload, f"{field}.url", field, max_bytes)


# --- remote images (only where the operator allowed them) ----------------------------------------------------


def url_allowed(url: str, prefixes: Sequence[str]) -> bool:
    """Whether `url` is under one of `prefixes`: same scheme and host:port, path below the prefix's path."""
    try:
        got = urllib.parse.urlsplit(url)
        wanted = [urllib.parse.urlsplit(p) for p in prefixes]
    except ValueError:  # e.g. a malformed IPv6 host
        return False
    if ".." in urllib.parse.unquote(got.path).split("/"):
        return False  # a server on the other side may resolve it outside the prefix
    for want in wanted:
        if (got.scheme.lower(), got.netloc.lower()) != (want.scheme.lower(), want.netloc.lower()):
            continue
        base = want.path if want.path.endswith("/") else want.path + "/"
        if got.path == want.path or got.path.startswith(base) or want.path in ("", "/"):
            return True
    return False


async def _fetch(url: str, field: str, limits: MediaLimits) -> bytes:
    import httpx

    cap = limits.max_image_bytes
    try:
        async with httpx.AsyncClient(timeout=limits.fetch_timeout, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise RequestError(f"fetching '{field}.url' answered HTTP {response.status_code}", param=field)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > cap:
                        raise RequestError(f"'{field}.url' is larger than {cap} bytes", status=413, param=field)
                return bytes(body)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        raise RequestError(f"fetching '{field}.url' failed ({type(exc).__name__})", param=field) from None

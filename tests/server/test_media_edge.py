"""Media are bounded at the edge from their headers, before anything is decoded: an image bomb on /v1/images/edits
is a 413 at once with no memory growth; audio longer than what can fit is a 413 from the WAV header."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import httpx
import numpy as np
import pytest
import soundfile

from mstar_core.api.media import MediaLimits, check_audio_bytes, check_image_bytes, decode_audio
from mstar_core.errors import RequestError


def png_bomb(side: int = 12000) -> bytes:
    """A valid 1-bit PNG of side x side black pixels: a few tens of KB declaring side^2 pixels (432 MB as RGB)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (side + 7) // 8)  # filter byte, then the packed row
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_header_checks_refuse_before_decoding():
    bomb = png_bomb()
    assert len(bomb) < 200_000
    assert check_image_bytes(png_bomb(8), "image", MediaLimits()) == (8, 8)  # Pillow's plugins load here, not timed
    t0 = time.perf_counter()
    with pytest.raises(RequestError) as err:
        check_image_bytes(bomb, "image", MediaLimits())
    assert err.value.status == 413 and err.value.param == "image" and "12000x12000" in str(err.value)
    assert time.perf_counter() - t0 < 0.1
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(1000 * 10, dtype=np.float32), 1000, format="WAV", subtype="PCM_U8")
    with pytest.raises(RequestError) as err:
        check_audio_bytes(buf.getvalue(), "wav", "audio", MediaLimits(max_audio_seconds=5.0))
    assert err.value.status == 413 and "10.0 s" in str(err.value)


def test_non_finite_float_wav_is_refused():
    buf = io.BytesIO()
    samples = np.zeros(2000, dtype=np.float32)
    samples[7] = np.nan
    soundfile.write(buf, samples, 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(RequestError, match="non-finite"):
        decode_audio(buf.getvalue(), "wav", "audio", MediaLimits())


def test_image_bomb_on_edits_is_413_at_once_without_memory_growth(server):
    bomb = base64.b64encode(png_bomb()).decode()
    body = {"model": "toy-image", "prompt": "a cat", "size": "4x4", "image": bomb}
    before = rss_kb(server.proc.pid)
    t0 = time.perf_counter()
    resp = httpx.post(f"{server.url}/v1/images/edits", json=body, headers=server.headers, timeout=60)
    took = time.perf_counter() - t0
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert err["param"] == "image" and "12000x12000" in err["message"]
    assert took < 0.5, took
    assert rss_kb(server.proc.pid) - before < 20_000  # KB: no decoded canvas was ever allocated

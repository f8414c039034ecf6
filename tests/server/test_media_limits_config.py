"""Media limits from the deploy file's `media:` section: strictly checked when the file is read, applied over the
adapter's own limits, with `MSTAR_MEDIA_*` over both; a bad environment value stops the server at startup."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from mstar_core.api.media import MediaLimits
from mstar_core.api.server.deploy import load_deploy
from mstar_core.errors import ConfigError
from tests.server.helpers import Server


def deploy(tmp_path, media: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(f"models:\n  fixture-media:\n    media: {media}\n")
    return path


def test_deploy_media_section_is_read(tmp_path):
    _, models = load_deploy(deploy(tmp_path, '{max_parts: 2, max_audio_seconds: 1, url_prefixes: ["https://a/"]}'))
    got = MediaLimits(max_parts=9).with_settings(models["fixture-media"].media, "media")
    assert (got.max_parts, got.max_audio_seconds, got.url_prefixes) == (2, 1.0, ("https://a/",))


@pytest.mark.parametrize(("media", "words"), [
    ("{max_part: 2}", "unknown key(s) ['max_part']"),
    ("{max_parts: 0}", "models.fixture-media.media.max_parts must be a positive integer"),
    ("{max_parts: true}", "media.max_parts must be a positive integer"),
    ("{max_image_bytes: 1.5}", "media.max_image_bytes must be a positive integer"),
    ("{fetch_timeout: '3'}", "media.fetch_timeout must be a positive number"),
    ("{url_prefixes: 'https://a/'}", "media.url_prefixes must be a list"),
    ("{url_prefixes: ['file:///etc/']}", "starting with http:// or https://"),
    ("[1, 2]", "media must be a mapping"),
])
def test_deploy_media_errors_name_the_key(tmp_path, media, words):
    with pytest.raises(ConfigError) as info:
        load_deploy(deploy(tmp_path, media))
    assert words in str(info.value)


@pytest.mark.parametrize(("env", "words"), [
    ({"MSTAR_MEDIA_MAX_PARTS": "four"}, "MSTAR_MEDIA_MAX_PARTS must be a positive integer"),
    ({"MSTAR_MEDIA_MAX_AUDIO_SECONDS": "-1"}, "MSTAR_MEDIA_MAX_AUDIO_SECONDS must be a positive number"),
    ({"MSTAR_MEDIA_URL_PREFIXES": "ftp://x/"}, "MSTAR_MEDIA_URL_PREFIXES must be a list of URL prefixes"),
])
def test_bad_environment_limits_are_config_errors(env, words):
    with pytest.raises(ConfigError) as info:
        MediaLimits().with_env(env)
    assert words in str(info.value)


def png_part() -> dict:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def test_served_limits_take_the_deploy_file_then_the_environment(tmp_path):
    # the adapter allows 32 parts and 4096 pixels; the deploy file lowers the parts to 2 and the pixels to 16,
    # the environment raises the pixels back to 64: 8x8 images pass, a third part does not
    srv = Server(["fixture-media"], "--config", str(deploy(tmp_path, "{max_parts: 2, max_image_pixels: 16}")),
                 api_key=None, MSTAR_MEDIA_MAX_IMAGE_PIXELS="64")
    try:
        def ask(n: int) -> httpx.Response:
            return httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
                "model": "fixture-media", "messages": [{"role": "user", "content": [png_part()] * n}]})
        assert ask(2).status_code == 200
        r = ask(3)
        assert r.status_code == 413 and "at most 2" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_a_bad_environment_limit_stops_the_server_before_loading(tmp_path):
    with pytest.raises(RuntimeError, match="MSTAR_MEDIA_MAX_PARTS must be a positive integer"):
        Server(["fixture-media"], api_key=None, MSTAR_MEDIA_MAX_PARTS="0")

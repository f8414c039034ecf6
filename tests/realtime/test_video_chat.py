"""A video_url part in /v1/chat/completions (qwen3-omni) through the official client: answered, and bounded."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.qwen_omni.test_served_video import _mp4

pytest.importorskip("openai")
pytest.importorskip("av")


def test_chat_with_a_video_part(rt_server):
    import openai

    from tests.server.helpers import API_KEY

    c = openai.OpenAI(base_url=rt_server.url + "/v1", api_key=API_KEY)
    frames = np.random.default_rng(0).integers(0, 256, (20, 64, 96, 3), dtype=np.uint8)  # 2 s at 10 fps
    url = "data:video/mp4;base64," + base64.b64encode(_mp4(frames)).decode()

    def ask(video: dict):
        return c.chat.completions.create(model="qwen3-omni", max_tokens=3, temperature=0, messages=[
            {"role": "user", "content": [{"type": "video_url", "video_url": video}, {"type": "text", "text": "What?"}]}])

    plain = ask({"url": url})
    with_audio_free = c.chat.completions.create(model="qwen3-omni", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What?"}]}])
    # 4 sampled frames -> 2 temporal patches of 4 x 6 patches -> 12 merged video tokens (+ start and end)
    assert plain.usage.prompt_tokens == with_audio_free.usage.prompt_tokens + 14
    with pytest.raises(openai.BadRequestError) as err:
        ask({"url": "data:video/mp4;base64," + base64.b64encode(b"no video").decode()})
    assert err.value.body["param"] == "messages[0].content[0].video_url"
    with pytest.raises(openai.BadRequestError) as err:
        ask({"url": url, "audio": True})  # this clip has no audio track
    assert err.value.body["param"] == "messages[0].content[0].video_url.audio"

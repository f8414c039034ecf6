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


def test_realtime_items_with_an_image_and_a_video(rt_server):
    import asyncio
    import io

    from PIL import Image

    from tests.realtime.helpers import client, until

    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(png, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    frames = np.random.default_rng(2).integers(0, 256, (20, 64, 96, 3), dtype=np.uint8)
    video = "data:video/mp4;base64," + base64.b64encode(_mp4(frames)).decode()

    async def turn(conn, content):
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": content})
        added = await until(conn, "conversation.item.added")
        await conn.response.create(response={"max_output_tokens": 2})
        return added, (await until(conn, "response.done")).response

    async def go():
        async with client(rt_server).realtime.connect(model="qwen3-omni") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "audio": {"input": {"turn_detection": None}}})
            await conn.recv()
            text = await turn(conn, [{"type": "input_text", "text": "Hi"}])
            pic = await turn(conn, [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": "?"}])
            clip = await turn(conn, [{"type": "input_video", "video_url": video}])
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_video", "video_url": "data:video/mp4;base64,AAAA"}]})
            bad = await conn.recv()
            return text, pic, clip, bad

    (_, r0), (added, r1), (vadded, r2), bad = asyncio.run(go())
    assert [c.type for c in added.item.content] == ["input_image", "input_text"]
    assert [c.type for c in vadded.item.content] == ["input_video"]
    assert r1.status in ("completed", "incomplete") and r2.status in ("completed", "incomplete")
    assert r1.usage.input_tokens > r0.usage.input_tokens + 6 and r2.usage.input_tokens > r1.usage.input_tokens + 14
    assert bad.type == "error" and bad.error.param == "item.content[0]"


def test_a_truncated_mp4_is_a_400_in_chat_and_an_error_event_in_realtime(rt_server):
    """Issue 50, item 3: a cut-off MP4 (its header whole, its frames missing) was a 500 in chat (`'NoneType' object
    has no attribute 'width'`) and closed a realtime session with 1000 and no error event."""
    import asyncio

    import openai

    from tests.realtime.helpers import client, until
    from tests.server.helpers import API_KEY

    frames = np.random.default_rng(3).integers(0, 256, (20, 64, 96, 3), dtype=np.uint8)
    whole = _mp4(frames)
    cuts = ["data:video/mp4;base64," + base64.b64encode(whole[: int(len(whole) * keep)]).decode()
            for keep in (0.3, 0.6, 0.9)]
    c = openai.OpenAI(base_url=rt_server.url + "/v1", api_key=API_KEY)
    for url in cuts:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="qwen3-omni", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]}])
        assert err.value.body["param"] == "messages[0].content[0].video_url", err.value.body

    async def go():
        errors = []
        async with client(rt_server).realtime.connect(model="qwen3-omni") as conn:
            await conn.recv()
            for url in cuts:
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_video", "video_url": url}]})
                errors.append(await conn.recv())
            # the session goes on: the next item is taken
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "still here?"}]})
            added = await until(conn, "conversation.item.added")
        return errors, added

    errors, added = asyncio.run(go())
    assert [e.type for e in errors] == ["error"] * len(cuts), errors
    assert all(e.error.param == "item.content[0]" for e in errors), errors
    assert added.item.content[0].text == "still here?"

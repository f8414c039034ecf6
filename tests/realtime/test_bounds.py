"""A realtime session's buffers bounded in bytes (issue 50, item 5, and realtime `tools`): the conversation's decoded
media and audio (oldest dropped first, one item past the bound refused), the events queued for the socket, images
refused before they decode for models that take none, and tools checked as chat's are."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

from mstar_core.api.realtime.config import tools
from mstar_core.api.realtime.conversation import Conversation, Item, item_from_client
from mstar_core.api.realtime.limits import RealtimeLimits
from mstar_core.api.realtime.protocol import ClientTooSlow, EventError, event


def _png(side: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 20, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_item(side: int) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": _png(side)}]}


def test_the_conversation_is_bounded_in_decoded_bytes():
    conv = Conversation(max_items=100, max_bytes=3 * 3 * 512 * 512 + 1000)
    for i in range(6):
        item = item_from_client({**_image_item(512), "id": f"i{i}"}, "item", 1 << 20)
        assert item.nbytes == 3 * 512 * 512  # a flat PNG of a few KB held as 768 KB of RGB
        conv.add(item)
        assert conv.nbytes <= conv.max_bytes
    assert [i.id for i in conv.items] == ["i3", "i4", "i5"]  # oldest dropped first
    with pytest.raises(EventError) as err:
        conv.add(item_from_client(_image_item(1100), "item", 1 << 20))  # 3.6 MB on its own
    assert err.value.code == "item_too_large" and len(conv.items) == 3
    conv.add(Item("a", "message", role="user", audio=np.zeros(24_000, np.int16)))
    assert conv.nbytes <= conv.max_bytes


def test_images_are_refused_before_decoding_for_models_that_take_none(monkeypatch):
    from mstar_core.api.media import decode

    monkeypatch.setattr(decode, "decode_image", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(EventError) as err:
        item_from_client(_image_item(64), "item", 1 << 20, takes_visual=False)
    assert err.value.param == "item.content[0].image_url" and "does not take images" in err.value.message


def test_queued_events_are_bounded_in_bytes():
    from mstar_core.api.realtime.session import RealtimeSession

    class Bridge:
        model, speaks, voices, default_modalities, takes_audio, takes_visual = "m", False, (), ("text",), False, False

    async def never(_payload):
        await asyncio.Event().wait()  # a socket whose peer reads nothing

    async def go():
        limits = RealtimeLimits(send_queue=1000, send_timeout=0.3, max_queued_bytes=1_000_000)
        session = RealtimeSession(None, Bridge(), limits, never)
        sender = asyncio.ensure_future(session.sender())
        with pytest.raises(ClientTooSlow):
            for _ in range(100):
                await session.emit(event("x", blob="b" * 100_000))  # 100 events of 100 KB: 10 MB unsent
        sender.cancel()
        return session

    session = asyncio.run(go())
    # what waits (queued, or the one being written) stays within the bound: 10 events of ~100 KB, not 100
    assert session.queued_bytes <= 1_000_000 and session.queue.qsize() <= 10 and session.stopped.is_set()


def test_an_event_larger_than_the_byte_bound_still_goes_alone():
    from mstar_core.api.realtime.session import RealtimeSession

    class Bridge:
        model, speaks, voices, default_modalities, takes_audio, takes_visual = "m", False, (), ("text",), False, False

    sent = []

    async def send(payload):
        sent.append(payload["type"])

    async def go():
        session = RealtimeSession(None, Bridge(), RealtimeLimits(max_queued_bytes=1000), send)
        sender = asyncio.ensure_future(session.sender())
        await session.emit(event("big", blob="b" * 5000))
        await session.emit(event("small"))
        await asyncio.sleep(0.05)
        sender.cancel()
        return session

    session = asyncio.run(go())
    assert sent == ["big", "small"] and session.queued_bytes == 0


def test_realtime_tools_are_checked_as_chats_are():
    many = [{"type": "function", "name": f"f{i}"} for i in range(20_000)]
    with pytest.raises(EventError) as err:
        tools(many, "session.tools")
    assert "at most 128" in err.value.message and err.value.param == "session.tools"
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(EventError) as err:
        tools([{"type": "function", "name": "f", "parameters": deep}], "session.tools")
    assert "nests" in err.value.message and err.value.param == "session.tools[0].parameters"
    with pytest.raises(EventError):
        tools([{"type": "function", "name": "bad name!"}], "session.tools")
    ok = tools([{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}], "t")
    assert ok[0]["name"] == "f"


def test_one_write_the_socket_never_takes_ends_the_session_though_the_queue_has_room():
    """A client that reads nothing, with little output queued: the write stuck on the full socket ends the session
    after send_timeout (before, only a full queue did, and a quiet session could hold its slot for ever)."""
    from mstar_core.api.realtime.session import RealtimeSession

    class Bridge:
        model, speaks, voices, default_modalities, takes_audio, takes_visual = "m", False, (), ("text",), False, False

    async def never(_payload):
        await asyncio.Event().wait()

    async def go():
        session = RealtimeSession(None, Bridge(), RealtimeLimits(send_timeout=0.3), never)
        sender = asyncio.ensure_future(session.sender())
        await session.emit(event("x"))
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ClientTooSlow):
            await asyncio.wait_for(sender, 5)
        return session, asyncio.get_running_loop().time() - t0

    session, took = asyncio.run(go())
    assert session.stopped.is_set() and took < 2 and session.queued_bytes == 0

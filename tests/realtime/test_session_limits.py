"""Realtime session limits through a served session (issue 50, smaller items): more tools than chat takes is an
error event naming `session.tools`, and the session goes on with its old tools."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.realtime.helpers import client

pytest.importorskip("openai")


def test_too_many_tools_are_an_error_event_and_the_session_goes_on(rt_server):
    many = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(200)]
    one = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    assert len(json.dumps(many)) < 262_144  # within the test server's event bound: refused by the tools' own

    async def go():
        async with client(rt_server).realtime.connect(model="toy-chat") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "tools": one})
            kept = await conn.recv()
            await conn.session.update(session={"type": "realtime", "tools": many})
            refused = await conn.recv()
            await conn.session.update(session={"type": "realtime", "instructions": "still here"})
            after = await conn.recv()
            return kept, refused, after

    kept, refused, after = asyncio.run(go())
    assert kept.type == "session.updated" and [t.name for t in kept.session.tools] == ["get_time"]
    assert refused.type == "error" and refused.error.param == "session.tools", refused
    assert "at most 128" in refused.error.message
    assert after.type == "session.updated" and [t.name for t in after.session.tools] == ["get_time"]

"""The Qwen3-Omni Thinker decodes under a grammar (structured outputs): tiny preset, random weights, so only what
the grammar enforces is asserted."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_thinker_json_schema(preset_cache):
    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine

    async def main():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"))
            handle = await engine.submit_async("qwen3-omni", {
                "messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 40, "temperature": 0.8,
                "seed": 2, "grammar": ["json_schema", json.dumps(SCHEMA)]})
            ids = [int(o.value) async for o in handle if o.name == "next_token"]
            env = await handle.result()
            return loaded, ids, env

    loaded, ids, env = asyncio.run(main())
    assert env["finish_reason"] == "stop"
    text = loaded.extras["tokenizer"].decode(ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)

"""The serving process of the two-host test, run inside its namespace: `python two_host_server.py OUT BIND CODEC_HOST`.

Serves tiny Orpheus with the LM here and the SNAC codec on a worker that joins from the other
namespace; writes the audio of one request, then kills the remote worker mid-request and records
how the request failed (`OUT/result.json`, `OUT/split.pt`).
"""

import asyncio
import json
import os
import signal
import sys
import time

import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover

REQUEST = {"text": "Hello from M star.", "voice": "tara", "seed": 7, "max_tokens": 120}
LONG = {"text": "Hello from M star, " * 8, "voice": "tara", "seed": 7, "max_tokens": 4000}


async def main(out: str, bind: str, codec_host: str) -> None:
    placement = Placement.from_dict({
        "workers": {"codec": {"host": codec_host, "device": "cpu"}},
        "nodes": {"snac": "codec"},
        "engine_settings": {"lm": {"num_pages": 512, "page_size": 16}},
        "control": {"bind": bind, "heartbeat_interval": 0.2},
    })
    engine = placed_engine(discover())
    result: dict = {}
    try:
        await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=placement)
        codec = engine.cluster.workers["codec"]
        result.update(encrypted=engine.cluster.encrypted, codec_pid=codec.pid, joined_from=codec.host)
        print("joined", flush=True)
        chunks = [torch.as_tensor(o.value).clone() async for o in engine.submit("orpheus", dict(REQUEST))
                  if o.name == "audio"]
        torch.save(chunks, os.path.join(out, "split.pt"))
        result["refused"] = engine.cluster.refused
        handle = engine.submit("orpheus", dict(LONG))
        async for o in handle:
            if o.name == "audio":
                break
        os.kill(codec.pid, signal.SIGKILL)  # the worker in the other namespace (one pid namespace)
        killed = time.monotonic()
        try:
            await asyncio.wait_for(handle.result(), 20)
            result["kill"] = {"failed": False}
        except Exception as exc:
            result["kill"] = {"failed": True, "type": type(exc).__name__, "status": getattr(exc, "status", None),
                              "message": str(exc)[:300], "seconds": time.monotonic() - killed}
    finally:
        await engine.close()
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))

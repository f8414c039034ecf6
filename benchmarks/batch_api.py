"""A live stream's inter-token latency while a Batch API job runs beside it, against the same stream alone.

One `mstar serve llama` (the tiny preset) runs in a thread of this process. A live client streams chat
completions one after another (`--tokens` tokens each, greedy, `RUN_TO_LENGTH`: the preset's replies end by
themselves, these run to their length) and records the
gaps between its content chunks, in three phases: alone, while a batch job runs (`/v1/files` +
`/v1/batches`, `--lines` chat lines of `--batch-tokens` tokens, the server's `batch_concurrency` lines in
flight at background priority), and alone again (the two alone phases pooled, so drift on a shared box counts
against neither side). The batch is cancelled once the live phase ends; `batch_lines_done` says how much of it
ran meanwhile (the job really ran beside the stream).

- `batch_itl_p99_ratio`: the stream's inter-token p99 with the batch running over its p99 alone (the issue's
  bar: <= 1.2). `batch_itl_p50_ratio` likewise for the median.
- `*_ms`: the p50/p99 gaps of each side; `batch_tok_s`: the batch's completion tokens per second meanwhile.

On a shared CPU box the ratio is noisy (a few runs differ by 10-20%); on CPU, ratios only.
Before measuring, a warm-up runs the same mix once (each decode batch size's first step is recorded for replay).

    python benchmarks/batch_api.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
import tempfile
import threading
import time

import numpy as np
import orjson

#: every reply runs to its max_tokens with a content chunk per token: the tiny preset ends its replies by itself,
#: and under ignore_eos alone would write <|im_end|> (id 2: no content) between its tokens
RUN_TO_LENGTH = {"ignore_eos": True, "logit_bias": {"2": -100}}


class InProcessServer:
    """`mstar serve llama` (tiny preset) in a thread of this process, its Batch API state in a temporary folder."""

    def __init__(self, concurrency: int, threads: int, preset: str, settings: dict | None = None):
        import uvicorn

        from mstar_core.api.server.app import ModelToServe, ServerConfig, create_app
        from mstar_core.api.server.launch import serving_engine
        from mstar_core.model import LoadOptions
        from mstar_core.plugins.manager import discover

        registry = discover()
        config = ServerConfig(models=[ModelToServe("llama", LoadOptions(preset=preset), settings=settings or {})],
                              state_dir=tempfile.mkdtemp(prefix="mstar-bench-batch-"),
                              batch_concurrency=concurrency, torch_threads=threads)
        self.ready = threading.Event()
        self.app = create_app(config, lambda: serving_engine(registry, config), on_ready=self.ready.set,
                              registry=registry)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not self.ready.wait(300):
            raise RuntimeError("llama did not load")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def stream_gaps(client, tokens: int, k: int) -> list[float]:
    """One streamed chat completion; the gaps (s) between its content chunks."""
    body = {"model": "llama", "messages": [{"role": "user", "content": f"Live question number {k}."}],
            "max_tokens": tokens, "stream": True, **RUN_TO_LENGTH}
    stamps: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if any(c["delta"].get("content") for c in event["choices"]):
                    stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def live_phase(client, streams: int, tokens: int) -> list[float]:
    gaps: list[float] = []
    for k in range(streams):
        gaps += await stream_gaps(client, tokens, k)
    return gaps


async def start_batch(client, lines: int, tokens: int) -> str:
    rows = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "llama", "messages": [{"role": "user", "content": f"Batch question {i}."}],
                      "max_tokens": tokens, **RUN_TO_LENGTH}} for i in range(lines)]
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    up = await client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("b.jsonl", io.BytesIO(data))})
    up.raise_for_status()
    made = await client.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"})
    made.raise_for_status()
    batch_id = made.json()["id"]
    while (await client.get(f"/v1/batches/{batch_id}")).json()["status"] == "validating":
        await asyncio.sleep(0.05)
    return batch_id


async def batch_state(client, batch_id: str) -> dict:
    return (await client.get(f"/v1/batches/{batch_id}")).json()


async def cancel(client, batch_id: str) -> None:
    await client.post(f"/v1/batches/{batch_id}/cancel")  # (a 409 when it already ended)
    while (await batch_state(client, batch_id))["status"] not in ("cancelled", "completed", "failed", "expired"):
        await asyncio.sleep(0.05)


async def measure(args) -> dict:
    import httpx

    server = InProcessServer(args.concurrency, args.threads, args.preset,
                             {"lm": json.loads(args.lm_settings)} if args.lm_settings else None)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            # warm-up: the same mix once (decode steps of every batch size recorded), then the batch cancelled
            warm = await start_batch(client, args.concurrency * 2, 8)
            await live_phase(client, 1, args.tokens)
            await cancel(client, warm)
            await live_phase(client, 1, args.tokens)

            alone = await live_phase(client, args.streams, args.tokens)
            batch_id = await start_batch(client, args.lines, args.batch_tokens)
            await asyncio.sleep(0.2)  # the batch's first lines past prefill
            t0 = time.perf_counter()
            beside = await live_phase(client, args.streams, args.tokens)
            wall = time.perf_counter() - t0
            during = await batch_state(client, batch_id)
            await cancel(client, batch_id)
            alone += await live_phase(client, args.streams, args.tokens)
    finally:
        server.stop()
    if during["status"] != "in_progress":
        raise SystemExit(f"the batch was {during['status']} before the live phase ended: raise --lines")
    a, b = np.array(alone) * 1e3, np.array(beside) * 1e3
    done = during["request_counts"]["completed"]
    return {
        "batch_itl_p99_ratio": round(float(np.percentile(b, 99) / np.percentile(a, 99)), 3),
        "batch_itl_p50_ratio": round(float(np.percentile(b, 50) / np.percentile(a, 50)), 3),
        "itl_p50_ms_alone": round(float(np.percentile(a, 50)), 2), "itl_p99_ms_alone": round(float(np.percentile(a, 99)), 2),
        "itl_p50_ms_batch": round(float(np.percentile(b, 50)), 2), "itl_p99_ms_batch": round(float(np.percentile(b, 99)), 2),
        "batch_lines_done": done, "batch_tok_s": round(done * args.batch_tokens / wall, 1),
        "gaps_alone": int(a.size), "gaps_batch": int(b.size), "batch_concurrency": args.concurrency,
        "quick": args.quick,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 streams a phase (< 60 s)")
    parser.add_argument("--streams", type=int, default=None, help="live streams per phase (default 8; quick 3)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per live stream")
    parser.add_argument("--lines", type=int, default=400, help="lines of the batch job")
    parser.add_argument("--batch-tokens", type=int, default=32, help="tokens per batch line")
    parser.add_argument("--concurrency", type=int, default=4, help="the server's batch_concurrency")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--lm-settings", default=None, metavar="JSON",
                        help='kvcache settings of the LM node, e.g. \'{"background_step_tokens": 16}\'')
    parser.add_argument("--preset", default="tiny", help="llama preset: tiny, or smollm2 (SmolLM2-135M's real weights)")
    args = parser.parse_args()
    args.streams = args.streams or (3 if args.quick else 8)
    print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main()

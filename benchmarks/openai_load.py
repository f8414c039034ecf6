"""A closed-loop asyncio client for any OpenAI completions server, and the CPU time a server's processes used.

Used by vs_vllm.py so both servers are driven by the same code: streamed `/v1/completions`, per request the
time to first token, the gaps between streamed chunks and the completion tokens the server reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import attrs
import numpy as np


@attrs.frozen
class Result:
    """One streamed request: TTFT, chunk arrival gaps (s), completion tokens and its text."""

    ttft: float
    gaps: list[float]
    tokens: int
    text: str
    latency: float


async def complete(client: Any, prompt: list[int], max_tokens: int) -> Result:
    """One streamed greedy completion of `max_tokens` tokens (EOS ignored) of a token-id prompt."""
    import httpx

    body = {"model": "llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    pieces: list[str] = []
    try:
        tokens = await _stream(client, body, stamps, pieces)
    except httpx.RemoteProtocolError:
        # "Server disconnected without sending a response": a kept-alive connection the server had closed as the
        # request went out (llama.cpp's server, now and then in its first minute). Nothing was answered, so it goes
        # once more, on a fresh connection; the time lost counts against the request (t0 stays).
        if stamps:
            raise
        tokens = await _stream(client, body, stamps, pieces)
    if not stamps:
        raise RuntimeError("the stream carried no text")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return Result(stamps[0] - t0, gaps, int(tokens if tokens is not None else len(stamps)), "".join(pieces),
                  time.perf_counter() - t0)


async def _stream(client: Any, body: dict[str, Any], stamps: list[float], pieces: list[str]) -> int | None:
    """Send `body` and read its stream: each text chunk's arrival time and text appended; the completion tokens the
    usage chunk reports (None: no usage chunk)."""
    tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    pieces.append(choice["text"])
    return tokens


async def closed_loop(client: Any, prompts: list[list[int]], concurrency: int, max_tokens: int
                      ) -> tuple[list[Result], float]:
    """Every prompt once, `concurrency` in flight (a finished request's slot takes the next prompt at once)."""
    queue = list(enumerate(prompts))
    results: list[Result | None] = [None] * len(prompts)

    async def worker() -> None:
        while queue:
            i, prompt = queue.pop(0)
            results[i] = await complete(client, prompt, max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None], time.perf_counter() - t0


def summarize(results: list[Result], wall: float) -> dict[str, float]:
    """Output tokens/s, TTFT p50/p99 and inter-chunk p50 (ms) of one load level."""
    tokens = sum(r.tokens for r in results)
    ttft = np.array([r.ttft for r in results]) * 1e3
    gaps = np.array([g for r in results for g in r.gaps] or [float("nan")]) * 1e3
    return {"tok_s": tokens / wall, "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "itl_p50_ms": float(np.nanpercentile(gaps, 50)),
            "tokens": tokens, "wall_s": wall}


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and every live descendant (vLLM's engine core is a child process)."""
    kids = _children()
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
        todo.extend(kids.get(p, []))
    return total

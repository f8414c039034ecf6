"""benchmarks/openai_load.py and vllm_side.py (vs_vllm's client and vLLM settings): what they count is what happened."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

# appended, not put first: a benchmark named after a package (benchmarks/qwen_tts.py) must not shadow it
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import vllm_side
from openai_load import closed_loop, summarize, tree_cpu_s


def _server(pieces: int, in_flight: list[int], peak: list[int]):
    """A fake streamed /v1/completions: `pieces` text chunks, then usage; it records how many requests overlap."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0

        async def stream():
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            try:
                for i in range(pieces):
                    await asyncio.sleep(0.005)
                    chunk = {"choices": [{"index": 0, "text": f"<{body['prompt'][0]}:{i}>"}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
                yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
            finally:
                in_flight[0] -= 1

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return handler


def test_closed_loop_keeps_c_in_flight_and_reports_every_request_in_prompt_order():
    in_flight, peak = [0], [0]

    async def main():
        transport = httpx.MockTransport(_server(4, in_flight, peak))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await closed_loop(client, [[i] for i in range(7)], 3, 9)

    results, wall = asyncio.run(main())
    assert peak[0] == 3 and wall > 0
    assert [r.text for r in results] == ["".join(f"<{i}:{j}>" for j in range(4)) for i in range(7)]
    assert all(r.tokens == 9 and len(r.gaps) == 3 and 0 < r.ttft <= r.latency for r in results)
    figures = summarize(results, wall)
    assert figures["tokens"] == 63 and abs(figures["tok_s"] - 63 / wall) < 1e-9


def test_tree_cpu_counts_a_child_process():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.4: pass\ntime.sleep(30)"])
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            if tree_cpu_s(child.pid) >= 0.35:
                break
            time.sleep(0.1)
        mine = tree_cpu_s(os.getpid())
        assert tree_cpu_s(child.pid) >= 0.35
        assert mine >= tree_cpu_s(child.pid)  # the parent's tree includes its child
    finally:
        child.kill()
        child.wait()


def test_vllm_cpu_settings_bind_every_core_and_preload_only_what_exists(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    env, flags = vllm_side.cpu_settings(python, cores=2, kv_gib=4, max_num_seqs=32)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_USE_AOT_COMPILE"] == "0" and flags == ["--max-num-seqs", "32"]
    assert all(Path(p).exists() for p in env.get("LD_PRELOAD", "").split(":") if p)
    cmd = vllm_side.server_command(python, "/m", 8001, "bfloat16", flags)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--dtype" in cmd and "bfloat16" in cmd


def test_a_request_the_server_dropped_unanswered_goes_once_more_and_counts_its_lost_time():
    """A connection closed with no response (httpx's RemoteProtocolError) is retried once, its TTFT from the first
    send; a second drop, or one after text arrived, still fails the request."""
    in_flight, peak = [0], [0]
    answer = _server(2, in_flight, peak)
    drops = [1]

    async def flaky(request: httpx.Request) -> httpx.Response:
        if drops[0]:
            drops[0] -= 1
            await asyncio.sleep(0.05)
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return await answer(request)

    async def main(transport):
        async with httpx.AsyncClient(transport=httpx.MockTransport(transport), base_url="http://test") as client:
            return await closed_loop(client, [[5]], 1, 4)

    results, _ = asyncio.run(main(flaky))
    assert results[0].text == "<5:0><5:1>" and results[0].ttft >= 0.05

    drops[0] = 2
    try:
        asyncio.run(main(flaky))
    except httpx.RemoteProtocolError:
        pass
    else:
        raise AssertionError("a second drop must fail the request")

"""The OpenAI Realtime session (`/v1/realtime`, the official `openai` client) against the HTTP audio chat route,
on Qwen3-Omni's tiny preset (random weights, the published structure), one server in this process.

- `first_audio_ratio_c1`: an audio turn's time from `input_audio_buffer.commit` (with `response.create` right
  after) to the first `response.output_audio.delta`, over the time from sending the same audio as a streamed
  `/v1/chat/completions` request (`modalities: ["text", "audio"]`) to its first `delta.audio.data`; same
  audio, same instructions, greedy Thinker, fresh session per turn; medians of alternating pairs, after one untimed
  turn each. The process's global generator is reseeded before each timed turn (the same seed for both turns of a
  pair), so the sampled Talker makes the same speech on both sides (`first_audio_same_speech`): first audio comes
  after min(25 frames, the speech), and speech of a random length per request made the ratio compare different work.
- `turn2_prefill_tokens` / `turn2_new_tokens`: a second text turn's Thinker rows computed (the engine's
  `tokens_forwarded` counter, less the reply tokens fed back) against the tokens turn 1 did not leave in the
  KV cache (prompt 2 minus turn 1's prompt and fed-back reply). Equal: turn 1's last, partly written page is reused.
  `turn2_after_audio_*`: the same when turn 1 is the 1 s of audio (text replies: a spoken reply's prefill
  computes every row, since the Talker reads each prompt row's accept-layer state).
- `barge_in_ms`: `input_audio_buffer.speech_started` to `response.done` (status cancelled), at the client,
  speech sent while the model speaks; `decode_step_ms`: the median gap between a text reply's deltas.
- `viability_c16`: 16 sessions at once, each an audio reply of `--viability-tokens` text tokens: the fraction
  whose playback never stalls after its first chunk, as `orpheus_streaming.py` scores streaming viability (played
  back in real time from the first chunk, however late; a chunk that arrives more than 1 ms after the audio before
  it has finished playing is a stall), the mean over `--viability-rounds` rounds. Every Code2Wav frame counts as
  the published 80 ms of audio (the tiny preset's vocoder makes fewer samples per frame than the real one).
  `viability_c16_cpu_clock` scores the same arrivals on this process's CPU time, as the Orpheus benchmark's
  `*_cpu_clock` does: other jobs on a shared box cannot stall that listener (stricter wherever the server's
  threads ran in parallel).

`--quick` measures the same things with fewer first-audio pairs and one viability round (same reply lengths,
same 16 sessions). The server runs with `--threads` torch threads (default 1: the tiny preset's ops are too small
to split, and the event loop, the clients and the device thread share the box's cores).

    python benchmarks/realtime.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import threading
import time

import numpy as np
import torch

FRAME_S = 0.08  # Qwen3-Omni's Code2Wav frame: 12.5 Hz
RATE = 24_000


def _tone(seconds: float, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    voiced = sum(np.sin(2 * np.pi * 220 * k * t) / k for k in range(1, 6))
    return (amplitude * voiced / 2.3 * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)) * 32767).astype(np.int16)


def _b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


def _wav(pcm: np.ndarray) -> str:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, pcm, RATE, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


class InProcessServer:
    """`mstar serve qwen3-omni` in a thread of this process (so the benchmark reads the engine's counters)."""

    def __init__(self):
        import uvicorn

        from mstar_core.api.server.app import ModelToServe, ServerConfig, create_app
        from mstar_core.api.server.launch import serving_engine
        from mstar_core.plugins.manager import discover

        registry = discover()
        config = ServerConfig(models=[ModelToServe("qwen3-omni")])
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
            raise RuntimeError("qwen3-omni did not load")

    @property
    def engine(self):
        return self.app.state.mstar.engine

    def forwarded(self) -> int:
        return int(self.engine.node_engines("qwen3-omni")["thinker"].tokens_forwarded)

    async def settled(self, timeout: float = 10.0) -> None:
        """Wait until no node holds a request: a cancelled turn's last steps no longer draw random numbers."""
        engines = self.engine.node_engines("qwen3-omni").values()
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            try:  # (read from this thread while the server's thread runs the engines: a torn read just retries)
                if not any(e.active_requests() or e.has_work() for e in engines):
                    return
            except RuntimeError:
                pass
            await asyncio.sleep(0.01)

    def samples_per_frame(self) -> int:
        return int(self.engine.models["qwen3-omni"].extras["config"].code2wav.samples_per_frame)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def _session(client, **session):
    conn = await client.realtime.connect(model="qwen3-omni").enter()
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session={"type": "realtime", "temperature": 0, **session})
    ev = await conn.recv()
    assert ev.type == "session.updated", ev
    return conn


async def _until(conn, kind: str, seen: list | None = None):
    async for ev in conn:
        if seen is not None:
            seen.append((time.perf_counter(), ev))
        if ev.type == kind:
            return ev
        if ev.type == "error":
            raise RuntimeError(ev.error)
    raise RuntimeError(f"closed before {kind}")


INSTRUCTIONS = "You are Qwen, a virtual human."


async def realtime_first_audio(client, audio: np.ndarray, max_tokens: int) -> tuple[float, int]:
    conn = await _session(client, instructions=INSTRUCTIONS, max_output_tokens=max_tokens,
                          audio={"input": {"turn_detection": None}})
    try:
        await conn.input_audio_buffer.append(audio=_b64(audio))
        t0 = time.perf_counter()
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        delta = await _until(conn, "response.output_audio.delta")
        first = time.perf_counter() - t0
        await conn.response.cancel()
        await _until(conn, "response.done")
        return first, len(base64.b64decode(delta.delta)) // 2
    finally:
        await conn.close()


async def http_first_audio(http, audio: np.ndarray, max_tokens: int, voice: str) -> tuple[float, int]:
    body = {"model": "qwen3-omni", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": voice, "format": "pcm16"},
            "messages": [{"role": "system", "content": INSTRUCTIONS},
                         {"role": "user", "content": [{"type": "input_audio",
                                                       "input_audio": {"data": _wav(audio), "format": "wav"}}]}]}
    t0 = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                if (delta.get("audio") or {}).get("data"):
                    return time.perf_counter() - t0, len(base64.b64decode(delta["audio"]["data"])) // 2
    raise RuntimeError("the HTTP reply had no audio")


async def second_turn(client, srv: InProcessServer, audio: np.ndarray | None = None) -> dict:
    """Turn 2's Thinker rows against its new tokens; with `audio`, turn 1 is that audio (a text reply both times)."""
    conn = await _session(client, output_modalities=["text"], audio={"input": {"turn_detection": None}})
    figures = []
    try:
        for i, text in enumerate(("Hello there, how are you today?", "And what about tomorrow?")):
            if i == 0 and audio is not None:
                await conn.input_audio_buffer.append(audio=_b64(audio))
                await conn.input_audio_buffer.commit()
            else:
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
            before = srv.forwarded()
            await conn.response.create(response={"max_output_tokens": 6})
            done = await _until(conn, "response.done")
            figures.append((done.response.usage, srv.forwarded() - before))
    finally:
        await conn.close()
    (u1, _), (u2, fwd2) = figures
    cached = u1.input_tokens + u1.output_token_details.text_tokens - 1  # the last sampled token is never fed back
    name = "turn2_after_audio" if audio is not None else "turn2"
    return {f"{name}_prefill_tokens": fwd2 - (u2.output_token_details.text_tokens - 1),
            f"{name}_new_tokens": u2.input_tokens - cached, f"{name}_prompt_tokens": u2.input_tokens}


async def barge_in(client) -> dict:
    conn = await _session(client, instructions=INSTRUCTIONS, audio={"input": {"turn_detection": {
        "type": "server_vad", "silence_duration_ms": 500, "create_response": False}}})
    try:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Tell me a long story."}]})
        await conn.response.create(response={"max_output_tokens": 64})
        await _until(conn, "response.output_audio.delta")
        await conn.input_audio_buffer.append(audio=_b64(_tone(0.3)))
        seen: list = []
        await _until(conn, "input_audio_buffer.speech_started", seen)
        t0 = time.perf_counter()
        done = await _until(conn, "response.done", seen)
        assert done.response.status == "cancelled", done.response.status
        return {"barge_in_ms": round((time.perf_counter() - t0) * 1000, 1)}
    finally:
        await conn.close()


async def decode_step(client) -> float:
    conn = await _session(client, output_modalities=["text"], audio={"input": {"turn_detection": None}})
    try:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Count to twenty."}]})
        await conn.response.create(response={"max_output_tokens": 16})
        seen: list = []
        await _until(conn, "response.done", seen)
        times = [t for t, ev in seen if ev.type == "response.output_text.delta"]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return round(statistics.median(gaps) * 1000, 2) if gaps else float("nan")
    finally:
        await conn.close()


def _stalls(arrivals: list[tuple[float, float]]) -> int:
    """Playback from the first chunk in real time: how often it runs dry (chunks as (arrival, seconds))."""
    stalls, until = 0, None
    for now, seconds in arrivals:
        if until is None:
            until = now
        elif now > until + 1e-3:
            stalls += 1
            until = now
        until = max(until, now) + seconds
    return stalls


async def viability(client, sessions: int, max_tokens: int, samples_per_frame: int) -> dict:
    """One round: `sessions` sessions at once, each an audio reply; (wall, cpu) fractions that never stall."""

    async def one(i: int) -> list[tuple[float, float, float]]:
        conn = await _session(client, audio={"input": {"turn_detection": None}})
        try:
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": f"Say something about the number {i}."}]})
            await conn.response.create(response={"max_output_tokens": max_tokens})
            chunks = []  # (wall, process CPU, seconds of audio) per delta
            async for ev in conn:
                if ev.type == "response.output_audio.delta":
                    seconds = len(base64.b64decode(ev.delta)) // 2 / samples_per_frame * FRAME_S
                    chunks.append((time.perf_counter(), time.process_time(), seconds))
                elif ev.type == "response.done":
                    return chunks
                elif ev.type == "error":
                    raise RuntimeError(ev.error)
            raise RuntimeError("closed before response.done")
        finally:
            await conn.close()

    traces = [t for t in await asyncio.gather(*(one(i) for i in range(sessions))) if t]
    scores = {clock: sum(_stalls([(c[k], c[2]) for c in t]) == 0 for t in traces) / max(1, len(traces))
              for k, clock in enumerate(("wall", "cpu"))}
    return {**scores, "spoke": len(traces), "audio_s": sum(c[2] for t in traces for c in t)}


async def viability_rounds(client, args, samples_per_frame: int) -> dict:
    n = args.sessions
    rounds = []
    for _ in range(args.viability_rounds):
        c0 = time.process_time()
        rounds.append(await viability(client, n, args.viability_tokens, samples_per_frame))
        rounds[-1]["cpu_s"] = time.process_time() - c0
    return {f"viability_c{n}": round(statistics.mean(r["wall"] for r in rounds), 3),
            f"viability_c{n}_cpu_clock": round(statistics.mean(r["cpu"] for r in rounds), 3),
            f"viability_c{n}_rounds": [round(r["wall"], 3) for r in rounds],
            f"sessions_with_audio_c{n}": min(r["spoke"] for r in rounds),
            f"audio_s_per_cpu_s_c{n}": round(sum(r["audio_s"] for r in rounds) / sum(r["cpu_s"] for r in rounds), 2)}


async def main(args) -> dict:
    import httpx
    from openai import AsyncOpenAI

    load = os.getloadavg()[0]
    srv = InProcessServer()
    try:
        client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="none")
        voice = (await (await client.realtime.connect(model="qwen3-omni").enter()).recv()).session.audio.output.voice
        audio = _tone(1.0)
        rt, hp = [], []
        chunks = {"rt": [], "http": []}
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as http:
            # one untimed turn each: the first request of a process records replays and fills caches
            await realtime_first_audio(client, audio, args.max_tokens)
            await http_first_audio(http, audio, args.max_tokens, voice)
            for i in range(args.pairs):  # alternating order, so a load change on the box hits both sides
                sides = [(rt, "rt", lambda: realtime_first_audio(client, audio, args.max_tokens)),
                         (hp, "http", lambda: http_first_audio(http, audio, args.max_tokens, voice))]
                for times, side, measure in (sides if i % 2 == 0 else sides[::-1]):
                    # The Talker samples (temperature 0.9) from the process's global generator: without this, each
                    # side's speech has its own random length, and first audio comes after min(25 frames, the
                    # speech), so the two sides timed different amounts of work (see BENCHMARKS.md, issue 53)
                    await srv.settled()
                    torch.manual_seed(1000 + i)
                    seconds, samples = await measure()
                    times.append(seconds)
                    chunks[side].append(samples)
        out = {"first_audio_ratio_c1": round(statistics.median(rt) / statistics.median(hp), 3),
               "first_audio_realtime_s": round(statistics.median(rt), 3),
               "first_audio_http_s": round(statistics.median(hp), 3),
               # the first chunk's samples per pair: equal on both sides when both made the same speech
               "first_audio_same_speech": chunks["rt"] == chunks["http"]}
        out.update(await second_turn(client, srv))
        out.update(await second_turn(client, srv, audio))
        out.update(await barge_in(client))
        out["decode_step_ms"] = await decode_step(client)
        out.update(await viability_rounds(client, args, srv.samples_per_frame()))
        out["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        out["torch_threads"] = torch.get_num_threads()
        return out
    finally:
        srv.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer first-audio pairs and one viability round (< 60 s)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--viability-tokens", type=int, default=6)
    parser.add_argument("--viability-rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (both routes)")
    args = parser.parse_args()
    if args.quick:  # the same measurements, fewer repeats
        args.pairs, args.viability_rounds = 2, 1
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MSTAR_REALTIME_VAD", "energy")  # the synthetic speech here is a tone
    t0 = time.perf_counter()
    result = asyncio.run(main(args))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))

"""A voice agent composed in M* (Whisper -> llama -> Qwen3-TTS as one Walk Graph, one request per turn, over the
realtime socket) against the same three models served by M* servers and chained by a client over HTTP, the way
voice agents are built today (transcriptions -> streamed chat completion -> speech per sentence, as Pipecat and
LiveKit chain an ASR, an LLM and a TTS service). Tiny presets (random weights, the published structures), the same
run, the same bounds on both sides (reply `--max-tokens`, each spoken piece `--frames` frames: `ignore_eos`, so a
random Talker's early stop does not end a piece within a few frames, and a barge-in finds the agent still speaking;
the same sentence/clause/word-count chunking: `TextChunker` on the client, `TextChunkPolicy` in the graph).

- `first_audio_ms_c1`: from the end of the user's speech (the composed side: the server VAD's
  `input_audio_buffer.speech_stopped`; the chained side: the moment its client has the whole turn, which is when it
  posts the transcription) to the first audio bytes of the reply; median over `--runs` turns after one untimed turn
  each. `first_audio_ratio_c1`: composed over chained (target <= 0.6). The composed client streams its turn as a
  microphone does (in real time, 20 ms at a time); the server starts the reply preemptively at a pause (100 ms of
  silence) and releases it at the stop, 400 ms later, when the stop commits the same samples (the chain, as
  clients chain servers, starts at the turn's end).
- `audio_per_second_c8`: seconds of reply audio delivered per wall second with 8 turns at once (both sides; wall
  from the first turn's end of speech to the last reply's end).
- `viability_c8`: the share of those 8 composed turns whose playback never runs dry once started (played in real time
  from the first chunk; a chunk arriving more than 1 ms after the audio before it ended is a stall). Target >= 0.95.
- `barge_in_ms`: speech sent while the agent speaks: `input_audio_buffer.speech_started` to `response.done`
  (cancelled: ASR, LLM and TTS stopped, the reply truncated at the audio sent), at the client (OpenAI's measure: the
  cancel is synchronous with the detection, so this is sub-millisecond); `barge_in_from_audio_ms` counts from sending
  the interrupting audio (the VAD's detection included). `tts_step_ms` is the
  TTS's time per 25-frame window measured in the same run (target: barge-in <= one step + 50 ms).

`--quick` (about a minute on a loaded 2-core box) runs the chained side against the composed server's own standalone
routes (the same three models, one process: `chained_servers` says 1) and fewer turns; the full run starts three
servers for the chain. Timings on a small shared CPU box are noisy: read them as such.

    python benchmarks/voice_agent.py --quick
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
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RATE = 24_000
VAD = {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 500, "prefix_padding_ms": 200,
       "create_response": True, "interrupt_response": True}
KEY = "bench-key"


# -- servers --------------------------------------------------------------------------------------------------


class Server:
    """`mstar serve` in a process of its own on a free port."""

    def __init__(self, args: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        env = {**os.environ, "MSTAR_REALTIME_VAD": "energy", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "mstar_core.cli", "serve", *args, "--port", str(self.port),
                                      "--api-key", KEY, "--log-level", "warning", "--torch-threads", "1"],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait(self, timeout: float = 240) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def deploy_file(directory: Path, frames: int) -> Path:
    path = directory / "voice-agent-bench.yaml"
    path.write_text(
        "models:\n  whisper: {preset: tiny}\n  llama: {preset: tiny}\n  qwen3-tts: {preset: tiny}\n"
        "  agent: {compose: voice_agent, asr: whisper, llm: llama, tts: qwen3-tts,\n"
        f"          options: {{speech_options: {{max_frames: {frames}, ignore_eos: true}}}}}}\n")
    return path


# -- audio ----------------------------------------------------------------------------------------------------


def spoken_turn() -> np.ndarray:
    from tests.voice_agent.speech import speech

    return speech("Hello there. What is the weather like today?")


def silence(seconds: float) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(int(seconds * RATE)) * 16).astype(np.int16)


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


def wav_bytes(pcm: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def stalls(arrivals: list[tuple[float, float]]) -> int:
    """Playback from the first chunk in real time: how often it runs dry (chunks as (arrival, seconds))."""
    count, until = 0, None
    for now, seconds in arrivals:
        if until is None:
            until = now
        elif now > until + 1e-3:
            count += 1
            until = now
        until = max(until, now) + seconds
    return count


# -- the composed agent over the realtime socket ----------------------------------------------------------------


async def composed_turn(srv: Server, turn: np.ndarray, max_tokens: int) -> dict:
    """One spoken turn: (VAD stop -> first audio seconds, audio chunks as (arrival, seconds))."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY)
    async with client.realtime.connect(model="agent") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "max_output_tokens": max_tokens, "audio": {"input": {"turn_detection": VAD}}})
        await conn.recv()
        # the turn as a microphone sends it: in real time, 20 ms at a time, while the events are read
        speaking = asyncio.ensure_future(send_live(conn, np.concatenate([silence(0.2), turn, silence(0.6)])))
        stop_at, arrivals = None, []
        async for ev in conn:
            now = time.perf_counter()
            if ev.type == "input_audio_buffer.speech_stopped" and stop_at is None:
                stop_at = now
            elif ev.type == "response.output_audio.delta":
                arrivals.append((now, len(base64.b64decode(ev.delta)) / 2 / RATE))
            elif ev.type == "response.done":
                break
            elif ev.type == "error":
                raise RuntimeError(ev.error)
        await speaking
    return {"first": arrivals[0][0] - stop_at if arrivals and stop_at else None, "arrivals": arrivals, "end": now,
            "start": stop_at}


async def send_live(conn, pcm: np.ndarray, step_s: float = 0.02) -> None:
    """`pcm` appended in real time, `step_s` at a time (on schedule: a late append does not shift the rest)."""
    step, t0 = int(step_s * RATE), time.perf_counter()
    for k, at in enumerate(range(0, pcm.size, step)):
        await conn.input_audio_buffer.append(audio=b64(pcm[at:at + step]))
        await asyncio.sleep(max(0.0, t0 + (k + 1) * step_s - time.perf_counter()))


async def barge_in(srv: Server, turn: np.ndarray, attempts: int = 3) -> tuple[float, float]:
    """(speech_started -> response.done ms, interrupting audio sent -> response.done ms) of the first of `attempts`
    turns whose reply is still going when the interruption is detected (random weights may end a reply within
    milliseconds of its first audio; a reply started at a pause may be whole when the stop releases it)."""
    for _ in range(attempts):
        got = await barge_in_once(srv, turn)
        if got[0] == got[0]:
            return got
    return float("nan"), float("nan")


async def barge_in_once(srv: Server, turn: np.ndarray) -> tuple[float, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY)
    async with client.realtime.connect(model="agent") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"], "max_output_tokens": 400,
                                           "audio": {"input": {"turn_detection": VAD}}})
        await conn.recv()
        for chunk in (silence(0.2), turn, silence(0.5)):
            await conn.input_audio_buffer.append(audio=b64(chunk))
        started, sent = None, None
        async for ev in conn:
            if ev.type == "response.output_audio.delta" and started is None:
                started = -1.0
                sent = time.perf_counter()
                await conn.input_audio_buffer.append(audio=b64(turn))
            elif ev.type == "input_audio_buffer.speech_started" and started == -1.0:
                started = time.perf_counter()
            elif ev.type == "response.done":
                if ev.response.status != "cancelled" or not started or started < 0:  # ended before the barge-in
                    return float("nan"), float("nan")
                now = time.perf_counter()
                return (now - started) * 1000, (now - sent) * 1000


# -- the chained servers ----------------------------------------------------------------------------------------


async def chained_turn(asr: Server, llm: Server, tts: Server, turn: np.ndarray, max_tokens: int, frames: int) -> dict:
    """The client chain: transcribe the whole turn, stream the chat reply, speak each cut piece in order."""
    import httpx

    from mstar_core.streaming.text_chunks import TextChunker

    headers = {"Authorization": f"Bearer {KEY}"}
    arrivals: list[tuple[float, float]] = []
    async with httpx.AsyncClient(timeout=120, headers=headers) as http:
        start = time.perf_counter()  # the turn is over: the client has all of it
        # streamed: one greedy decode, as the agent's ASR runs (a plain request retries hotter decodes of a window
        # that fails Whisper's thresholds, which random weights always do)
        text = ""
        async with http.stream("POST", asr.url + "/v1/audio/transcriptions", data={"model": "whisper", "stream": "true"},
                               files={"file": ("turn.wav", wav_bytes(turn), "audio/wav")}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and '"transcript.text.done"' in line:
                    text = json.loads(line[6:])["text"]
        pieces: asyncio.Queue = asyncio.Queue()

        async def speak() -> None:
            while (piece := await pieces.get()) is not None:
                body = {"model": "qwen3-tts", "input": piece, "voice": None, "response_format": "pcm",
                        "max_frames": frames, "ignore_eos": True}
                body = {k: v for k, v in body.items() if v is not None}
                async with http.stream("POST", tts.url + "/v1/audio/speech", json=body) as resp:
                    resp.raise_for_status()
                    async for data in resp.aiter_bytes():
                        if data:
                            arrivals.append((time.perf_counter(), len(data) / 2 / RATE))

        speaker = asyncio.ensure_future(speak())
        chunker = TextChunker()
        body = {"model": "llama", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "stream": True}
        async with http.stream("POST", llm.url + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                for piece in chunker.push(delta):
                    if piece.strip():
                        await pieces.put(piece.strip())
        for piece in chunker.flush():
            if piece.strip():
                await pieces.put(piece.strip())
        await pieces.put(None)
        await speaker
    return {"first": arrivals[0][0] - start if arrivals else None, "arrivals": arrivals, "start": start,
            "end": time.perf_counter()}


# -- the run ----------------------------------------------------------------------------------------------------


async def concurrent(make, n: int) -> dict:
    turns = await asyncio.gather(*(make() for _ in range(n)))
    # from the first turn's end of speech to the last reply's end (a composed turn's speaking time is not counted)
    wall = max(t["end"] for t in turns) - min(t["start"] for t in turns if t["start"] is not None)
    audio = sum(s for t in turns for _, s in t["arrivals"])
    spoken = [t for t in turns if t["arrivals"]]
    return {"audio_per_second": audio / wall, "viability": sum(stalls(t["arrivals"]) == 0 for t in spoken) /
            max(1, len(spoken)), "first_ms": statistics.median(1000 * t["first"] for t in spoken) if spoken else None}


def tts_step_ms(srv: Server, frames: int) -> float:
    """The TTS's time to its first 25-frame window alone (a streamed /v1/audio/speech: first bytes; 26 frames, EOS
    ignored, so the window is whole)."""
    import httpx

    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            with http.stream("POST", srv.url + "/v1/audio/speech", json={
                    "model": "qwen3-tts", "input": "Hello there.", "response_format": "pcm", "max_frames": 26,
                    "ignore_eos": True}) as resp:
                for data in resp.iter_bytes():
                    if data:
                        times.append(time.perf_counter() - t0)
                        break
        return 1000 * min(times)


def phase(name: str, t0: list[float]) -> None:
    now = time.perf_counter()
    print(f"[{now - t0[0]:6.1f}s] {name}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=None, help="timed turns a side at c=1 (default 5, --quick 2)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--frames", type=int, default=48)
    args = parser.parse_args()
    runs = args.runs or (2 if args.quick else 5)
    clock = [time.perf_counter()]
    turn = spoken_turn()
    with tempfile.TemporaryDirectory() as tmp:
        agent = Server(["--config", str(deploy_file(Path(tmp), args.frames))])
        chain = [] if args.quick else [Server([m, "--preset", "tiny"]) for m in ("whisper", "llama", "qwen3-tts")]
        try:
            agent.wait()
            for srv in chain:
                srv.wait()
            asr, llm, tts = chain or (agent, agent, agent)
            phase("servers ready", clock)
            fields = {"max_tokens": args.max_tokens}

            async def run() -> dict:
                await composed_turn(agent, turn, **fields)  # untimed: first calls of every node
                await chained_turn(asr, llm, tts, turn, frames=args.frames, **fields)
                phase("warmed up", clock)
                composed, chained = [], []
                for _ in range(runs):  # alternating pairs
                    composed.append((await composed_turn(agent, turn, **fields))["first"])
                    chained.append((await chained_turn(asr, llm, tts, turn, frames=args.frames, **fields))["first"])
                phase("c=1 pairs", clock)
                c8 = await concurrent(lambda: composed_turn(agent, turn, **fields), args.concurrency)
                c8_chain = await concurrent(lambda: chained_turn(asr, llm, tts, turn, frames=args.frames, **fields),
                                            args.concurrency)
                phase(f"c={args.concurrency} both sides", clock)
                barges = [await barge_in(agent, turn) for _ in range(1 if args.quick else 3)]
                phase("barge-in", clock)
                return {"composed": composed, "chained": chained, "c8": c8, "c8_chain": c8_chain, "barges": barges}

            out = asyncio.run(run())
            step = tts_step_ms(tts, args.frames)
        finally:
            agent.stop()
            for srv in chain:
                srv.stop()
    composed = statistics.median(x for x in out["composed"] if x is not None) * 1000
    chained = statistics.median(x for x in out["chained"] if x is not None) * 1000
    barges = [b for b in out["barges"] if b[0] == b[0]]
    result = {
        "first_audio_ratio_c1": round(composed / chained, 3),
        "first_audio_ms_c1": round(composed, 1),
        "first_audio_ms_c1_chained": round(chained, 1),
        "audio_per_second_c8": round(out["c8"]["audio_per_second"], 3),
        "audio_per_second_c8_chained": round(out["c8_chain"]["audio_per_second"], 3),
        "viability_c8": round(out["c8"]["viability"], 3),
        "viability_c8_chained": round(out["c8_chain"]["viability"], 3),
        "first_audio_ms_c8": out["c8"]["first_ms"] and round(out["c8"]["first_ms"], 1),
        "first_audio_ms_c8_chained": out["c8_chain"]["first_ms"] and round(out["c8_chain"]["first_ms"], 1),
        "barge_in_ms": round(statistics.median(b[0] for b in barges), 2) if barges else None,
        "barge_in_from_audio_ms": round(statistics.median(b[1] for b in barges), 1) if barges else None,
        "tts_step_ms": round(step, 1),
        "concurrency": args.concurrency, "runs": runs, "max_tokens": args.max_tokens, "frames": args.frames,
        "chained_servers": len(chain) or 1, "quick": args.quick,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

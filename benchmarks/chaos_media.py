"""Media and large-input stress (issue 50, items 3-8) beside healthy traffic, on its own tiny `llama` + `qwen3-omni`
server (one realtime session at most, so a slot held shows at once).

While a healthy loop posts small llama chats and `GET /health` is polled every 50 ms (from a process of its own,
chaos_driver.HealthProbe: this script's loop serializes megabytes meanwhile), the stress sends, one after
another: a 12 MB tool description, a 12 MB completions prompt, Responses with 7 MB of instructions and with
oversized metadata, 60 s of 48 kHz WAV and 300 s of 48 kHz FLAC to transcriptions, a damaged MP4 and a 2-frame
video 119 s long in chat `video_url` parts, and in a realtime session 7 MB of instructions with a response, a
119 s append under server VAD, twenty flat 4096x4096 PNG items and twenty thousand tools. Then a client that never
reads holds the one realtime slot. Figures:
  * `media_stress_health_max_s`: the slowest /health answer while the stress ran (target <= 0.1);
  * `media_stress_5xx`: answers >= 500 to the stress or the healthy loop (target 0); realtime: sessions closed
    without an error event count too;
  * `media_healthy_failed`: healthy requests that did not get a 200;
  * `media_rss_growth_mb`: the serving process' RSS 3 s after the stress ended, over its RSS after a warm-up
    (`stresses` holds each HTTP stress's status, seconds, slowest /health meanwhile, RSS after it and loop stalls);
  * `silent_client_freed_s`: from a silent client's first event to a new session taking the one slot (target <= 30);
    the client is a raw socket that never reads (a client library keeps reading into its own memory).
  * `baseline_health_max_s`: the slowest /health over 3 s of the healthy loop alone, before the stress (this box's
    load: the figures above are noisy beside it);
  * `media_loop_*_max_ms` and each stress's `loop_stalls`: every stall of the server's event loop past 50 ms, its
    cause and where the loop was (the server runs with MSTAR_LOOP_WATCH_MS=50, mstar_core/api/server/loop_watch.py):
    `computing` (the loop thread ran: its frames are the culprit) and `gil` (the server's other threads held the
    interpreter) are the server's own; `no-cpu` (the process got little of a core) is the machine's load. On a
    loaded box that split is the honest evidence where /health's wall time is noise.

    python benchmarks/chaos_media.py --quick     (the grammar stress of chaos_grammar.py first, then this one; a
                                                  summary of every stress's /health max and loop stalls at the end)
    python benchmarks/chaos_media.py --quick --media-only
(chaos.py runs both among its stresses.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import socket
import time
from typing import Any

import httpx
import numpy as np
from chaos_driver import HealthProbe, Server, rss_mb, stall_figures
from chaos_grammar import grammar_stress

ASK = [{"role": "user", "content": "Hi"}]
BIG = "word " * (12_000_000 // 5)


#: The server's loop watch (mstar_core/api/server/loop_watch.py): each stall of its event loop past this is logged.
LOOP_WATCH, STALL_MS = "MSTAR_LOOP_WATCH_MS", "50"


def stalls_since(server: Server, logged: int) -> list[str]:
    """Each loop stall the server logged since its log was `logged` characters long: 'N ms cause: where'."""
    return [f"{ms} ms {cause}: {where[:1500]}" for ms, cause, where in server.loop_stalls(logged)]


def _worst_between(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    during = [s for at, s in samples if t0 <= at + s and at <= t1]
    return round(max(during), 3) if during else None


async def _healthy(client: httpx.AsyncClient, stop: asyncio.Event, codes: list[int]) -> None:
    while not stop.is_set():
        try:
            r = await client.post("/v1/chat/completions", json={"model": "llama", "messages": ASK, "max_tokens": 4})
            codes.append(r.status_code)
        except httpx.HTTPError:
            codes.append(0)
        await asyncio.sleep(0.1)


def _audio(seconds: float, rate: int, fmt: str) -> bytes:
    import soundfile

    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    buf = io.BytesIO()
    soundfile.write(buf, 0.01 * np.sin(2 * np.pi * 220 * t), rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def _mp4(frames: np.ndarray, pts: list[int] | None = None) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        video = c.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            if pts is not None:
                frame.pts = pts[i]
            for p in video.encode(frame):
                c.mux(p)
        for p in video.encode():
            c.mux(p)
    return buf.getvalue()


def _video_chat(raw: bytes) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    return {"model": "qwen3-omni", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]}]}


def _png(side: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 20, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def http_stresses() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, route, body or {"files": ..., "data": ...}) of each HTTP stress."""
    moving = np.random.default_rng(0).integers(0, 256, (12, 96, 128, 3), dtype=np.uint8)
    damaged = bytearray(_mp4(moving))
    for at in range(len(damaged) // 3, len(damaged), 97):
        damaged[at] ^= 0xFF
    sparse = _mp4(np.zeros((2, 480, 640, 3), np.uint8), pts=[0, 1190])
    return [
        ("tool_description_12mb", "/v1/chat/completions", {"model": "llama", "messages": ASK, "max_tokens": 4, "tools": [
            {"type": "function", "function": {"name": "f", "description": BIG, "parameters": {"type": "object"}}}]}),
        ("completions_prompt_12mb", "/v1/completions", {"model": "llama", "prompt": BIG, "max_tokens": 4}),
        ("responses_instructions_7mb", "/v1/responses", {"model": "llama", "input": "hi", "instructions": BIG[:7_000_000],
                                                        "max_output_tokens": 4}),
        ("responses_metadata_14mb", "/v1/responses", {"model": "llama", "input": "hi", "max_output_tokens": 4,
                                                     "metadata": {"m": BIG[:14_000_000 // 2]}}),
        ("responses_text_format_string", "/v1/responses", {"model": "llama", "input": "hi", "text": {
            "format": "json_schema"}}),
        ("transcription_wav_60s_48k", "/v1/audio/transcriptions",
         {"files": {"file": ("a.wav", _audio(60, 48_000, "WAV"), "audio/wav")}, "data": {"model": "qwen3-omni"}}),
        ("transcription_flac_300s_48k", "/v1/audio/transcriptions",
         {"files": {"file": ("a.flac", _audio(300, 48_000, "FLAC"), "audio/flac")}, "data": {"model": "qwen3-omni"}}),
        ("video_damaged_mp4", "/v1/chat/completions", _video_chat(bytes(damaged))),
        ("video_two_frames_119s", "/v1/chat/completions", _video_chat(sparse)),
    ]


async def _post(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> int:
    try:
        if "files" in body:
            r = await client.post(route, files=body["files"], data=body["data"])
        else:  # serialized off this loop: the healthy loop's timings are not held by megabytes of json.dumps
            content = await asyncio.to_thread(json.dumps, body)
            r = await client.post(route, content=content, headers={"content-type": "application/json"})
        return r.status_code
    except httpx.HTTPError:
        return 0


async def warm_realtime(url: str) -> None:
    """A short realtime turn on qwen3-omni: 2 s of audio under server VAD with a response, and a small image."""
    from websockets.asyncio.client import connect

    pcm = (np.sin(np.arange(2 * 24_000) / 24_000 * 2 * np.pi * 220) * 8000).astype(np.int16).tobytes()
    async with await _session(connect, url.replace("http", "ws") + "/v1/realtime?model=qwen3-omni") as ws:
        for ev in ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                        {"type": "input_image", "image_url": _png(256)}]}},
                   {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()},
                   {"type": "input_audio_buffer.commit"},
                   {"type": "response.create", "response": {"output_modalities": ["text"]}}):
            await ws.send(json.dumps(ev))
        with contextlib.suppress(TimeoutError):
            while json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] != "response.done":
                pass


async def _session(connect: Any, ws_url: str, limit: float = 30.0) -> Any:
    """A connection whose session was created (the one slot may still be held by the last stress's session for a
    moment after its socket closed: a 1013 is retried)."""
    deadline = time.monotonic() + limit
    while True:
        ws = await connect(ws_url, max_size=None)
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if first["type"] == "session.created" or time.monotonic() > deadline:
            return ws
        await ws.close()
        await asyncio.sleep(0.5)


async def realtime_stresses(server: Server) -> dict[str, Any]:
    """One qwen3-omni session at a time, each stress's events, then every event read until the reply ends (or 5 s
    pass without one); an `error` event is a clean refusal, a close without one a failure (counted as a 5xx)."""
    from websockets.asyncio.client import connect

    ws_url = server.url.replace("http", "ws") + "/v1/realtime?model=qwen3-omni"
    pcm = (np.sin(np.arange(119 * 24_000) / 24_000 * 2 * np.pi * 220) * 8000).astype(np.int16).tobytes()
    image = _png(4096)
    plans = {
        "instructions_7mb": [{"type": "session.update", "session": {"instructions": BIG[:7_000_000]}},
                             {"type": "response.create", "response": {"output_modalities": ["text"]}}],
        "append_119s_vad": [{"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()},
                            {"type": "input_audio_buffer.commit"},
                            {"type": "response.create", "response": {"output_modalities": ["text"]}}],
        "images_20x4096": [{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": image}]}} for _ in range(20)],
        "tools_20000": [{"type": "session.update", "session": {"tools": [
            {"type": "function", "name": f"f{i}"} for i in range(20_000)]}}],
    }
    texts = await asyncio.to_thread(lambda: {name: [json.dumps(ev) for ev in evs] for name, evs in plans.items()})
    out: dict[str, Any] = {}
    for name, events in texts.items():
        seen: list[str] = []
        t, logged = time.monotonic(), len(server.output())
        try:
            async with await _session(connect, ws_url) as ws:
                for ev in events:
                    await ws.send(ev)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        msg = json.loads(await asyncio.wait_for(ws.recv(), 15))
                    except TimeoutError:
                        break
                    seen.append(msg["type"])
                    if msg["type"] == "response.done":
                        break
            closed_cleanly = True
        except Exception as exc:  # the server closed the session under the client
            closed_cleanly = "error" in seen
            seen.append(f"closed: {type(exc).__name__}: {str(exc)[:200]}")
        out[name] = {"errors": seen.count("error"), "events": seen[-6:], "clean": closed_cleanly,
                     "done": "response.done" in seen, "window": (t, time.monotonic()),
                     "rss_mb": rss_mb(server.proc.pid), "loop_stalls": stalls_since(server, logged)}
    return out


def _silent_socket(host: str, port: int, path: str, headers: dict[str, str]) -> socket.socket:
    """A WebSocket client that never reads: a raw socket after the upgrade request (its answer is left unread too),
    with a small receive buffer, so what the server writes backs up into the server as it does over a network.
    (A client library keeps reading into its own memory, and a loopback socket's buffer grows to 32 MB.)"""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)  # before connecting: no autotuning
    sock.connect((host, port))
    sock.settimeout(30)  # a server that stops reading it (it dropped the session) ends the sending with an error
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
             *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def _silent_session(host: str, port: int, limit: float = 30.0) -> socket.socket | None:
    """A silent client holding the slot: it reads its handshake's answer up to `session.created` (retrying while the
    last session's slot is still being freed: a 1013), then never reads again."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        sock = _silent_socket(host, port, "/v1/realtime?model=llama", {})
        seen = b""
        with contextlib.suppress(OSError):
            while b"session.created" not in seen and b"server_overloaded" not in seen:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                seen += chunk
        if b"session.created" in seen:
            return sock
        sock.close()
        time.sleep(0.5)
    return None


def _send_all(sock: socket.socket, frames: list[bytes]) -> None:
    """Send until done or the server stops taking them (it dropped the session meanwhile)."""
    try:
        for frame in frames:
            sock.sendall(frame)
    except OSError:
        pass


def _text_frame(text: str) -> bytes:
    """A client's text frame, masked with a zero key (legal, and the payload then goes as it is)."""
    data = text.encode()
    n = len(data)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
                             if n < 65536 else bytes([0x80 | 127]) + n.to_bytes(8, "big"))
    return head + b"\0\0\0\0" + data


async def silent_client(url: str, host: str, port: int) -> float | None:
    """A client that sends events whose answers it never reads holds the one slot: seconds from its first event
    until a new session gets in (None if none did within 60 s)."""
    from websockets.asyncio.client import connect

    ws_url = url.replace("http", "ws") + "/v1/realtime?model=llama"
    await (await _session(connect, ws_url)).close()  # the slot is free (once the server has seen the close)
    silent = await asyncio.to_thread(_silent_session, host, port)
    if silent is None:
        return None
    text = "z" * 1_000_000
    frame = _text_frame(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    t0 = time.monotonic()  # from its first event (its sends end when the server stops reading them)
    sending = asyncio.ensure_future(asyncio.to_thread(_send_all, silent, [frame] * 40))  # 80 MB come back unread
    freed = None
    try:
        while time.monotonic() - t0 < 60:
            await asyncio.sleep(0.5)
            try:
                async with connect(ws_url, max_size=None) as probe:
                    first = json.loads(await asyncio.wait_for(probe.recv(), 5))
            except Exception:
                continue
            if first["type"] == "session.created":
                freed = round(time.monotonic() - t0, 2)
                break
    finally:
        silent.close()
        await sending
    return freed


async def media_stress(start_timeout: float = 300.0) -> dict[str, Any]:
    # one slot: a silent client holding it shows at once; the server logs each stall of its loop past 50 ms
    server = Server("stress-media", [], models=("llama", "qwen3-omni"),
                    env={"MSTAR_REALTIME_MAX_SESSIONS": "1", LOOP_WATCH: STALL_MS})
    out: dict[str, Any] = {}
    try:
        await server.wait_ready(start_timeout)
        stresses = await asyncio.to_thread(http_stresses)
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=300.0) as client:
            for _ in range(2):  # warm: both models' first steps, the realtime path
                await client.post("/v1/chat/completions", json={"model": "llama", "messages": ASK, "max_tokens": 4})
                await client.post("/v1/chat/completions", json={"model": "qwen3-omni", "messages": ASK,
                                                                "max_tokens": 4})
            # and each media path once at a small size (the audio encoder, the vision tower, the VAD model load and
            # size their buffers on first use: that is warm-up, not what the stress holds)
            await _post(client, "/v1/audio/transcriptions", {"files": {"file": ("w.wav", _audio(2, 16_000, "WAV"),
                                                                                "audio/wav")},
                                                             "data": {"model": "qwen3-omni"}})
            small = np.random.default_rng(1).integers(0, 256, (6, 64, 96, 3), dtype=np.uint8)
            await _post(client, "/v1/chat/completions", _video_chat(await asyncio.to_thread(_mp4, small)))
            await warm_realtime(server.url)
            rss_before = rss_mb(server.proc.pid)
            stop, healthy = asyncio.Event(), []
            probe = HealthProbe("127.0.0.1", server.port)  # /health from a process of its own
            background = [asyncio.ensure_future(_healthy(client, stop, healthy))]
            base0 = time.monotonic()
            await asyncio.sleep(3)  # the healthy loop alone first: what /health takes on this box without the stress
            base1 = t0 = time.monotonic()
            logged0 = len(server.output())
            replies = {}
            for name, route, body in stresses:
                t, logged = time.monotonic(), len(server.output())
                status = await _post(client, route, body)
                replies[name] = {"status": status, "s": round(time.monotonic() - t, 2), "window": (t, time.monotonic()),
                                 "rss_mb": rss_mb(server.proc.pid), "loop_stalls": stalls_since(server, logged)}
            realtime = await realtime_stresses(server)
            await asyncio.sleep(2)  # healthy traffic after the stress too
            t1 = time.monotonic()
            stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            worst = await asyncio.to_thread(probe.stop)
            out["baseline_health_max_s"] = _worst_between(worst, base0, base1)
            for r in (*replies.values(), *realtime.values()):
                r["health_max_s"] = _worst_between(worst, *r.pop("window"))
            await asyncio.sleep(3)
            rss_after = rss_mb(server.proc.pid)
            stalls = server.loop_stalls(logged0)
            out.update(
                **stall_figures(stalls, "media"),
                media_stress_health_max_s=_worst_between(worst, t0, t1),
                media_stress_5xx=sum(1 for r in replies.values() if r["status"] >= 500 or r["status"] == 0)
                + sum(1 for code in healthy if code >= 500) + sum(1 for r in realtime.values() if not r["clean"]),
                media_healthy_failed=sum(1 for code in healthy if code != 200),
                media_healthy_total=len(healthy),
                media_rss_growth_mb=None if rss_before is None or rss_after is None else round(rss_after - rss_before),
                media_stress_s=round(time.monotonic() - t0, 1),
                stresses=replies, realtime=realtime,
            )
        out["silent_client_freed_s"] = await silent_client(server.url, "127.0.0.1", server.port)
    except Exception as exc:  # reported, not fatal
        out["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
    finally:
        await asyncio.to_thread(server.stop, 10.0)
        server.close(False)
    return out


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    if not args.media_only:
        out["grammar"] = await grammar_stress(args.start_timeout)
    out["media"] = await media_stress(args.start_timeout)
    out["load_after"] = os.getloadavg()[0]
    summary = {key: value for part in ("grammar", "media") for key, value in out.get(part, {}).items()
               if key.endswith(("health_max_s", "_max_ms", "_5xx", "freed_s", "exit_s", "growth_mb"))}
    for part, stresses in (("media", out.get("media", {}).get("stresses", {})),
                           ("realtime", out.get("media", {}).get("realtime", {}))):
        summary[f"{part}_health_max_s_by_stress"] = {name: r.get("health_max_s") for name, r in stresses.items()}
    return {**out, "summary": summary}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the stresses as they are (they are sized for ~3 min)")
    parser.add_argument("--media-only", action="store_true", help="skip the grammar stress (chaos_grammar.py)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    print(json.dumps(asyncio.run(_main(parser.parse_args())), indent=1))

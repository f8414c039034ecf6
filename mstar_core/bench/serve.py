"""`mstar bench serve`: load-test any OpenAI-compatible speech, chat or completions endpoint.

Closed loop (`--concurrency N`: N clients, each sends its next request when the last ends) or open
loop (`--rate R`: Poisson arrivals at R requests/s). Reports TTFT (chat, completions) / TTFA (speech), end-to-end
latency, real-time factor, streaming viability (every audio chunk arrived before its playback
deadline, playback starting when the first chunk arrives), p50/p90/p99 and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import struct
import sys
import time
from typing import Any

import numpy as np

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog, and then it takes a well earned nap."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--model", required=True)
    p.add_argument("--kind", choices=["speech", "chat", "completions"], default="speech",
                   help="route: /v1/audio/speech, /v1/chat/completions or /v1/completions")
    p.add_argument("--api-key", default=None)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with N clients (default 4)")
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input", default=DEFAULT_TEXT, help="text to speak, the user message (chat) or the prompt")
    p.add_argument("--voice", default="tara")
    p.add_argument("--response-format", choices=["pcm", "wav"], default="pcm")
    p.add_argument("--sample-rate", type=int, default=None,
                   help="PCM sample rate if the server sends no X-Sample-Rate header or WAV header (default 24000)")
    p.add_argument("--max-tokens", type=int, default=64, help="chat, completions: max_tokens of each request")
    p.add_argument("--n", type=int, default=1, help="chat, completions: choices per request (tokens count them all)")
    p.add_argument("--extra", default="{}", help="JSON object merged into every request body (model parameters)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    p.add_argument("--sweep", default=None, metavar="N,N,...",
                   help="closed loop at each of these concurrencies in turn (e.g. 1,4,16,64); one report each")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw latency percentiles and throughput against concurrency (needs matplotlib)")


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "mean": float(arr.mean())}


async def _speech_one(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": args.model, "input": args.input, "voice": args.voice, "response_format": args.response_format,
            **json.loads(args.extra)}
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (seconds since start, bytes of audio in this read)
    header = b""
    rate = args.sample_rate
    async with client.stream("POST", "/v1/audio/speech", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"ok": False, "status": resp.status_code, "error": resp.text[:200]}
        rate = rate or int(resp.headers.get("x-sample-rate", 0) or 0) or None
        async for data in resp.aiter_bytes():
            now = time.perf_counter() - t0
            if args.response_format == "wav" and len(header) < 44:
                need = 44 - len(header)
                header += data[:need]
                data = data[need:]
                if len(header) == 44 and rate is None:
                    rate = struct.unpack("<I", header[24:28])[0]
            if data:
                arrivals.append((now, len(data)))
    total = time.perf_counter() - t0
    rate = rate or 24000
    samples = sum(n for _, n in arrivals) // 2
    audio_s = samples / rate
    # chunk k must arrive before playback (started at the first chunk) reaches the audio before it
    viable = True
    if arrivals:
        start, played = arrivals[0][0], 0
        for at, n in arrivals:
            if at > start + played / 2 / rate + 1e-3:
                viable = False
                break
            played += n
    return {"ok": True, "ttfa": arrivals[0][0] if arrivals else None, "latency": total, "audio_s": audio_s,
            "rtf": total / audio_s if audio_s else None, "viable": viable and bool(arrivals)}


async def _text_one(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One streamed chat or completions request: TTFT, latency, tokens and time per output token."""
    if args.kind == "chat":
        path, prompt = "/v1/chat/completions", {"messages": [{"role": "user", "content": args.input}]}
    else:
        path, prompt = "/v1/completions", {"prompt": args.input}
    body = {"model": args.model, **prompt, "stream": True, "max_tokens": args.max_tokens, "n": args.n,
            "stream_options": {"include_usage": True}, **json.loads(args.extra)}
    t0 = time.perf_counter()
    ttft = None
    pieces = 0
    tokens = None
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"ok": False, "status": resp.status_code, "error": resp.text[:200]}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices", []):
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    pieces += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    tokens = tokens if tokens is not None else pieces
    per_choice = tokens / max(args.n, 1)  # the n choices decode side by side
    decode = (total - ttft) / max(per_choice - 1, 1) if ttft is not None else None
    return {"ok": True, "ttft": ttft, "latency": total, "tokens": tokens, "tpot": decode}


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    one = _speech_one if args.kind == "speech" else _text_one
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def guarded():
            try:
                results.append(await one(client, args))
            except Exception as exc:  # a dropped connection is a failed request, not a crashed bench
                results.append({"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"})

        t0 = time.perf_counter()
        if args.rate:
            rng = random.Random(args.seed)
            tasks = []
            for _ in range(args.num_requests):
                tasks.append(asyncio.ensure_future(guarded()))
                await asyncio.sleep(rng.expovariate(args.rate))
            await asyncio.gather(*tasks)
        else:
            todo = iter(range(args.num_requests))

            async def worker():
                for _ in todo:
                    await guarded()

            await asyncio.gather(*(worker() for _ in range(args.concurrency or 4)))
        wall = time.perf_counter() - t0
    return report(args, results, wall)


def report(args: argparse.Namespace, results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    out: dict[str, Any] = {
        "kind": args.kind, "model": args.model, "url": args.url,
        "mode": f"poisson {args.rate}/s" if args.rate else f"closed-loop x{args.concurrency or 4}",
        "requests": len(results), "succeeded": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall else None,
        "latency_s": percentiles([r["latency"] for r in ok]),
    }
    errors = sorted({str(r.get("status")) + ": " + r.get("error", "")[:120] for r in results if not r["ok"]})
    if errors:
        out["errors"] = errors[:5]
    if args.kind == "speech":
        audio = sum(r["audio_s"] for r in ok)
        out |= {"ttfa_s": percentiles([r["ttfa"] for r in ok if r["ttfa"] is not None]),
                "rtf": percentiles([r["rtf"] for r in ok if r["rtf"] is not None]),
                "streaming_viable_fraction": (sum(r["viable"] for r in ok) / len(ok)) if ok else None,
                "audio_s_total": audio, "audio_s_per_s": audio / wall if wall else None}
    else:
        tokens = sum(r["tokens"] for r in ok)
        out |= {"ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
                "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
                "completion_tokens_total": tokens, "tokens_per_s": tokens / wall if wall else None}
    return out


def _fmt(p: dict[str, float | None], scale: float = 1000.0, unit: str = "ms") -> str:
    if p.get("p50") is None:
        return "n/a"
    return " ".join(f"{k}={p[k] * scale:.1f}{unit}" for k in ("p50", "p90", "p99"))


def print_report(rep: dict[str, Any]) -> None:
    print(f"M* bench serve: {rep['kind']} on {rep['model']} at {rep['url']} ({rep['mode']})")
    print(f"  requests     {rep['succeeded']}/{rep['requests']} ok in {rep['wall_s']:.2f}s "
          f"({rep['requests_per_s'] or 0:.2f} req/s)")
    print(f"  latency      {_fmt(rep['latency_s'])}")
    if rep["kind"] == "speech":
        print(f"  TTFA         {_fmt(rep['ttfa_s'])}")
        print(f"  RTF          {_fmt(rep['rtf'], 1.0, '')}  (below 1 = faster than real time)")
        viable = rep["streaming_viable_fraction"]
        print(f"  streaming    {'n/a' if viable is None else f'{viable * 100:.0f}%'} of requests had every chunk "
              "before its playback deadline")
        print(f"  throughput   {rep['audio_s_per_s'] or 0:.2f} audio-s/s ({rep['audio_s_total']:.1f} s of audio)")
    else:
        print(f"  TTFT         {_fmt(rep['ttft_s'])}")
        print(f"  TPOT         {_fmt(rep['tpot_s'])}")
        print(f"  throughput   {rep['tokens_per_s'] or 0:.1f} tokens/s ({rep['completion_tokens_total']} tokens)")
    for err in rep.get("errors", []):
        print(f"  error        {err}")


def _levels(args: argparse.Namespace) -> list[int] | None:
    if args.sweep is None:
        return None
    try:
        levels = [int(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(n < 1 for n in levels):
        raise SystemExit(f"mstar bench serve: --sweep wants positive integers like 1,4,16, got {args.sweep!r}")
    if args.rate:
        raise SystemExit("mstar bench serve: --sweep is closed loop; drop --rate")
    return levels


def main(args: argparse.Namespace) -> int:
    plot = getattr(args, "plot", None)
    if plot:
        from mstar_core.bench.plot import require_matplotlib

        if (problem := require_matplotlib()) is not None:  # before any load is sent
            print(f"mstar bench serve: {problem}", file=sys.stderr)
            return 2
        if args.rate:
            print("mstar bench serve: --plot draws against concurrency; use --concurrency or --sweep, not --rate",
                  file=sys.stderr)
            return 2
    levels = _levels(args) if hasattr(args, "sweep") else None
    if levels is None:
        reps = [asyncio.run(run_bench(args))]
        reps[0]["concurrency"] = None if args.rate else (args.concurrency or 4)
    else:
        reps = []
        for n in levels:
            args.concurrency = n
            reps.append(asyncio.run(run_bench(args)) | {"concurrency": n})
    for rep in reps:
        if not args.json:
            print_report(rep)
    out = reps[0] if levels is None else {"sweep": reps}
    if plot:
        from mstar_core.bench.plot import plot_sweep

        out["plot"] = str(plot_sweep(reps, plot))
        if not args.json:
            print(f"  plot         {out['plot']}")
    print(json.dumps(out), file=sys.stdout)
    return 0 if all(r["succeeded"] for r in reps) else 1

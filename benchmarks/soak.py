"""Soak: every tiny preset behind one `mstar serve`, every route it serves and its native walk, for N minutes, with
clients that cancel mid-stream; then errors, the server's RSS growth after warm-up and the gauges at the end.

A few client loops pick a (model, route) at random (speech, chat, completions, images, the native walk with the
model's own example request) and send it; a quarter of the streamed ones are cancelled after the first bytes.
Counted: `errors` (a 5xx, or any status but 200 / 503-with-Retry-After, or a 200 whose stream broke), the 503s
(load shedding), cancellations; the serving process' RSS sampled every 2 s: `rss_growth_pct` from the end of the
warm-up (the first quarter of the run) to the end; at the end `/metrics` must show 0 running, 0 queued and
0 KV pages used (polled up to 10 s). Targets (issue 31, for `--minutes 10`): 0 errors, RSS growth < 5 %,
gauges back to 0. Not in CI. The last line printed is the JSON of all figures.

    python benchmarks/soak.py --minutes 10
    python benchmarks/soak.py --quick           # one minute, two models: the harness itself
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx
from chaos_driver import Server, rss_mb  # benchmarks/ is on sys.path when this runs as a script

MODELS = ("orpheus", "llama", "qwen3-omni", "bagel", "pi05", "pi0", "vjepa2", "vjepa2-ac")
QUICK_MODELS = ("orpheus", "llama")
CANCEL_SHARE = 0.25


def route_bodies(models: list[dict], openapi: dict) -> list[tuple[str, str, dict, bool]]:
    """(label, path, body, streamed) for every route of every served model, and its native walk's example."""
    out = []
    comps = openapi.get("components", {}).get("schemas", {})
    for card in models:
        name, routes = card["id"], set(card.get("routes", []))
        if "speech" in routes:
            body = {"model": name, "input": "Soak test, sentence one.", "max_tokens": 60, "response_format": "pcm"}
            if name == "orpheus":
                body["voice"] = "tara"
            out.append((f"{name}/speech", "/v1/audio/speech", body, True))
        if "chat" in routes:
            out.append((f"{name}/chat", "/v1/chat/completions",
                        {"model": name, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8,
                         "stream": True}, True))
        if "completions" in routes:
            out.append((f"{name}/completions", "/v1/completions",
                        {"model": name, "prompt": "Once upon", "max_tokens": 8, "n": 2}, False))
        if "images" in routes:
            out.append((f"{name}/images", "/v1/images/generations", {"model": name, "prompt": "a red cube"}, False))
        key = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        examples = comps.get(f"{key}.WalkRequest", {}).get("examples") or []
        if examples:
            out.append((f"{name}/walks", f"/v1/walks/{name}", {**examples[0], "stream": True}, True))
    return out


class Tally:
    def __init__(self) -> None:
        self.by_route: dict[str, dict[str, int]] = {}
        self.errors: list[dict[str, Any]] = []

    def add(self, label: str, outcome: str, detail: str = "") -> None:
        counts = self.by_route.setdefault(label, {})
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "error" and len(self.errors) < 20:
            self.errors.append({"route": label, "detail": detail[:300]})


async def one(client: httpx.AsyncClient, item: tuple[str, str, dict, bool], tally: Tally, rng: random.Random) -> None:
    label, path, body, streamed = item
    cancel = streamed and rng.random() < CANCEL_SHARE
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 503 and r.headers.get("retry-after"):
                await r.aread()
                tally.add(label, "shed_503")
                await asyncio.sleep(min(2.0, float(r.headers["retry-after"])))
                return
            if r.status_code != 200:
                tally.add(label, "error", f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
                return
            async for data in r.aiter_raw():
                if cancel and data:
                    tally.add(label, "cancelled")  # leaving the block closes the connection mid-stream
                    return
                if b'"event":"error"' in data or b'"event": "error"' in data:
                    tally.add(label, "error", data.decode(errors="replace"))
                    return
        tally.add(label, "ok")
    except httpx.HTTPError as exc:
        tally.add(label, "error", f"{type(exc).__name__}: {exc}")


async def gauges(client: httpx.AsyncClient, wait: float) -> dict[str, float]:
    """Sums of mstar_running_requests, mstar_queue_depth and mstar_kv_pages_used, polled until all are 0."""
    names = ("mstar_running_requests", "mstar_queue_depth", "mstar_kv_pages_used")
    deadline = time.monotonic() + wait
    while True:
        text = (await client.get("/metrics")).text
        sums = dict.fromkeys(names, 0.0)
        for line in text.split("\n"):
            for name in names:
                if line.startswith(name + "{") or line.startswith(name + " "):
                    sums[name] += float(line.rpartition(" ")[2])
        if not any(sums.values()) or time.monotonic() > deadline:
            return sums
        await asyncio.sleep(0.5)


async def main_async(args) -> dict[str, Any]:
    models = QUICK_MODELS if args.quick else tuple(args.models.split(",")) if args.models else MODELS
    server = Server("soak", [], models=models)
    rng = random.Random(args.seed)
    tally = Tally()
    rss: list[tuple[float, float]] = []
    try:
        await server.wait_ready(args.start_timeout)
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=120) as client:
            cards = (await client.get("/v1/models")).json()["data"]
            items = route_bodies(cards, (await client.get("/openapi.json")).json())
            t0 = time.monotonic()
            end = t0 + args.minutes * 60

            async def loop() -> None:
                while time.monotonic() < end:
                    await one(client, rng.choice(items), tally, rng)

            async def sample() -> None:
                while time.monotonic() < end:
                    value = rss_mb(server.proc.pid)
                    if value is not None:
                        rss.append((time.monotonic() - t0, value))
                    await asyncio.sleep(2.0)

            await asyncio.gather(sample(), *(loop() for _ in range(args.concurrency)))
            final = await gauges(client, 10.0)
        warm = args.minutes * 60 * 0.25
        after = [v for t, v in rss if t >= warm] or [v for _, v in rss]
        growth = None if not after else round(100.0 * (after[-1] - after[0]) / after[0], 2)
        totals: dict[str, int] = {}
        for counts in tally.by_route.values():
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
        return {
            "benchmark": "soak", "minutes": args.minutes, "models": list(models), "routes": [i[0] for i in items],
            "concurrency": args.concurrency, "requests": sum(totals.values()), "outcomes": totals,
            "errors": totals.get("error", 0), "error_examples": tally.errors, "by_route": tally.by_route,
            "rss_mb_at_warm": after[0] if after else None, "rss_mb_end": after[-1] if after else None,
            "rss_mb_peak": max((v for _, v in rss), default=None), "rss_growth_pct": growth,
            "gauges_at_end": final, "gauges_back_to_0": not any(final.values()),
            "targets_met": {"errors": totals.get("error", 0) == 0,
                            "rss_growth_pct": growth is not None and growth < 5.0,
                            "gauges_back_to_0": not any(final.values())},
        }
    finally:
        server.stop(grace=15.0)
        server.close(keep_log=args.keep_log)
        if args.keep_log:
            print(f"server log: {server.log.name}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long traffic runs (default 10)")
    parser.add_argument("--quick", action="store_true", help="one minute on orpheus and llama (the harness itself)")
    parser.add_argument("--models", default=None, help=f"comma-separated models (default: {','.join(MODELS)})")
    parser.add_argument("--concurrency", type=int, default=4, help="client loops")
    parser.add_argument("--seed", type=int, default=0, help="the random choice of routes and cancellations")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the server to become healthy")
    parser.add_argument("--keep-log", action="store_true", help="keep the server's log")
    args = parser.parse_args()
    if args.quick:
        args.minutes = min(args.minutes, 1.0)
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()

"""Grammar stress (issue 50, items 1 and 2) beside healthy traffic, on its own tiny `llama` server.

While a healthy loop posts small `response_format` chats and `GET /health` is polled every 50 ms (from a process of
its own: chaos_driver.HealthProbe), the stress posts
the issue's abusive grammars, sized just within the default limits (the issue's own sizes are now refused at once by
the size limits: 64 KB a schema, 256 KB a grammar): 8 tools x 1,000 optional integer properties with
`tool_choice: required` (~230 KB), four ~60 KB `response_format` schemas of 2,200 optional properties, and a 200-level schema and a 2,000-parenthesis
`pattern` on each of the five routes that take a schema. Then SIGTERM while a compile runs. Figures:
  * `grammar_stress_health_max_s`: the slowest /health answer while the stress ran (target <= 0.1);
  * `grammar_stress_5xx`: answers >= 500 other than 503 (target 0): abusive grammars get 400s (budget, checks) or
    503s (queue full), never a 500;
  * `grammar_healthy_failed`: healthy requests that did not get a 200 (a 503 from a full compile queue is retried);
  * `sigterm_exit_s`: SIGTERM to exit while a compile runs (target <= drain timeout + 5);
  * `grammar_loop_stalls`: each stall of the server's event loop past 50 ms during the stress, its cause and where the
    loop was (the server's MSTAR_LOOP_WATCH_MS; chaos_driver.stall_figures): `grammar_loop_computing_max_ms` and
    `grammar_loop_gil_max_ms` are the server's own (target <= 50), `grammar_loop_no_cpu_max_ms` the machine's load:
    the evidence when /health's wall time is the box rather than the server;
  * `abusive`: each abusive request's [status, seconds, slowest /health while it was in flight].

    python benchmarks/chaos_grammar.py        (chaos.py runs it among its stresses)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
from chaos_driver import HealthProbe, Server, stall_figures

DRAIN_S = 5.0
ASK = [{"role": "user", "content": "Hi"}]
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def _optional(n: int, salt: str) -> dict:
    return {"type": "object", "properties": {f"{salt}{i}": {"type": "integer"} for i in range(n)}}


def _nest(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _five_routes(schema: dict) -> list[tuple[str, dict]]:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return [("/v1/chat/completions", {"model": "llama", "messages": ASK, "response_format": fmt}),
            ("/v1/completions", {"model": "llama", "prompt": "Hi", "response_format": fmt}),
            ("/v1/chat/completions", {"model": "llama", "messages": ASK, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f", "parameters": schema}}]}),
            ("/v1/responses", {"model": "llama", "input": "Hi",
                               "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
            ("/v1/responses", {"model": "llama", "input": "Hi", "tool_choice": "required",
                               "tools": [{"type": "function", "name": "f", "parameters": schema}]})]


def abusive() -> list[tuple[str, str, dict]]:
    tools = [{"type": "function", "function": {"name": f"t{k}", "parameters": _optional(1000, f"t{k}_")}}
             for k in range(8)]
    out = [("tools_8x1000", "/v1/chat/completions",
            {"model": "llama", "messages": ASK, "tools": tools, "tool_choice": "required"})]
    for k in range(4):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _optional(2200, f"r{k}_")}}
        out.append((f"response_format_2200_{k}", "/v1/chat/completions",
                    {"model": "llama", "messages": ASK, "response_format": fmt}))
    for name, schema in (("deep_200", _nest(200)),
                         ("parens_2000", {"type": "string", "pattern": "(" * 2000 + "a" + ")" * 2000})):
        out += [(f"{name}_{i}", route, body) for i, (route, body) in enumerate(_five_routes(schema))]
    return out


def _worst_between(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    during = [s for at, s in samples if t0 <= at + s and at <= t1]
    return round(max(during), 3) if during else None


async def _healthy(client: httpx.AsyncClient, stop: asyncio.Event, codes: list[int]) -> None:
    k = 0
    while not stop.is_set():
        k += 1
        body = {"model": "llama", "messages": ASK, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "ok", "schema": {**SMALL, "title": f"h{k % 4}"}}}}
        for _ in range(20):  # a full compile queue is a 503 with Retry-After: a client retries
            try:
                r = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                codes.append(0)
                break
            if r.status_code != 503:
                codes.append(r.status_code)
                break
            await asyncio.sleep(min(float(r.headers.get("Retry-After", "1")), 2.0))
        await asyncio.sleep(0.1)


async def grammar_stress(start_timeout: float = 300.0) -> dict[str, Any]:
    # the server logs each stall of its event loop past 50 ms, and where the loop was meanwhile
    server = Server("stress-grammar", ["--drain-timeout", str(DRAIN_S)], models=("llama",),
                    env={"MSTAR_LOOP_WATCH_MS": os.environ.get("WATCHMS", "50")})
    out: dict[str, Any] = {}
    try:
        await server.wait_ready(start_timeout)
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=600.0) as client:
            await client.post("/v1/chat/completions", json={"model": "llama", "messages": ASK, "max_tokens": 4})
            stop, healthy = asyncio.Event(), []
            probe = HealthProbe("127.0.0.1", server.port)  # /health from a process of its own
            background = [asyncio.ensure_future(_healthy(client, stop, healthy))]
            t0, logged = time.monotonic(), len(server.output())

            async def one(name: str, route: str, body: dict) -> tuple[str, int, float, float]:
                t = time.monotonic()
                r = await client.post(route, json=body)
                return name, r.status_code, t, time.monotonic()

            replies = await asyncio.gather(*(one(*a) for a in abusive()))
            await asyncio.sleep(2)  # healthy traffic after the abuse too
            stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            worst = await asyncio.to_thread(probe.stop)
            out.update(
                grammar_stress_health_max_s=_worst_between(worst, t0, time.monotonic()),
                grammar_stress_5xx=sum(1 for _, code, _, _ in replies if code >= 500 and code != 503)
                + sum(1 for code in healthy if code >= 500),
                grammar_healthy_failed=sum(1 for code in healthy if code != 200),
                grammar_healthy_total=len(healthy),
                grammar_stress_s=round(time.monotonic() - t0, 1),
                # [status, seconds, the slowest /health while it was in flight (all of them run at once)]
                abusive={name: [code, round(t1 - t, 2), _worst_between(worst, t, t1)] for name, code, t, t1 in replies},
            )
            stalls = server.loop_stalls(logged)
            out.update(**stall_figures(stalls, "grammar"),
                       grammar_loop_stalls=[f"{ms} ms {cause}: {where[:1500]}" for ms, cause, where in stalls])
            # SIGTERM while a compile runs (one that would take minutes, were it let)
            pending = asyncio.ensure_future(one("slow", "/v1/chat/completions", {
                "model": "llama", "messages": ASK, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "x", "schema": _optional(2200, "s")}}}))
            await asyncio.sleep(2)
            t = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            while server.proc.poll() is None and time.monotonic() - t < DRAIN_S + 60:
                await asyncio.sleep(0.05)
            out["sigterm_exit_s"] = round(time.monotonic() - t, 2) if server.proc.poll() is not None else None
            out["drain_timeout_s"] = DRAIN_S
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
    except Exception as exc:  # reported, not fatal
        out["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
    finally:
        await asyncio.to_thread(server.stop, 10.0)
        server.close(False)
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(grammar_stress()), indent=1))

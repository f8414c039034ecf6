"""Chaos case: `kill -9` one rank of a tensor-parallel group while requests stream (run by chaos.py, or alone).

A real `mstar serve llama` (tiny preset) with two TP=2 groups (`replicas: 2`, 2 gloo ranks each, 4
worker processes, forks of the worker zygote as for any user; a rank's pid comes from the server's
`mstar_worker_info` on /metrics). Client loops stream greedy /v1/walks/llama requests back to back;
once every loop has a request mid-stream, the follower rank `tp.0.rank1` is SIGKILLed. Figures:

  * `tp_group_requests_failed`: requests in flight at the kill that failed naming the killed group
    (`tp.0`, either rank); `tp_group_fail_latency_s`: the longest time from the kill to one of them
    failing at the client (target <= 1.5; null when the kill hit no request of that group).
  * `tp_other_replica_failed`: every other request that did not end with all its tokens (requests on
    the other group, and everything sent after the kill). Target 0.
  * `tp_group_recovery_s`: from the kill to the killed group serving again: its rank 0's
    `tokens_forwarded` gauge (from /metrics) back above zero after it restarted. Target <= 10.

    python benchmarks/chaos_tp.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

import httpx
import yaml
from chaos_driver import Server

PLACEMENT = {"workers": {"tp": {"device": "cpu", "tensor_parallel": 2, "replicas": 2, "threads": 1}},
             "nodes": {"lm": "tp"}}
KILLED, GROUP = "tp.0.rank1", "tp.0"
TOKENS = 48


async def _request(client: httpx.AsyncClient, url: str, prompt: list[int], log: list[dict]) -> None:
    """One streamed greedy request, recorded: start, end, tokens, and the error text if it failed."""
    rec: dict[str, Any] = {"start": time.monotonic(), "tokens": 0, "error": None}
    log.append(rec)
    body = {"inputs": {"input_ids": prompt, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0.0}}
    try:
        async with client.stream("POST", f"{url}/v1/walks/llama", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in r.aiter_lines():
                    event = json.loads(line)
                    if event["event"] == "output" and event["name"] == "next_token":
                        rec["tokens"] += 1
                    elif event["event"] == "error":
                        rec["error"] = json.dumps(event)[:300]
    except Exception as exc:  # a broken stream or the client's timeout
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    rec["end"] = time.monotonic()
    if rec["error"] is None and rec["tokens"] != TOKENS:
        rec["error"] = f"short: {rec['tokens']} tokens"


async def _tokens_forwarded(client: httpx.AsyncClient, url: str, worker: str) -> float | None:
    """The worker's `tokens_forwarded` gauge for llama/lm on /metrics (None while it exports none)."""
    try:
        text = (await client.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():  # labels come sorted: model, node, stat, worker
        if line.startswith("mstar_node_stat{") and 'stat="tokens_forwarded"' in line and f'worker="{worker}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _say(line: str) -> None:
    print(f"[tp] {line}", file=sys.stderr, flush=True)


async def tp_rank_kill(args: Any) -> dict[str, Any]:
    """The scenario; returns its figures (keys prefixed `tp_`)."""
    quick = getattr(args, "quick", False)
    loops, after = (6, 10.0) if quick else (8, 15.0)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(PLACEMENT, f)
    server = Server("tp", ["--config", f.name], models=("llama",))
    out: dict[str, Any] = {}
    try:
        await server.wait_ready(getattr(args, "start_timeout", 180.0))
        out["tp_server_ready_s"] = round(server.ready_s or 0.0, 1)
        _say(f"ready after {out['tp_server_ready_s']} s")
        log: list[dict] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=getattr(args, "timeout", None) or 30.0, trust_env=False) as client:
            async def loop(i: int) -> None:
                while not stop.is_set():
                    await _request(client, server.url, [5 + i, 6 + i, 7 + i, 8 + i, 9 + i], log)
                    if log[-1]["error"]:
                        await asyncio.sleep(0.2)  # a refused or failed request: no hot retry loop

            tasks = [asyncio.ensure_future(loop(i)) for i in range(loops)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (  # every loop mid-stream, and group 0 serving some
                    sum(1 for r in log if "end" in r and r["error"] is None) >= loops
                    and sum(1 for r in log if "end" not in r and r["tokens"] > 0) >= loops
                    and (await _tokens_forwarded(client, server.url, GROUP) or 0) > 0):
                await asyncio.sleep(0.05)
            pid = server.workers().get(KILLED)
            out["tp_workers_found_by"] = server.found_by
            if pid is None:
                raise RuntimeError(f"no worker process named {KILLED}: {sorted(server.workers())}")
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            _say(f"killed {KILLED} (pid {pid}) with {sum(1 for r in log if 'end' not in r)} requests in flight")
            recovered_at, went_down = None, False
            while time.monotonic() - killed_at < after or recovered_at is None and time.monotonic() - killed_at < 30:
                value = await _tokens_forwarded(client, server.url, GROUP)
                went_down = went_down or value is None or value == 0
                if went_down and value and recovered_at is None:
                    recovered_at = time.monotonic()
                await asyncio.sleep(0.1)
            _say(f"recovered after {None if recovered_at is None else round(recovered_at - killed_at, 2)} s")
            stop.set()
            await asyncio.gather(*tasks)
        in_flight = [r for r in log if r["start"] < killed_at < r["end"]]
        group = [r for r in in_flight if r["error"] and GROUP in r["error"]]
        others = [r for r in log if r["error"] and r not in group]
        out.update({
            "tp_requests": len(log),
            "tp_in_flight_at_kill": len(in_flight),
            "tp_group_requests_failed": len(group),
            "tp_group_fail_latency_s": round(max(r["end"] - killed_at for r in group), 3) if group else None,
            "tp_other_replica_failed": len(others),
            "tp_other_replica_errors": [r["error"] for r in others[:3]],
            "tp_group_recovery_s": None if recovered_at is None else round(recovered_at - killed_at, 2),
        })
        lat, rec = out["tp_group_fail_latency_s"], out["tp_group_recovery_s"]
        out["tp_targets_met"] = bool(lat is not None and lat <= 1.5 and rec is not None and rec <= 10
                                     and out["tp_other_replica_failed"] == 0)
    finally:
        server.stop(grace=5.0)
        server.close(False)
        os.unlink(f.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 client loops, 8 s after the kill")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--timeout", type=float, default=30.0, help="client timeout per request")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(asyncio.run(tp_rank_kill(args))))


if __name__ == "__main__":
    sys.exit(main())

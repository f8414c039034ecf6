"""Fault isolation under chaos: poisoned requests, `kill -9` and `SIGSTOP` of workers, behind the real HTTP server.

Two real `mstar serve orpheus` processes (tiny preset) on free loopback ports: colocated (one
process) and disaggregated (`examples/placement/orpheus-disaggregated.yaml`: the LM and the SNAC
codec each in a worker process). Against each, a few client loops (bounded concurrency) stream
/v1/audio/speech back to back (after a failure a loop waits Retry-After, at most 2 s, or 0.5 s)
while poisoned requests are mixed in: `seed` 1.5, 2**64, "abc", Infinity, `temperature: 1e-320`
with and without `top_p: 0.5`, and through /v1/walks/orpheus (when the server has that route)
`seed: 1.5` and `logprobs: 10**9`. On the disaggregated server each worker is then `kill -9`ed
in turn and one is `SIGSTOP`ped: round 1 stops the LM's worker, kills it, kills the codec's;
round 2 kills the LM's, kills the codec's, stops the codec's (rounds alternate; the codec's faults
come last so that the final page count sees what they left on the LM's worker). A stopped worker
that supervision has not killed within `--stop-window` seconds is sent `SIGCONT`.

Rules (what the figures count):
  * full output: HTTP 200, the chunked body received to its end, a 44-byte PCM s16le mono WAV
    header, and as many samples as the reference for the same (text, voice, seed, max_tokens):
    a non-streamed (`stream: false`) request made on the same server before any fault or poison.
    (Sample counts do not depend on batching; sample values may, so they are not compared.)
  * a request is *in flight at a fault* if it had not ended by the kill/stop and started before
    the server could know of it (the first failure of a request already running at the fault:
    a request admitted in between was routed to the dead worker, so it was on it); every request
    runs through both workers, so these are excluded from `healthy_requests_failed` whatever
    happens to them.
  * `healthy_requests_failed`: requests that are not poisoned and not in flight at a fault and did
    not end with full output. One exception: a request that started after a fault and before the
    server had recovered from it (no full-output request started after the fault had ended yet)
    and was answered with a clean 503 (status line 503, no audio) is a retryable refusal, not a
    failure. A 200 cut short, a 5xx other than 503, a short body or a timeout always counts.
    Probe requests (below) follow the same rule.
  * `max_fail_latency_s`: over every fault, the longest time from the kill/stop to a request that
    was in flight at it failing at the client (its error status line, its stream breaking off or
    ending short, or the client's timeout: counted in `in_flight_hung`). The target holds when
    every fault hit requests in flight, none hung, and each that failed did so within 1.5 s.
  * `recovery_s`: over every fault, the time from the kill/stop to the end of the first request
    started after it that finished with full output (short probe requests are sent every 0.25 s
    after a fault, up to 3 at a time, to find that moment). A `SIGSTOP` counts as recovered only if
    that happened before this script's `SIGCONT`; an unrecovered fault makes `recovery_s` null.
  * `pages_leaked`: once all requests have ended, the sum of `mstar_kv_pages_used` over every
    series `/metrics` exports (polled up to 5 s for it to reach 0). It is null (and the target
    unmet) when the KV node (`lm`) has no series, e.g. a worker's gauges are not exported.
  * `poisoned_4xx`: poisoned requests answered with a 4xx (not a 5xx, a 200, a broken stream or a
    hang), out of `poisoned_total`.

Stresses (issue 31), each on its own colocated server started beside the others (`--no-stress` skips them):
  * `burst_503_exact`: 200 streamed requests at once against `--max-running 4 --max-queued 4` get exactly 192
    503s (with Retry-After); details under `stress.burst`.
  * `drain_lost`: SIGTERM while 6 streams run; every one must still end with full output (a lost one counts),
    3 requests sent during the drain must get 503, the server must exit 0 (`stress.drain`).
  * `slow_client_rss_growth_mb`: 4 streamed llama completions (ignore_eos, 2000 tokens) read 512 B every 50 ms
    for 15 s, then hung up; the serving process' peak RSS over its RSS after a warm-up (`stress.slow_reader`).
  * `grammar_stress_health_max_s` (<= 0.1), `sigterm_exit_s` (<= drain timeout + 5): abusive grammars beside healthy
    traffic, then SIGTERM during a compile (chaos_grammar.py; details under `stress.grammar`).
  * `media_stress_health_max_s` (<= 0.1), `silent_client_freed_s` (<= 30): 12 MB texts, Responses metadata, long
    transcriptions, damaged and sparse videos, realtime instructions / appends / 4096x4096 images / 20k tools beside
    healthy traffic, then a realtime client that never reads holding the one slot (chaos_media.py; `stress.media`).
    `stress_5xx` (0): answers >= 500 (other than a full compile queue's 503) to both stresses and their healthy
    loops; `stress_rss_growth_mb` (<= 300): the media server's RSS 3 s after its stress ended over its warm RSS.
  * `partition_recovery_s`: the SNAC codec on a worker in its own network namespace (tests/cluster/link_faults.py,
    the scenario the network-fault test runs, here in this process): a request in flight, then a 3 s partition of
    the veth link (netem loss 100 %, or pfifo with no room where the kernel has no netem), then the heal; seconds
    from the heal to the end of the first request with the reference audio (the worker rejoins by itself). The full
    run first puts a delay and a loss on the link (one request each). Needs root, `ip` and `tc`; otherwise null,
    with the reason under `stress.partition.skipped` (`--no-partition` skips it).

Tensor parallelism (issue 27, `chaos_tp.py`; `--no-tp` skips it, `--tp-only` runs only it): a llama server with
two TP=2 groups; one group's follower rank is `kill -9`ed mid-request. Keys `tp_group_fail_latency_s` (<= 1.5),
`tp_group_recovery_s` (<= 10), `tp_other_replica_failed` (0), details under `tensor_parallel`.

The code is split: chaos_driver.py (servers, workers, the recording client), chaos_faults.py (poisons, kills,
stops and the stresses), chaos_report.py (classification, figures, the summary); this file runs the scenarios.

Targets: healthy_requests_failed 0, max_fail_latency_s <= 1.5, recovery_s <= 10, pages_leaked 0,
poisoned_4xx == poisoned_total. Not run in CI. `--quick`: one round, 4 client loops, shorter
requests (the disaggregated server starts while the colocated scenario runs); without it: two
rounds, 6 loops, longer requests and waits. `--no-poisons --no-faults` checks the harness itself:
every request must then finish with full output. A server that fails to start is reported
(`start_failures`) and started once more. Everything goes to 127.0.0.1; every loop is bounded in
count and time; the servers and their workers are stopped on exit (also on an exception, Ctrl-C
or SIGTERM). The last line printed is the JSON of all figures.

    python benchmarks/chaos.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from chaos_driver import REPO, Driver, Server, StartError, references, send_poisons, traffic, wait_mid_stream
from chaos_faults import (
    BURST,
    BURST_QUEUED,
    BURST_RUNNING,
    PROBE,
    Fault,
    burst_admission,
    drain_under_load,
    fault_phase,
    partition_heal,
    poisons,
    slow_reader,
)
from chaos_grammar import grammar_stress
from chaos_media import media_stress
from chaos_report import (
    _count,
    classify,
    covers,
    examples,
    fault_figures,
    fault_report,
    kv_pages,
    log_summary,
    phase,
    summarize,
)
from chaos_tp import tp_rank_kill

PLACEMENT = REPO / "examples" / "placement" / "orpheus-disaggregated.yaml"
TEXTS = [
    "Hey there, my name is Tara, and I speak in real time.",
    "The quick brown fox jumps over the lazy dog.",
    "How vexingly quick daft zebras jump!",
    "Streaming audio keeps the first sound early, even for long replies.",
]


def jobs_for(quick: bool) -> list[tuple]:
    lengths = [140, 280, 210, 245] if quick else [140, 420, 210, 700, 280, 560]
    return [(TEXTS[i % len(TEXTS)], 11 + i, n) for i, n in enumerate(lengths)]


async def run_scenario(server: Server, args, *, faults_plan: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"placement": server.label}
    await server.ready
    out["server_ready_s"] = round(server.ready_s or 0.0, 2)
    out["workers"] = sorted(server.workers())
    print(f"[{server.label}] ready after {out['server_ready_s']:.1f}s (workers: {', '.join(out['workers']) or 'none'})",
          flush=True)
    drv = Driver(server, args.timeout)
    try:
        card = (await drv.client.get("/v1/models")).json()["data"]
        orpheus = next(c for c in card if c["id"] == "orpheus")
        if "speech" not in orpheus.get("routes", []):
            raise RuntimeError(f"orpheus does not serve speech here: {orpheus}")
        paths = (await drv.client.get("/openapi.json")).json().get("paths", {})
        has_walks = "/v1/walks/{model}" in paths
        jobs = jobs_for(args.quick)
        probe = (PROBE["input"], PROBE["seed"], PROBE["max_tokens"])
        t_ref = time.monotonic()
        await references(drv, [*jobs, probe])
        out["reference_s"] = round(time.monotonic() - t_ref, 2)
        out["reference_samples"] = {f"max_tokens={j[2]}": n for j, n in drv.reference.items()}
        drv.t0 = time.monotonic()

        stop = asyncio.Event()
        loops = [drv.spawn(traffic(drv, jobs, i, args.concurrency, stop, args.max_requests))
                 for i in range(args.concurrency)]
        await wait_mid_stream(drv, 2, 10.0)
        items = [] if args.no_poisons else [(name if k == 0 else f"{name} (round {k + 1})", path, body)
                                            for k in range(args.rounds) for name, path, body in poisons(has_walks)]
        poison_tasks = await send_poisons(drv, items, args.poison_gap)
        # the poison phase ends when the poisons and the healthy requests beside them have ended (each is
        # bounded by its timeout), so that no fault below hides what a poison did
        t_last = drv.now()
        await asyncio.gather(*poison_tasks, return_exceptions=True)
        beside = [r for r in drv.in_flight(("healthy",)) if r.t_start <= t_last]
        while any(r.t_end is None for r in beside):
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.tail)
        out["poison_phase_s"] = round(drv.now(), 2)
        print(f"  [{server.label}] t={drv.now():6.2f}s {len(items)} poisons answered", flush=True)
        phases: list[Fault | dict] = []
        for kind, worker in faults_plan:
            # after a SIGCONT, a few more seconds show whether the server recovers then
            limit = args.stop_window + (5 if args.quick else 10) if kind == "stop" else args.kill_limit
            f = await fault_phase(drv, kind, worker, limit, args.stop_window)
            phases.append(f)
            if isinstance(f, Fault):
                rep = fault_report(f)
                print(f"  [{server.label}] t={drv.now():6.2f}s {kind} {worker}: in flight {rep['in_flight']} "
                      f"(failed {rep['in_flight_failed']}, max fail latency {rep['max_fail_latency_s']}), "
                      f"recovery {rep['recovery_s']} s, replaced after {rep['replaced_after_s']} s", flush=True)
            await asyncio.sleep(args.settle)
        if faults_plan:
            await asyncio.sleep(args.tail)
        stop.set()
        # every request is bounded by its own timeout, so this ends
        await asyncio.gather(*loops, *poison_tasks, *list(drv.tasks), return_exceptions=True)
        out["traffic_s"] = round(drv.now(), 2)
        faults = [f for f in phases if isinstance(f, Fault)]
        reports = [fault_report(f) for f in phases]

        cls = classify(drv.records, faults)
        healthy = [r for r in drv.records if r.kind in ("healthy", "probe")]
        failed = [r for r in healthy if cls[id(r)] == "failed"]
        poison_recs = [r for r in drv.records if r.kind == "poison"]
        pages = await kv_pages(drv, 5.0)
        kv_nodes = ["lm"]  # Orpheus' paged-KV node, wherever it runs
        missing = [n for n in kv_nodes if not any(covers(k, n) for k in pages)]
        out.update({
            "requests": len(healthy),
            "healthy_outcomes": _count(cls[id(r)] for r in healthy),
            "healthy_requests_failed": len(failed),
            "retryable_503_without_retry_after": sum(1 for r in healthy if cls[id(r)] == "retryable_503"
                                                     and r.retry_after is None),
            "failed_examples": examples(failed, faults),
            "failed_outcomes": _count(r.outcome for r in failed),
            "failed_by_phase": _count(phase(r, faults) for r in failed),
            "poisoned_total": len(poison_recs),
            "poisoned_4xx": sum(1 for r in poison_recs if r.status is not None and 400 <= r.status < 500),
            "poisons": {r.name: {"status": r.status, "outcome": r.outcome,
                                 "answer_s": None if r.t_end is None else round(r.t_end - r.t_start, 3),
                                 "detail": r.detail[:200]} for r in poison_recs},
            "faults": reports,
            "kv_pages_used": pages,
            "kv_gauges_missing_for": missing,
            "pages_leaked": None if missing else int(sum(pages.values())),
        })
        if faults_plan:
            out.update(fault_figures(reports))
        return out
    finally:
        for task in list(drv.tasks):
            task.cancel()
        await drv.close()



async def run_stresses(args) -> dict[str, Any]:
    """Burst admission, drain under load and a slow reader, each on its own colocated server (started together)."""
    flags = {"burst": ["--max-running", str(BURST_RUNNING), "--max-queued", str(BURST_QUEUED)],
             "drain": ["--drain-timeout", "30"], "slow_reader": []}
    servers = {label: Server(f"stress-{label}", extra, models=("llama",) if label == "slow_reader" else ("orpheus",))
               for label, extra in flags.items()}
    out: dict[str, Any] = {}
    try:
        await asyncio.gather(*(srv.wait_ready(args.start_timeout) for srv in servers.values()))
        drv = Driver(servers["burst"], max(args.timeout, 120.0), connections=BURST + 16)
        try:
            out["burst"] = await burst_admission(drv)
        finally:
            await drv.close()
        drv = Driver(servers["drain"], args.timeout)
        try:
            jobs = jobs_for(True)
            await references(drv, jobs)
            out["drain"] = await drain_under_load(drv, jobs)
        finally:
            await drv.close()
        drv = Driver(servers["slow_reader"], max(args.timeout, 120.0))
        try:
            out["slow_reader"] = await slow_reader(drv)
        finally:
            await drv.close()
    except Exception as exc:  # reported, not fatal: the fault scenarios' figures still stand
        out["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
    finally:
        for label, srv in servers.items():
            await asyncio.to_thread(srv.stop, 10.0)
            if isinstance(out.get(label), dict):
                out[label]["server_log"] = log_summary(srv.output())
            srv.close(args.keep_logs)
    out["grammar"] = await grammar_stress(args.start_timeout)  # issue 50: abusive grammars beside healthy traffic
    out["media"] = await media_stress(args.start_timeout)  # issue 50: large inputs, media, realtime, a silent client
    if not args.no_partition:  # after the stress servers stopped: its heartbeats need a less busy box
        try:
            log = (f"{os.environ.get('TMPDIR', '/tmp')}/mstar-chaos-partition-worker.log" if args.keep_logs else None)
            out["partition"] = await partition_heal(args.quick, log)
        except Exception as exc:  # reported, not fatal
            out["partition"] = {"error": f"{type(exc).__name__}: {exc}"[-1500:], "partition_recovery_s": None}
    print(f"[stress] {json.dumps({k: {kk: vv for kk, vv in v.items() if not isinstance(vv, dict)} for k, v in out.items() if isinstance(v, dict)})}",
          flush=True)
    return out


async def main_async(args) -> dict[str, Any]:
    started = time.monotonic()
    plan: list[tuple[str, str]] = []
    for rnd in range(0 if args.no_faults else args.rounds):
        # the KV worker (lm) is replaced by its own faults, so the codec's come last in a round: the
        # final page count then sees what requests doomed by the codec left on the LM's worker
        plan += [("stop", "lm"), ("kill", "lm"), ("kill", "codec")] if rnd % 2 == 0 else \
            [("kill", "lm"), ("kill", "codec"), ("stop", "codec")]
    servers: list[Server] = []
    scenarios: dict[str, dict] = {}

    def launch(label: str) -> Server:
        server = Server(label, ["--config", str(PLACEMENT)] if label == "disaggregated" else [])
        server.ready = asyncio.ensure_future(server.wait_ready(args.start_timeout))
        servers.append(server)
        return server

    async def stop(label: str, server: Server) -> None:
        t_stop = time.monotonic()
        code = await asyncio.to_thread(server.stop)  # SIGINT: the server's own clean shutdown
        scenarios[label]["server_stop_s"] = round(time.monotonic() - t_stop, 2)
        scenarios[label]["server_exit_code"] = code
        scenarios[label]["server_log"] = log_summary(server.output())
        if args.keep_logs:
            scenarios[label]["server_log"]["path"] = server.log.name

    if args.stress_only:
        return summarize(scenarios, time.monotonic() - started, args.quick, await run_stresses(args))
    stopping: list[asyncio.Future] = []
    try:
        colocated = launch("colocated")
        # --quick overlaps the slower start (three processes) with the colocated scenario
        split = launch("disaggregated") if args.quick else None
        for label in ("colocated", "disaggregated"):
            if label == "disaggregated" and split is None:
                split = launch("disaggregated")
            server = colocated if label == "colocated" else split
            start_failures: list[str] = []
            while True:
                try:
                    result = await asyncio.wait_for(
                        run_scenario(server, args, faults_plan=plan if label == "disaggregated" else []),
                        args.scenario_limit,
                    )
                except StartError as exc:
                    # a server that fails to start is reported; it gets one more try so the rest can be measured
                    start_failures.append(str(exc)[-1500:])
                    print(f"[{label}] server failed to start (attempt {len(start_failures)}): "
                          f"{str(exc).splitlines()[-1]}", flush=True)
                    if len(start_failures) < 2:
                        await asyncio.to_thread(server.stop)
                        server = launch(label)
                        continue
                    result = {"error": f"StartError: {exc}"[-1500:]}
                except Exception as exc:  # a scenario that cannot run is reported, not fatal
                    msg = f"{type(exc).__name__}: {exc}" if str(exc) else \
                        f"{type(exc).__name__} (limit {args.scenario_limit}s)"
                    print(f"[{label}] scenario failed: {msg}", flush=True)
                    result = {"error": msg[-1500:]}
                break
            result["start_failures"] = start_failures
            scenarios[label] = result
            # the colocated server shuts down while the disaggregated scenario runs (it only waits)
            stopping.append(asyncio.ensure_future(stop(label, server)))
        await asyncio.gather(*stopping)
    finally:
        for task in stopping:
            task.cancel()
        for server in servers:
            if server.ready is not None and not server.ready.done():
                server.ready.cancel()
            server.stop(grace=5.0)
            server.close(args.keep_logs)
    stress = {} if args.no_stress else await run_stresses(args)
    return summarize(scenarios, time.monotonic() - started, args.quick, stress)



def tensor_parallel_figures(tp: dict[str, Any]) -> dict[str, Any]:
    """The TP rank-kill case's headline keys, its details under `tensor_parallel`."""
    keys = ("tp_group_fail_latency_s", "tp_group_recovery_s", "tp_other_replica_failed")
    return {**{k: tp.get(k) for k in keys}, "tensor_parallel": tp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 4 client loops (< 60 s on 2 CPU cores)")
    parser.add_argument("--rounds", type=int, default=None, help="fault rounds (kill each worker, stop one); default 1 quick, 2 full")
    parser.add_argument("--concurrency", type=int, default=None, help="healthy client loops (default 4 quick, 6 full)")
    parser.add_argument("--max-requests", type=int, default=400, help="most requests one client loop sends")
    parser.add_argument("--timeout", type=float, default=None, help="client timeout per request (default 30 quick, 60 full)")
    parser.add_argument("--kill-limit", type=float, default=None, help="most seconds to wait for recovery after a kill")
    parser.add_argument("--stop-window", type=float, default=None,
                        help="seconds a stopped worker is left for supervision before SIGCONT (default 12 quick, 20 full)")
    parser.add_argument("--poison-gap", type=float, default=0.2, help="seconds between poisoned requests")
    parser.add_argument("--tail", type=float, default=None, help="seconds of plain traffic after the poisons / faults")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds between faults after a recovery")
    parser.add_argument("--start-timeout", type=float, default=120.0, help="seconds for a server to become healthy")
    parser.add_argument("--scenario-limit", type=float, default=None, help="hard limit per scenario, seconds")
    parser.add_argument("--no-poisons", action="store_true", help="plain traffic only (calibrates the harness)")
    parser.add_argument("--no-faults", action="store_true", help="no kill/stop (calibrates the harness)")
    parser.add_argument("--no-stress", action="store_true", help="skip the burst, drain and slow-reader servers")
    parser.add_argument("--stress-only", action="store_true", help="only the burst, drain and slow-reader servers")
    parser.add_argument("--no-partition", action="store_true", help="skip the network partition of a namespaced worker")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and print their paths")
    parser.add_argument("--no-tp", action="store_true", help="skip killing a rank of a tensor-parallel group")
    parser.add_argument("--tp-only", action="store_true", help="only kill a rank of a tensor-parallel group")
    args = parser.parse_args()
    q = args.quick
    args.rounds = args.rounds or (1 if q else 2)
    args.concurrency = args.concurrency or (4 if q else 6)
    # only a hang ever waits this long; a busy 2-core box with three servers' processes is slow, not hung
    args.timeout = args.timeout or (30.0 if q else 60.0)
    args.kill_limit = args.kill_limit or (20.0 if q else 30.0)
    args.stop_window = args.stop_window or (12.0 if q else 20.0)
    args.tail = args.tail if args.tail is not None else (1.0 if q else 5.0)
    args.scenario_limit = args.scenario_limit or (240.0 if q else 900.0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def _terminate(signum, frame):  # SIGTERM: unwind through the finally blocks that stop the servers
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = {} if args.tp_only else asyncio.run(main_async(args))
        if not args.no_tp:
            result.update(tensor_parallel_figures(asyncio.run(tp_rank_kill(args))))
    except KeyboardInterrupt:
        print("chaos: interrupted; servers and workers stopped", file=sys.stderr)
        sys.exit(130)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The chaos benchmark's report: per-request classification, per-fault figures, metrics and the final summary."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
from chaos_driver import Driver, Rec
from chaos_faults import Fault

TARGETS = {"healthy_requests_failed": 0, "max_fail_latency_s": 1.5, "recovery_s": 10.0, "pages_leaked": 0}


def fault_report(f: Fault | dict) -> dict:
    if isinstance(f, dict):
        return f
    failed = [r for r in f.in_flight if r.outcome != "ok" and r.t_end is not None]
    latencies = [r.t_fail - f.t for r in failed if r.t_fail is not None]
    recovered = f.recovered_at is not None and (f.sigcont_at is None or f.recovered_at <= f.sigcont_at)

    def rel(x: float | None) -> float | None:
        return None if x is None else round(x - f.t, 3)

    return {
        "kind": f.kind, "worker": f.worker, "pid": f.pid, "at_s": round(f.t, 3),
        "in_flight": len(f.in_flight),
        "in_flight_failed": len(failed),
        "in_flight_completed": sum(1 for r in f.in_flight if r.outcome == "ok"),
        "in_flight_hung": sum(1 for r in failed if r.outcome == "timeout"),
        "in_flight_outcomes": _count(r.outcome for r in f.in_flight),
        "max_fail_latency_s": round(max(latencies), 3) if latencies else None,
        "process_gone_after_s": rel(f.gone_at),
        "replaced_after_s": rel(f.replaced_at),
        "sigcont_after_s": rel(f.sigcont_at),
        "recovery_s": rel(f.recovered_at) if recovered else None,
        "recovered_only_after_sigcont": f.recovered_at is not None and not recovered,
        "success_after_s": rel(f.recovered_at),
        "probes": f.probes,
    }


def phase(r: Rec, faults: list[Fault]) -> str:
    """Which part of the run a request started in: the poisons (before any fault) or after which fault."""
    before = [f for f in faults if f.t <= r.t_start]
    return f"after {before[-1].kind} {before[-1].worker}" if before else "poisons"


def examples(failed: list[Rec], faults: list[Fault], most: int = 8) -> list[dict[str, Any]]:
    """The first failed request of each (phase, outcome), to show what went wrong where."""
    seen: dict[tuple[str, str], Rec] = {}
    for r in failed:
        seen.setdefault((phase(r, faults), r.outcome), r)
    return [{"phase": ph, "outcome": outcome, "kind": r.kind, "name": r.name, "at_s": round(r.t_start, 2),
             "status": r.status, "first_byte_s": None if r.t_first_byte is None else round(r.t_first_byte - r.t_start, 3),
             "detail": r.detail[:200]} for (ph, outcome), r in list(seen.items())[:most]]


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def classify(records: list[Rec], faults: list[Fault]) -> dict[int, str]:
    """ok | in_flight_at_fault | retryable_503 | failed, per healthy or probe request (see the docstring)."""
    out: dict[int, str] = {}
    for r in records:
        if r.kind not in ("healthy", "probe"):
            continue
        end = r.t_end if r.t_end is not None else float("inf")
        if any(r.t_start < f.detected_at and f.t < end for f in faults):
            out[id(r)] = "in_flight_at_fault"
        elif r.outcome == "ok":
            out[id(r)] = "ok"
        else:
            before = [f for f in faults if f.t <= r.t_start]
            last = before[-1] if before else None
            down = last is not None and (last.recovered_at is None or r.t_start < last.recovered_at)
            out[id(r)] = "retryable_503" if down and r.outcome == "http_503" else "failed"
    return out



async def kv_pages(drv: Driver, wait: float) -> dict[str, float]:
    """`mstar_kv_pages_used` series from /metrics, polled until they sum to 0 (or `wait` passes)."""
    deadline = time.monotonic() + wait
    series: dict[str, float] = {}
    while True:
        try:
            text = (await drv.client.get("/metrics", timeout=5.0)).text
            series = {}
            for line in text.split("\n"):
                if line.startswith("mstar_kv_pages_used{") or line.startswith("mstar_kv_pages_used "):
                    key, _, value = line.rpartition(" ")
                    series[key[len("mstar_kv_pages_used"):] or "{}"] = float(value)
        except httpx.HTTPError as exc:
            series = {"error": float("nan")}
            print(f"  /metrics failed: {exc}", flush=True)
        if (series and sum(series.values()) == 0) or time.monotonic() > deadline:
            return series
        await asyncio.sleep(0.25)


def covers(series: str, node: str) -> bool:
    """Whether a series' labels name this node (`node="lm"`, or a qualified `orpheus/lm`)."""
    values = re.findall(r'="([^"]*)"', series)
    return any(v == node or v.endswith("/" + node) for v in values)


def log_summary(text: str) -> dict[str, Any]:
    lines = text.splitlines()
    errors = [ln for ln in lines if re.search(r"\b(ERROR|CRITICAL)\b", ln)]
    return {
        "tracebacks": sum(1 for ln in lines if ln.startswith("Traceback")),
        "error_lines": len(errors),
        "first_errors": [ln[-240:] for ln in errors[:6]],
        "worker_restarts_logged": sum(1 for ln in lines if "restarted" in ln and "reloaded" in ln),
    }



def fault_figures(reports: list[dict]) -> dict[str, Any]:
    """max_fail_latency_s / recovery_s over some faults, and whether each target holds for all of them."""
    lat = [r["max_fail_latency_s"] for r in reports if r.get("max_fail_latency_s") is not None]
    rec = [r.get("recovery_s") for r in reports]
    unrecovered = [f"{r['kind']} {r['worker']}" for r in reports if r.get("recovery_s") is None]
    measured = [r for r in reports if "error" not in r and r["in_flight"] > 0]
    return {
        "max_fail_latency_s": max(lat) if lat else None,
        "recovery_s": None if (not rec or unrecovered) else max(rec),
        "unrecovered_faults": unrecovered,
        # every fault hit requests in flight, and each of those that failed did so in time
        "fail_latency_met": bool(reports) and len(measured) == len(reports)
        and all(r["max_fail_latency_s"] is None or r["max_fail_latency_s"] <= TARGETS["max_fail_latency_s"]
                for r in measured) and all(r["in_flight_hung"] == 0 for r in measured),
        "recovery_met": bool(reports) and not unrecovered and max(rec) <= TARGETS["recovery_s"],
    }


def _stress_5xx(stress: dict[str, Any]) -> int | None:
    """5xx answers of issue 50's stresses (grammar and media) together; None if either did not report."""
    counts = [stress.get("grammar", {}).get("grammar_stress_5xx"), stress.get("media", {}).get("media_stress_5xx")]
    return None if any(c is None for c in counts) else sum(counts)


def summarize(scenarios: dict[str, dict], wall: float, quick: bool, stress: dict[str, Any] | None = None) -> dict[str, Any]:
    ran = [s for s in scenarios.values() if "error" not in s]
    errors = {k: s["error"] for k, s in scenarios.items() if "error" in s}
    healthy_failed = sum(s["healthy_requests_failed"] for s in ran)
    figures = fault_figures([r for s in ran for r in s.get("faults", [])])
    max_lat, recovery = figures["max_fail_latency_s"], figures["recovery_s"]
    pages = [s["pages_leaked"] for s in ran]
    pages_leaked = None if (not pages or any(p is None for p in pages)) else sum(pages)
    p4 = sum(s["poisoned_4xx"] for s in ran)
    ptotal = sum(s["poisoned_total"] for s in ran)
    complete = not errors and len(ran) == len(scenarios)
    met = {
        "healthy_requests_failed": complete and healthy_failed == TARGETS["healthy_requests_failed"],
        "max_fail_latency_s": complete and figures["fail_latency_met"],
        "recovery_s": complete and figures["recovery_met"],
        "pages_leaked": complete and pages_leaked == TARGETS["pages_leaked"],
        "poisoned_4xx": complete and ptotal > 0 and p4 == ptotal,
    }
    return {
        "benchmark": "chaos",
        "quick": quick,
        "healthy_requests_failed": healthy_failed,
        "max_fail_latency_s": max_lat,
        "recovery_s": recovery,
        "pages_leaked": pages_leaked,
        "poisoned_4xx": p4,
        "poisoned_total": ptotal,
        "targets": {**TARGETS, "poisoned_4xx": "== poisoned_total"},
        "targets_met": met,
        "all_targets_met": all(met.values()),
        # issue 31's stresses (null where not run): a burst against 4 + 4, SIGTERM under load, a slow reader, a
        # partition of a namespaced worker's link and its heal
        "burst_503_exact": (stress or {}).get("burst", {}).get("burst_503_exact"),
        "drain_lost": (stress or {}).get("drain", {}).get("drain_lost"),
        "partition_recovery_s": (stress or {}).get("partition", {}).get("partition_recovery_s"),
        "slow_client_rss_growth_mb": (stress or {}).get("slow_reader", {}).get("slow_client_rss_growth_mb"),
        # issue 50: grammars (chaos_grammar.py)
        "grammar_stress_health_max_s": (stress or {}).get("grammar", {}).get("grammar_stress_health_max_s"),
        "sigterm_exit_s": (stress or {}).get("grammar", {}).get("sigterm_exit_s"),
        # issue 50: large inputs and media (chaos_media.py), and both stresses together
        "media_stress_health_max_s": (stress or {}).get("media", {}).get("media_stress_health_max_s"),
        "stress_5xx": _stress_5xx(stress or {}),
        "stress_rss_growth_mb": (stress or {}).get("media", {}).get("media_rss_growth_mb"),
        "silent_client_freed_s": (stress or {}).get("media", {}).get("silent_client_freed_s"),
        "stress": stress or {},
        "scenario_errors": errors,
        "server_start_failures": sum(len(s.get("start_failures", [])) for s in scenarios.values()),
        "wall_s": round(wall, 1),
        "scenarios": scenarios,
    }


"""Prometheus metrics (`mstar_` prefix): request counters and latency histograms, engine gauges at scrape time."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# engine stat keys exported under their own metric names; every numeric stat also goes to mstar_node_stat
_NAMED_STATS = {
    "kv_pages_used": ("mstar_kv_pages_used", "KV cache pages in use"),
    "kv_pages_free": ("mstar_kv_pages_free", "KV cache pages free"),
    "prefix_cache_hit_rate": ("mstar_prefix_cache_hit_rate", "fraction of prompt tokens served from the prefix cache"),
}


class Metrics:
    """All metrics of one server, in their own registry (so several servers can live in one process)."""

    def __init__(self, engine: Any, video_jobs: Any = None):
        self.engine = engine
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mstar_requests", "HTTP requests by model, route and status", ["model", "route", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "mstar_time_to_first_token_seconds", "time from request to first generated token", ["model"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.ttfa = Histogram(
            "mstar_time_to_first_audio_seconds", "time from request to first audio bytes", ["model"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.audio_seconds = Counter(
            "mstar_audio_seconds", "seconds of audio sent by the speech route (with its latency: the real-time factor)",
            ["model"], registry=self.registry,
        )
        self.latency = Histogram(
            "mstar_request_latency_seconds", "end-to-end request latency", ["model", "route"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))
        if video_jobs is not None:
            self.registry.register(_VideoJobCollector(video_jobs))

    def observe_request(self, model: str, route: str, status: int, seconds: float | None = None) -> None:
        # a label per client-chosen name would let any client grow the metrics without bound
        if model != "-" and model not in (getattr(self.engine, "models", None) or {}):
            model = "unknown"
        self.requests.labels(model, route, str(status)).inc()
        if seconds is not None and status < 400:
            self.latency.labels(model, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads `AsyncEngine` state when Prometheus scrapes: queue, running, per-node engine and scheduler gauges."""

    def __init__(self, engine: Any, video_jobs: Any = None):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        engine = self.engine
        queue = GaugeMetricFamily("mstar_queue_depth", "requests waiting for a running slot")
        running = GaugeMetricFamily("mstar_running_requests", "requests executing")
        queue.add_metric([], float(getattr(engine, "waiting", 0)))
        running.add_metric([], float(getattr(engine, "running", 0)))
        yield queue
        yield running
        # `worker` tells replicas apart: "local" for engines in this process, else the worker (replica) name
        named = {key: GaugeMetricFamily(name, doc, labels=["model", "node", "worker"])
                 for key, (name, doc) in _NAMED_STATS.items()}
        every = GaugeMetricFamily("mstar_node_stat", "every numeric gauge an engine reports",
                                  labels=["model", "node", "worker", "stat"])
        batch = GaugeMetricFamily("mstar_node_batch_size", "invocations in the node's last step", labels=["model", "node"])
        step = GaugeMetricFamily("mstar_node_step_latency_seconds", "duration of the node's last step", labels=["model", "node"])
        steps = GaugeMetricFamily("mstar_node_steps", "steps the node has run", labels=["model", "node"])
        busy = CounterMetricFamily("mstar_node_step_seconds", "wall time the node's steps took (its rate: the share "
                                   "of time the node computes)", labels=["model", "node"])
        calls = GaugeMetricFamily("mstar_node_invocations", "invocations the node has run", labels=["model", "node"])
        for model in list(getattr(engine, "models", {}) or {}):
            try:
                gauges = _node_gauges(engine, model)
            except Exception:  # model unloading while scraped
                continue
            for node, worker, stats in gauges:
                for key, value in _derived(stats).items():
                    if not isinstance(key, str) or not isinstance(value, int | float) or isinstance(value, bool):
                        continue
                    if key in named:
                        named[key].add_metric([model, node, worker], float(value))
                    every.add_metric([model, node, worker, key], float(value))
            schedulers = engine.node_schedulers(model) if hasattr(engine, "node_schedulers") else {}
            for node, sched in schedulers.items():
                batch.add_metric([model, node], float(getattr(sched, "last_batch_size", 0)))
                step.add_metric([model, node], float(getattr(sched, "last_step_seconds", 0.0)))
                steps.add_metric([model, node], float(getattr(sched, "steps", 0)))
                busy.add_metric([model, node], float(getattr(sched, "step_seconds_total", 0.0)))
                calls.add_metric([model, node], float(getattr(sched, "invocations", 0)))
        yield from named.values()
        yield every
        yield from _worker_metrics(engine)
        yield from _link_metrics(engine)
        yield from _peer_metrics(engine)
        yield batch
        yield step
        yield steps
        yield busy
        yield calls
        yield _native_kernel_metric()


class _VideoJobCollector:
    """The `/v1/videos` job store at scrape time: jobs by status, jobs finished by how they ended, MP4 bytes kept.
    (What the engines hold for a running job is on `mstar_node_stat`, e.g. the diffusion engine's
    `diffusion_held_bytes`.)"""

    def __init__(self, store: Any):
        self.store = store

    def describe(self):
        return []

    def collect(self):
        jobs = GaugeMetricFamily("mstar_video_jobs", "video jobs the server holds, by status (queued, in_progress, "
                                 "completed, failed; deleted jobs are gone)", labels=["model", "status"])
        finished = CounterMetricFamily("mstar_video_jobs_finished", "video jobs ended since start, by how "
                                       "(completed, failed, deleted)", labels=["model", "ending"])
        held = GaugeMetricFamily("mstar_video_job_bytes", "bytes of finished MP4s kept for download until their "
                                 "retention time", labels=["model"])
        for model, stats in sorted(self.store.stats().items()):
            for key, value in stats.items():
                if key.startswith("jobs_"):
                    jobs.add_metric([model, key.removeprefix("jobs_")], value)
                elif key.startswith("finished_"):
                    finished.add_metric([model, key.removeprefix("finished_")], value)
            held.add_metric([model], stats["mp4_bytes"])
        yield jobs
        yield finished
        yield held


def _native_kernel_metric():
    from mstar_core.nn import native  # (at scrape: this module is imported before torch is)

    gauge = GaugeMetricFamily("mstar_native_kernels", "C++ CPU kernels this process loaded (1): the instruction-set "
                              "level, and prebuilt, jit (built here) or none (torch ops)", labels=["kernel", "level", "build"])
    for kernel, (level, build) in native.active().items():
        gauge.add_metric([kernel, level, build], 1.0)
    return gauge


def _worker_metrics(engine: Any):
    """One info sample per live worker process: its name, pid and host (a restart shows up as a new pid)."""
    cluster = getattr(engine, "cluster", None)
    if cluster is None or not hasattr(cluster, "worker_processes"):
        return
    info = GaugeMetricFamily("mstar_worker_info", "a live worker process (1): its pid and host, as it said on joining",
                             labels=["worker", "pid", "host"])
    for worker, (pid, host) in sorted(cluster.worker_processes().items()):
        info.add_metric([worker, str(pid), host], 1.0)
    yield info


def _link_metrics(engine: Any):
    """Which transport each worker link uses, the bytes each end moved, and the round trip of node calls."""
    cluster = getattr(engine, "cluster", None)
    if cluster is None or not hasattr(cluster, "link_stats"):
        return
    moved = GaugeMetricFamily("mstar_link_bytes", "bytes of messages through a worker link",
                              labels=["worker", "transport", "end", "direction"])
    offloaded = GaugeMetricFamily("mstar_link_offloaded_bytes", "bytes the transport carried off the control socket",
                                  labels=["worker", "transport", "end"])
    rtt = GaugeMetricFamily("mstar_link_round_trip_seconds", "node calls through the link, send to answer (EWMA)",
                            labels=["worker", "transport"])
    # by message kind (a fixed set of wire tags): what passes through the serving process, e.g. only control
    # messages when tensors go worker to worker
    messages = CounterMetricFamily("mstar_link_messages", "messages the serving process sent to or received from "
                                   "a worker, by kind", labels=["worker", "direction", "message"])
    message_bytes = CounterMetricFamily("mstar_link_message_bytes", "bytes of the messages the serving process sent "
                                        "to or received from a worker, by kind", labels=["worker", "direction", "message"])
    # a worker sends what one turn of its event loop produced as one socket message (`wire.batch`)
    sockets = CounterMetricFamily("mstar_link_socket_messages", "sealed socket messages the serving process "
                                  "received from a worker (each carries one or more messages)", labels=["worker"])
    for worker, link in cluster.link_stats().items():
        if isinstance(link.get("socket_messages_received"), int):
            sockets.add_metric([worker], float(link["socket_messages_received"]))
        for direction, by_tag in (link.get("messages") or {}).items():
            for tag, counted in by_tag.items():
                messages.add_metric([worker, direction, tag], float(counted["count"]))
                message_bytes.add_metric([worker, direction, tag], float(counted["bytes"]))
        transport = str(link["transport"])
        for end in ("server", "worker"):
            stats = link.get(end) or {}
            for direction in ("sent", "received"):
                if isinstance(stats.get(f"{direction}_bytes"), int | float):
                    moved.add_metric([worker, transport, end, direction], float(stats[f"{direction}_bytes"]))
            if isinstance(stats.get("offloaded_bytes"), int | float):
                offloaded.add_metric([worker, transport, end], float(stats["offloaded_bytes"]))
        if link.get("round_trip_s") is not None:
            rtt.add_metric([worker, transport], float(link["round_trip_s"]))
    yield moved
    yield offloaded
    yield rtt
    yield messages
    yield message_bytes
    yield sockets


#: a worker's peer-line counters (`PeerMailbox.stats()`, from its heartbeats): metric -> (help, stat per direction)
_PEER_COUNTERS = {
    "mstar_peer_stream_items": ("stream items sent straight to or received from another worker",
                                {"sent": "stream_sent_items", "received": "stream_received_items"}),
    "mstar_peer_stream_bytes": ("bytes of stream items sent straight to or received from another worker",
                                {"sent": "stream_sent_bytes", "received": "stream_received_bytes"}),
    # several items one event-loop turn seals for a worker travel as one message
    "mstar_peer_stream_messages": ("messages that carried a worker's stream items to another worker",
                                   {"sent": "stream_messages_sent"}),
    "mstar_peer_moves": ("per-walk state moves sent straight to or received from another worker",
                         {"sent": "sent_moves", "received": "received_moves"}),
    "mstar_peer_move_bytes": ("bytes of per-walk state moves sent straight to or received from another worker",
                              {"sent": "sent_bytes", "received": "received_bytes"}),
}


def _peer_metrics(engine: Any):
    """Per worker, what went worker to worker on its peer line (stream items, state moves), not through here."""
    cluster = getattr(engine, "cluster", None)
    if cluster is None or not hasattr(cluster, "link_stats"):
        return
    # counters: they only grow while a worker lives (a restarted worker starts again at 0, which Prometheus reads
    # as a counter reset)
    counters = {name: CounterMetricFamily(name, doc, labels=["worker", "direction"])
                for name, (doc, _) in _PEER_COUNTERS.items()}
    late = CounterMetricFamily("mstar_peer_stream_late_items", "stream items that reached a worker after their "
                               "consumer ended (a cancelled request's items still in flight)", labels=["worker"])
    refused = CounterMetricFamily("mstar_peer_refused", "messages a worker's peer line dropped (forged, replayed, "
                                  "out of order, or beyond its bounds)", labels=["worker"])
    open_ = GaugeMetricFamily("mstar_peer_streams_open", "streams a worker's peer line holds now", labels=["worker"])
    for worker, link in cluster.link_stats().items():
        peer = link.get("peer") or {}
        for name, (_, stats) in _PEER_COUNTERS.items():
            for direction, key in stats.items():
                if _number(peer.get(key)):
                    counters[name].add_metric([worker, direction], float(peer[key]))
        for family, key in ((late, "stream_late_items"), (refused, "refused"), (open_, "streams_open")):
            if _number(peer.get(key)):
                family.add_metric([worker], float(peer[key]))
    yield from counters.values()
    yield late
    yield refused
    yield open_


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _node_gauges(engine: Any, model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(node, worker, stats) of every engine serving `model`, in this process and in worker processes."""
    if hasattr(engine, "node_stats"):
        return engine.node_stats(model)
    out = []
    for node, eng in engine.node_engines(model).items():
        try:
            out.append((node, "local", eng.stats() or {}))
        except Exception:
            out.append((node, "local", {}))
    return out


def _derived(stats: dict[str, Any]) -> dict[str, Any]:
    """Fill the standard gauges from what engines report under other names (free = total - used, hit rate)."""
    out = dict(stats)
    if "kv_pages_free" not in out and "kv_pages_total" in out and "kv_pages_used" in out:
        out["kv_pages_free"] = out["kv_pages_total"] - out["kv_pages_used"]
    if "prefix_cache_hit_rate" not in out:
        hits, lookups = out.get("kv_prefix_hit_pages"), out.get("kv_prefix_lookup_pages")
        if isinstance(hits, int | float) and isinstance(lookups, int | float) and lookups > 0:
            out["prefix_cache_hit_rate"] = hits / lookups
    return out

"""Every metric examples/grafana/mstar-dashboard.json queries is one the server exports (names from
mstar_core/api/server/metrics.py, and the registry's own rendering for the serving process's metrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mstar_core.api.server import metrics as metrics_module
from mstar_core.api.server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "mstar-dashboard.json"
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _queried() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(t["datasource"]["type"] == "prometheus" for p in dash["panels"] for t in p["targets"])
    return {m for e in exprs for m in re.findall(r"\bmstar_[a-z_]+\b", e)}


def _base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_queried_metric_is_declared_by_the_server():
    declared = set(re.findall(r'"(mstar_[a-z_]+)"', Path(metrics_module.__file__).read_text()))
    missing = sorted(m for m in _queried() if m not in declared and _base(m) not in declared)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"


def test_the_serving_process_metrics_render_under_the_queried_names():
    class Engine:  # what the collector reads of an AsyncEngine with no model loaded
        models: dict = {}
        waiting = running = 0
        cluster = None

    text = Metrics(Engine()).render().decode()
    rendered = set(re.findall(r"^(mstar_[a-z_]+)", text, flags=re.M))
    rendered |= set(re.findall(r"^# TYPE (mstar_[a-z_]+)", text, flags=re.M))
    local = {"mstar_requests_total", "mstar_time_to_first_audio_seconds_bucket", "mstar_audio_seconds_total",
             "mstar_request_latency_seconds_bucket", "mstar_request_latency_seconds_sum", "mstar_queue_depth",
             "mstar_running_requests"}
    assert local <= _queried()
    for name in local:
        assert name in rendered or _base(name) in rendered, name

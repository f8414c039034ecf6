"""/metrics names each live worker's process (`mstar_worker_info{worker, pid, host}`): what chaos tests signal.

The unit test reads the cluster's worker states as they stand after a Hello and after a loss; the
end-to-end test kills the pid /metrics gave for a spawned worker (a fork of the worker zygote, whose
command line is the zygote's) and sees the same name come back under its replacement's pid.
"""

import os
import signal
import socket
import time
from types import SimpleNamespace

import pytest

from mstar_core.api.server.metrics import Metrics
from mstar_core.cluster.strategy import placed_engine
from mstar_core.cluster.worker_link import WorkerLink
from mstar_core.cluster.worker_pool import WorkerPool
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import until
from tests.cluster.test_metrics_peer import samples

pytestmark = pytest.mark.timeout(120)


def worker_info(metrics: Metrics) -> dict[str, tuple[int, str]]:
    """worker -> (pid, host) from one scrape, checking every sample is an info sample (value 1)."""
    out = {}
    for (name, labels), value in samples(metrics.render().decode()).items():
        if name == "mstar_worker_info":
            labels = dict(labels)
            assert value == 1.0 and labels["worker"] not in out
            out[labels["worker"]] = (int(labels["pid"]), labels["host"])
    return out


def joined(name: str, pid: int | None, host: str = "h1") -> WorkerLink:
    state = WorkerLink(name, SimpleNamespace(transport="zmq"))
    state.pid, state.host, state.alive = pid, host, pid is not None
    return state


def test_worker_info_lists_live_workers_with_the_pid_of_their_hello():
    workers = {"lm": joined("lm", 4242), "codec": joined("codec", 77, "h2"), "late": joined("late", None)}
    cluster = SimpleNamespace(workers=workers, link_stats=lambda: {})
    cluster.worker_processes = lambda: WorkerPool.worker_processes(cluster)
    metrics = Metrics(SimpleNamespace(cluster=cluster, models={}))
    assert worker_info(metrics) == {"lm": (4242, "h1"), "codec": (77, "h2")}  # "late" never joined: no pid
    workers["lm"].lost("exited with code -9")  # its old pid is no one to signal any more
    assert worker_info(metrics) == {"codec": (77, "h2")}
    assert worker_info(Metrics(SimpleNamespace(models={}))) == {}  # no cluster (everything in-process): no samples


@pytest.mark.slow
async def test_the_pid_on_metrics_is_the_workers_process_and_changes_with_its_replacement():
    placement = Placement.from_dict({"workers": {"gen": {}}, "nodes": {"gen": "gen"}})
    engine = placed_engine(discover())
    await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
    metrics = Metrics(engine)
    state = engine.cluster.workers["gen"]
    try:
        (pid, host), = worker_info(metrics).values()
        assert pid == state.process.pid != os.getpid() and host == socket.gethostname()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        await until(lambda: "gen" not in worker_info(metrics), 5, "the killed worker off /metrics")
        await until(lambda: worker_info(metrics).get("gen", (pid,))[0] != pid, 30, "its replacement on /metrics")
        new = worker_info(metrics)["gen"][0]
        assert new == state.process.pid and state.process.poll() is None and time.monotonic() - killed < 30
        await until(lambda: state.ready, 30, "the replacement ready")
        outs = [o.value async for o in engine.submit("fixture-stream", {"start": 0, "stop": 3}) if o.name == "token"]
        assert outs == [0, 1, 2, 3]  # it serves: the listed process is the one doing the work
    finally:
        await engine.close()

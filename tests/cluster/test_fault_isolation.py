"""Worker faults stay with the worker's own requests (issue 10, findings 4, 5, 7 and 8).

Timing assertions are tight only where the issue sets a bound (requests fail within about a
second of a worker dying or hanging); joins and restarts get generous timeouts, since these tests
share a small machine with others.
"""

import asyncio
import os
import signal
import time
import zlib

import pytest

from mstar_core.api.server.metrics import Metrics
from mstar_core.cluster.cluster import WorkerLost
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.cluster.helpers import kill_mid_request, until

pytestmark = pytest.mark.timeout(180)


async def served(placement: dict, model: str = "fixture-stream") -> AsyncEngine:
    engine = placed_engine(discover())
    await engine.load_model(model, LoadOptions(preset="tiny"), placement=Placement.from_dict(placement))
    return engine


async def first(handle, name: str):
    async for out in handle:
        if out.name == name:
            return out.value
    raise AssertionError(f"the request ended without a '{name}' output")


async def test_a_hung_worker_is_killed_and_replaced_and_its_requests_fail_within_about_a_second():
    engine = await served({"workers": {"gen": {}}, "nodes": {"gen": "gen"},
                           "engine_settings": {"gen": {"step_delay": 0.01}}, "control": {"heartbeat_interval": 0.2}})
    gen = engine.cluster.workers["gen"]
    hung = gen.process
    try:
        handle = engine.submit("fixture-stream", {"start": 0, "stop": 10**6})
        await first(handle, "token")
        os.kill(hung.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(WorkerLost, match="heartbeats"):
            await asyncio.wait_for(handle.result(), 15)
        assert time.monotonic() - stopped_at < 2.0  # ~1 s of silence, then at once
        # the stuck process is killed, not left to wake up later, and a new one serves
        assert await asyncio.to_thread(hung.wait, 10) == -signal.SIGKILL
        await until(lambda: gen.ready and gen.process is not hung, 60, "the replacement worker")
        assert gen.restarts == 1
        assert (await asyncio.wait_for(engine.generate("fixture-stream", {"start": 2, "stop": 9}), 30))["token"] == 9
    finally:
        if hung.poll() is None:
            os.kill(hung.pid, signal.SIGCONT)
            hung.kill()
        await engine.close()


async def test_a_dead_stream_consumer_fails_its_requests_at_once_and_the_producer_stops():
    engine = await served({"workers": {"gen": {}, "codec": {}}, "nodes": {"gen": "gen", "sum": "codec"},
                           "engine_settings": {"gen": {"step_delay": 0.01}}, "control": {"heartbeat_interval": 0.2}})
    gen, codec = engine.cluster.workers["gen"], engine.cluster.workers["codec"]
    try:
        # killed once the consumer (on `codec`) has run
        await kill_mid_request(engine, "fixture-stream", {"start": 0, "stop": 10**6}, "codec", "total")
        # the producer's loop (delegated to `gen`) was stopped and freed, not left running to its end
        beat = time.monotonic()
        await until(lambda: gen.last_seen > beat + 0.3 and gen.load["fixture-stream/gen"]["active"] == 0.0, 10,
                    "the producer to free the request")
        # a new request while the codec is down is refused at submit (a clean 503 before any route
        # sends its 200) instead of starting its producer and streaming a truncated result
        if not codec.ready:
            with pytest.raises(WorkerLost, match="codec"):
                engine.submit("fixture-stream", {"start": 0, "stop": 10**6})
        await until(lambda: codec.ready, 60, "the codec worker to come back")
        out = await asyncio.wait_for(engine.generate("fixture-stream", {"start": 0, "stop": 7}), 30)
        assert out["token"] == 7 and len(out["total"]) == 2
    finally:
        await engine.close()


async def test_new_requests_go_to_a_healthy_replica_while_one_restarts():
    engine = await served({"workers": {"gen": {"replicas": 2}}, "nodes": {"gen": "gen"},
                           "control": {"heartbeat_interval": 0.2}})
    down = engine.cluster.workers["gen.0"]
    try:
        ids = [f"new-{i}" for i in range(8)]
        assert any(zlib.crc32(rid.encode()) % 2 == 0 for rid in ids)  # some would hash to gen.0
        engine.cluster.kill("gen.0")
        await until(lambda: not down.ready, 10, "gen.0 to be declared lost")
        handles = [engine.submit("fixture-stream", {"start": 0, "stop": 5}, request_id=rid) for rid in ids]
        for h in handles:
            assert (await asyncio.wait_for(h.result(), 30))["token"] == 5
        assert not down.ready  # all of that happened while gen.0 was still restarting
        await until(lambda: down.ready, 60, "gen.0 to come back")
        sched = engine.node_schedulers("fixture-stream")["gen"]
        again = [engine.submit("fixture-stream", {"start": 1, "stop": 4}, request_id=f"again-{i}") for i in range(6)]
        assert {sched.replica_for(h.request_id) for h in again} == {"gen.0", "gen.1"}  # both replicas serve again
        for h in again:
            assert (await asyncio.wait_for(h.result(), 30))["token"] == 4
    finally:
        await engine.close()


async def test_metrics_export_the_gauges_of_engines_in_workers():
    engine = await served({"workers": {"gen": {"replicas": 2}}, "nodes": {"gen": "gen"},
                           "engine_settings": {"gen": {"step_delay": 0.01}}, "control": {"heartbeat_interval": 0.2}})
    try:
        handle = engine.submit("fixture-stream", {"start": 0, "stop": 10**6}, request_id="held")
        await first(handle, "token")
        holder = engine.node_schedulers("fixture-stream")["gen"].replica_for("held")
        workers = engine.cluster.workers
        await until(lambda: workers[holder].load.get("fixture-stream/gen", {}).get("active") == 1.0 and
                    all("fixture-stream/gen" in workers[r].load for r in ("gen.0", "gen.1")), 10, "heartbeats")
        text = Metrics(engine).render().decode()
        for replica in ("gen.0", "gen.1"):
            held = "1.0" if replica == holder else "0.0"
            assert f'mstar_node_stat{{model="fixture-stream",node="gen",stat="active",worker="{replica}"}} {held}' \
                in text, text
        handle.cancel()
    finally:
        await engine.close()


async def test_a_client_error_in_a_worker_stays_a_client_error():
    engine = placed_engine(discover())
    placement = Placement.from_dict({"workers": {"w": {}}, "nodes": {"bump": "w"}})
    await engine.load_model("fixture-blob", LoadOptions(), placement=placement)
    try:
        with pytest.raises(RequestError, match="not 'reject'") as raised:  # raised by the node, in the worker
            await asyncio.wait_for(engine.generate("fixture-blob", {"x": "reject"}), 15)
        assert raised.value.status == 422
        with pytest.raises(RequestError, match="64 bits") as raised:  # cannot even be sent to the worker
            await asyncio.wait_for(engine.generate("fixture-blob", {"x": 2**64}), 15)
        assert raised.value.status == 400 and not isinstance(raised.value, WorkerLost)
        assert (await engine.generate("fixture-blob", {"x": 41}))["y"] == 42  # the worker serves on
    finally:
        await engine.close()


async def test_a_client_error_inside_a_delegated_loop_stays_a_client_error():
    engine = await served({"workers": {"gen": {}}, "nodes": {"gen": "gen"}})
    try:
        assert engine._runtime("fixture-stream").conductor.remote_loops  # the loop runs on the worker
        with pytest.raises(RequestError, match="start -2 is refused") as raised:
            await asyncio.wait_for(engine.generate("fixture-stream", {"start": -2, "stop": 5}), 15)
        assert raised.value.status == 422
    finally:
        await engine.close()


async def test_a_hung_hand_joined_worker_replaced_meanwhile_is_told_to_leave_when_it_wakes(monkeypatch):
    import socket
    import subprocess
    import sys

    secret = "correct horse battery staple"
    monkeypatch.setenv("MSTAR_SECRET", secret)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def join():
        return subprocess.Popen([sys.executable, "-m", "mstar_core.cluster.worker", "--join", address, "--name", "far"],
                                env={**os.environ, "MSTAR_JOIN_TIMEOUT": "30"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    placement = Placement.from_dict({"workers": {"far": {"host": "127.0.0.2"}}, "nodes": {"gen": "far"},
                                     "control": {"bind": address, "heartbeat_interval": 0.2}})
    engine = placed_engine(discover())
    first_worker = join()
    second_worker = None
    try:
        await asyncio.wait_for(engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement), 90)
        far = engine.cluster.workers["far"]
        os.kill(first_worker.pid, signal.SIGSTOP)
        await until(lambda: not far.alive, 10, "the hung worker to be declared lost")
        with pytest.raises(WorkerLost):
            await engine.generate("fixture-stream", {"start": 0, "stop": 3})
        second_worker = join()  # the operator starts a replacement
        await until(lambda: far.ready, 60, "the new worker to join and reload the model")
        assert far.pid == second_worker.pid
        # the first wakes up: its old session earns it a Shutdown (the name is taken: no rejoin), nothing more
        os.kill(first_worker.pid, signal.SIGCONT)
        out, _ = await asyncio.to_thread(first_worker.communicate, timeout=30)
        assert first_worker.returncode == 0 and "declared this worker lost" in out and "replaced" in out
        assert far.pid == second_worker.pid
        assert (await asyncio.wait_for(engine.generate("fixture-stream", {"start": 0, "stop": 3}), 30))["token"] == 3
    finally:
        await engine.close()
        for p in (first_worker, second_worker):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()


@pytest.mark.slow  # ~30 s on a busy 2-core box (a worker process, a load, a reload)
async def test_a_hung_hand_joined_worker_nobody_replaced_joins_again_when_it_wakes(monkeypatch):
    """What a network partition looks like from here: the same process comes back, rejoins and is reloaded."""
    import socket
    import subprocess
    import sys

    monkeypatch.setenv("MSTAR_SECRET", "correct horse battery staple")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    placement = Placement.from_dict({"workers": {"far": {"host": "127.0.0.2"}}, "nodes": {"gen": "far"},
                                     "control": {"bind": address, "heartbeat_interval": 0.2}})
    engine = placed_engine(discover())
    worker = subprocess.Popen([sys.executable, "-m", "mstar_core.cluster.worker", "--join", address, "--name", "far"],
                              env={**os.environ, "MSTAR_JOIN_TIMEOUT": "30"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        await asyncio.wait_for(engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement), 90)
        far = engine.cluster.workers["far"]
        restarts = far.restarts
        os.kill(worker.pid, signal.SIGSTOP)
        await until(lambda: not far.alive, 10, "the hung worker to be declared lost")
        os.kill(worker.pid, signal.SIGCONT)
        await until(lambda: far.ready and far.restarts > restarts, 60, "the worker to join again and be reloaded")
        assert far.pid == worker.pid and worker.poll() is None
        assert (await asyncio.wait_for(engine.generate("fixture-stream", {"start": 0, "stop": 3}), 30))["token"] == 3
    finally:
        await engine.close()
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()

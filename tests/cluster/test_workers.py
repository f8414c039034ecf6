"""Multi-process serving: worker processes, identical results, supervision, hand-joined workers."""

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from mstar_core.cluster.cluster import WorkerLost
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from tests.cluster.helpers import shm_segments

pytestmark = pytest.mark.timeout(120)


async def run(engine, start, stop, model="fixture-stream"):
    handle = engine.submit(model, {"start": start, "stop": stop})
    tokens, totals = [], []
    async for out in handle:
        if out.name == "token":
            tokens.append(out.value)
        else:
            totals.append(out.value.clone())
    return tokens, totals


async def test_colocated_and_disaggregated_give_identical_outputs():
    colocated = placed_engine(discover())
    await colocated.load_model("fixture-stream", LoadOptions(preset="tiny"))
    expected = [await run(colocated, s, s + 9) for s in (0, 5)]
    await colocated.close()

    placement = Placement.from_dict({"workers": {"gen": {}, "codec": {}}, "nodes": {"gen": "gen", "sum": "codec"}})
    split = placed_engine(discover())
    await split.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
    got = [await run(split, s, s + 9) for s in (0, 5)]
    procs = [w.process for w in split.cluster.workers.values()]
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    pids = [os.getpid(), *(p.pid for p in procs)]
    await split.close()
    for (t1, s1), (t2, s2) in zip(expected, got, strict=True):
        assert t1 == t2
        assert all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True)) and len(s1) == len(s2)
    assert all(p.poll() is not None for p in procs)  # workers exit with the server
    assert shm_segments(*pids) == []  # only ours: other xdist workers make and drop their own meanwhile


async def test_killed_worker_fails_its_requests_fast_and_comes_back():
    placement = Placement.from_dict(
        {
            "workers": {"gen": {"replicas": 2}},
            "nodes": {"gen": "gen"},
            "engine_settings": {"gen": {"step_delay": 0.02}},
            "control": {"heartbeat_interval": 0.2},
        }
    )
    engine = placed_engine(discover())
    await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
    sched = engine.node_schedulers("fixture-stream")["gen"]
    handles = [engine.submit("fixture-stream", {"start": 0, "stop": 10_000}, request_id=f"r{i}") for i in range(8)]
    short = [engine.submit("fixture-stream", {"start": 0, "stop": 60}, request_id=f"s{i}") for i in range(8)]
    victims = {h.request_id for h in handles + short if sched.replica_for(h.request_id) == "gen.0"}
    assert victims and len(victims) < 16  # both replicas serve some requests
    await asyncio.sleep(0.3)
    killed_at = time.monotonic()
    engine.cluster.kill("gen.0")
    for h in handles + short:
        if h.request_id in victims:
            with pytest.raises(WorkerLost, match="worker .gen.0. exited"):
                await h.result()
            assert time.monotonic() - killed_at < 2.0
    for h in short:
        if h.request_id not in victims:
            assert (await h.result())["token"] == 60  # the other replica kept serving
    for h in handles:
        h.cancel()
    deadline = time.monotonic() + 30
    while not engine.cluster.workers["gen.0"].ready and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.cluster.workers["gen.0"].restarts == 1
    # new requests succeed on both replicas, the restarted one included
    new = [engine.submit("fixture-stream", {"start": 3, "stop": 9}, request_id=f"n{i}") for i in range(6)]
    assert {sched.replica_for(h.request_id) for h in new} == {"gen.0", "gen.1"}
    for h in new:
        assert (await h.result())["token"] == 9
    await engine.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(address, name, secret, timeout="3"):
    env = {**os.environ, "MSTAR_SECRET": secret, "MSTAR_JOIN_TIMEOUT": timeout}
    return subprocess.Popen(
        [sys.executable, "-m", "mstar_core.cluster.worker", "--join", address, "--name", name],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


async def test_hand_joined_worker_on_another_address_and_a_peer_without_the_secret(monkeypatch):
    secret = "correct horse battery staple"
    monkeypatch.setenv("MSTAR_SECRET", secret)
    address = f"tcp://127.0.0.1:{_free_port()}"
    placement = Placement.from_dict(
        {"workers": {"far": {"host": "127.0.0.2"}}, "nodes": {"gen": "far"}, "control": {"bind": address}}
    )
    intruder = _join(address, "far", "not the secret at all!!")
    worker = None
    engine = placed_engine(discover())
    load = asyncio.ensure_future(engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement))
    await asyncio.sleep(1.0)
    assert not load.done()  # the intruder did not count as the worker joining
    worker = _join(address, "far", secret)
    try:
        await asyncio.wait_for(load, 60)
        tokens, _ = await run(engine, 1, 6)
        assert tokens == [1, 2, 3, 4, 5, 6]
        out, _ = await asyncio.to_thread(intruder.communicate, timeout=30)
        assert intruder.returncode != 0 and "no answer" in out
        assert engine.cluster.refused >= 1
        await engine.close()
        assert await asyncio.to_thread(worker.wait, 10) == 0  # the worker left when the server shut down
    finally:
        await engine.close()
        for p in (intruder, worker):
            if p is not None and p.poll() is None:
                p.kill()


async def test_a_worker_that_joins_before_its_placement_is_welcomed_once_placed():
    """`mstar worker --join` started before the server loads the model that names it still joins (no start order)."""
    from mstar_core.cluster.cluster import Cluster
    from mstar_core.config.placement import WorkerSpec

    secret = "the early worker knows this secret"
    address = f"tcp://127.0.0.1:{_free_port()}"
    cluster = Cluster(bind=address, secret=secret.encode())
    await cluster.start()
    worker = _join(address, "early", secret, timeout="30")
    try:
        deadline = time.monotonic() + 30
        # wait until its Hello has arrived (held for a placement; the old server refused it)
        while "early" not in cluster.handshake.early and not cluster.refused and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await cluster.ensure_worker("early", WorkerSpec("early", host="127.0.0.1", launcher="manual"), timeout=20)
        assert cluster.workers["early"].alive and cluster.workers["early"].pid == worker.pid
        assert not cluster.refused
    finally:
        await cluster.close()
        if worker.poll() is None:
            worker.kill()


async def test_loops_run_on_the_worker_that_hosts_their_nodes_and_cancel_frees_it():
    placement = Placement.from_dict(
        {"workers": {"gen": {}}, "nodes": {"gen": "gen"}, "engine_settings": {"gen": {"step_delay": 0.005}},
         "control": {"heartbeat_interval": 0.1}}
    )
    engine = placed_engine(discover())
    await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
    assert len(engine._runtime("fixture-stream").conductor.remote_loops) == 1  # the count loop is delegated
    tokens, totals = await run(engine, 2, 13)
    assert tokens == list(range(2, 14))
    assert [t.tolist() for t in totals] == [[14.0] * 3, [30.0] * 3, [46.0] * 3]  # 2+3+4+5, 6..9, 10..13
    handle = engine.submit("fixture-stream", {"start": 0, "stop": 10**6})
    async for out in handle:
        if out.name == "token" and out.value >= 20:
            break
    gen = engine.cluster.workers["gen"]
    await asyncio.sleep(0.3)
    assert gen.load["fixture-stream/gen"]["active"] == 1.0  # the worker holds the running request's state
    handle.cancel()
    deadline = time.monotonic() + 5
    while gen.load["fixture-stream/gen"]["active"] != 0.0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert gen.load["fixture-stream/gen"]["active"] == 0.0  # cancelling freed it on the worker
    await engine.close()


async def test_a_result_that_cannot_travel_fails_its_request_instead_of_hanging_it():
    from mstar_core.errors import RequestError

    placement = Placement.from_dict({"workers": {"w": {}}, "nodes": {"bump": "w"}})
    engine = placed_engine(discover())
    await engine.load_model("fixture-blob", LoadOptions(), placement=placement)
    try:
        with pytest.raises(RequestError, match="bump"):
            await asyncio.wait_for(engine.submit("fixture-blob", {"x": "unsendable"}).result(), 10)
        assert (await engine.submit("fixture-blob", {"x": 41}).result())["y"] == 42  # the worker serves on
    finally:
        await engine.close()


async def test_a_delegated_loop_value_that_cannot_travel_fails_its_request_instead_of_hanging_it():
    from mstar_core.errors import RequestError

    placement = Placement.from_dict({"workers": {"gen": {}}, "nodes": {"gen": "gen"}})
    engine = placed_engine(discover())
    await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
    try:
        with pytest.raises(RequestError, match="sparse"):  # start -1: the fixture streams sparse tensors
            await asyncio.wait_for(engine.submit("fixture-stream", {"start": -1, "stop": 5}).result(), 10)
        tokens, _ = await run(engine, 0, 9)
        assert tokens == list(range(10))  # the worker serves on
    finally:
        await engine.close()

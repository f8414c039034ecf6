"""The transport a placement names carries a worker's tensors, looked up in the plugin registry by name."""

import asyncio
import os
import re
import time
from pathlib import Path

import pytest
import torch

from mstar_core.cluster.links import open_link
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.wire import decode, encode
from mstar_core.wire.messages import NodeResult
from mstar_core.wire.transport import InlineLink

pytest.importorskip("mstar_fixture_plugin")
pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_core_imports_no_plugin_package():
    offenders = []
    for path in (ROOT / "mstar_core").rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.match(r"\s*(from|import)\s+mstar_(transport|kvcache|stateless|diffusion|attn)_?\w*", line):
                offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert offenders == []


def test_links_come_from_the_registry_and_round_trip():
    registry = discover()
    msg = NodeResult(request_id="r", node="m/n", call_index=0, outputs={"y": torch.arange(100_000.0)})
    for name in ("zmq", "shm", "fixture_spool"):
        server, worker = open_link(registry, name, "server"), open_link(registry, name, "worker")
        assert server.name == name
        packed = worker.pack(encode(msg))
        out = decode(server.unpack(packed))
        assert torch.equal(out.outputs["y"], msg.outputs["y"])
        assert worker.stats.sent_messages == 1 and server.stats.received_messages == 1
        assert worker.stats.sent_bytes == server.stats.received_bytes > 400_000
        if name != "zmq":
            assert worker.stats.offloaded_bytes >= 400_000  # the tensor did not ride on the socket
        for end in (server, worker):
            end.peer_lost()
            end.close()
    assert isinstance(open_link(registry, "zmq", "server"), InlineLink)


def test_a_transport_that_cannot_carry_worker_links_is_refused_naming_those_that_can():
    # fixture_pipe is a registered point-to-point transport with no worker link (nccl carries worker links now)
    registry = discover()
    from mstar_core.cluster.links import carries_worker_links, check_transports

    assert not carries_worker_links(registry.transports.get("fixture_pipe"))
    placement = Placement.from_dict({"workers": {"a": {"transport": "fixture_pipe"}}}, "deploy.yaml")
    with pytest.raises(ConfigError, match=r"deploy.yaml: workers.a.transport: transport 'fixture_pipe' cannot carry "
                                          r"a worker's tensors; use one of: (?!.*fixture_pipe).*fixture_spool.*zmq"):
        check_transports(placement, registry)
    # the pipe itself is a working point-to-point channel: what it refuses is only the worker link
    a, b = registry.transports.get("fixture_pipe")(), registry.transports.get("fixture_pipe")()
    b.connect(a.bind("pipe://refusal-test"))
    b.send_msg(NodeResult(request_id="r", node="m/n", call_index=0, outputs={"y": torch.arange(3.0)}))
    assert torch.equal(a.recv_msg(timeout=1).outputs["y"], torch.arange(3.0))
    a.close()


async def test_a_placement_selecting_a_transport_without_worker_links_fails_the_load():
    placement = Placement.from_dict({"workers": {"w": {"transport": "fixture_pipe"}}, "nodes": {"bump": "w"}}, "p.yaml")
    engine = placed_engine(discover())
    try:
        with pytest.raises(ConfigError, match=r"p.yaml: workers.w.transport: transport 'fixture_pipe' cannot carry"):
            await engine.load_model("fixture-blob", LoadOptions(), placement=placement)
        assert engine.cluster is None or not engine.cluster.workers  # refused before any worker was started
    finally:
        await engine.close()


async def test_a_fixture_transport_selected_in_placement_carries_the_tensors():
    placement = Placement.from_dict({"workers": {"w": {"transport": "fixture_spool"}}, "nodes": {"bump": "w"},
                                     "control": {"heartbeat_interval": 0.2}})
    engine = placed_engine(discover())
    await engine.load_model("fixture-blob", LoadOptions(), placement=placement)
    try:
        state = engine.cluster.workers["w"]
        assert state.link.name == "fixture_spool"
        x = torch.randn(256, 1024)  # 1 MiB each way
        for _ in range(3):
            y = (await engine.submit("fixture-blob", {"x": x}).result())["y"]
            assert torch.equal(y, x + 1)
        assert state.link.spooled_out == 3 and state.link.spooled_in == 3  # inputs out, outputs back
        assert state.link.stats.offloaded_bytes == 3 * x.numel() * 4
        small = torch.arange(4.0)
        assert torch.equal((await engine.submit("fixture-blob", {"x": small}).result())["y"], small + 1)
        assert state.link.spooled_out == 3  # small frames stay on the control socket
        deadline = time.monotonic() + 10
        # the worker's end, from its heartbeat (heartbeats travel the link too: wait for one sent after the outputs)
        while state.load.get("link", {}).get("offloaded_bytes", 0) < 3 * x.numel() * 4:
            assert time.monotonic() < deadline, state.load
            await asyncio.sleep(0.05)
        assert state.load["link"]["transport"] == "fixture_spool"
        assert state.load["link"]["offloaded_bytes"] == 3 * x.numel() * 4
        from mstar_core.api.server.metrics import Metrics

        text = Metrics(engine).render().decode()
        labels = 'end="server",transport="fixture_spool",worker="w"'
        assert re.search(r'mstar_link_offloaded_bytes\{' + labels + r'\} 3\.145728e\+06', text), text
        assert re.search(r'mstar_link_bytes\{direction="received",' + labels + r'\} \d', text)
        assert 'mstar_link_offloaded_bytes{end="worker",transport="fixture_spool",worker="w"} 3.145728e+06' in text
        assert re.search(r'mstar_link_round_trip_seconds\{transport="fixture_spool",worker="w"\} \d', text)
    finally:
        await engine.close()
    leftovers = [n for n in os.listdir(state.link.dir) if n.startswith(f"{os.getpid()}-")]
    assert leftovers == []


async def test_an_unknown_transport_fails_the_load_naming_the_registered_ones():
    placement = Placement.from_dict({"workers": {"w": {"transport": "pigeon"}}, "nodes": {"bump": "w"}}, "p.yaml")
    engine = placed_engine(discover())
    try:
        with pytest.raises(ConfigError, match=r"p.yaml: workers.w.transport: unknown transport 'pigeon'; "
                                              r"known: .*fixture_spool.*shm.*zmq"):
            await engine.load_model("fixture-blob", LoadOptions(), placement=placement)
    finally:
        await engine.close()


def test_mstar_plugins_says_which_transports_carry_worker_links(capsys):
    import argparse

    from mstar_core.cli import _plugins

    _plugins(argparse.Namespace(plugin=[], strict=False))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("transports:"))
    assert "shm (transport_shm; worker links, same host)" in line and "zmq (transport_zmq; worker links)" in line
    assert "fixture_spool (fixture; worker links, same host)" in line
    assert "fixture_pipe (fixture; point to point only)" in line

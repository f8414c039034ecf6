"""Placement files: strict schema, errors that name the key."""

import re

import pytest

from mstar_core.config import Placement, load_placement
from mstar_core.errors import ConfigError


def test_parses_workers_nodes_settings_and_control():
    p = Placement.from_dict(
        {
            "workers": {"codec": {"device": "cpu"}, "lm": {"device": "cpu", "replicas": 2}},
            "nodes": {"snac": "codec", "lm": "lm"},
            "engine_settings": {"lm": {"num_pages": 64}},
            "control": {"heartbeat_interval": 0.2},
        }
    )
    assert p.worker_of("snac") == "codec" and p.worker_of("other") == "local"
    assert p.workers["lm"].replica_names() == ["lm.0", "lm.1"]
    assert p.engine_settings["lm"]["num_pages"] == 64 and p.heartbeat_interval == 0.2 and p.remote


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"worker": {}}, "unknown key(s) ['worker']; known: ['control', 'engine_settings', 'nodes', 'workers']"),
        ({"workers": {"a": {"gpu": 1}}}, "workers.a: unknown key(s) ['gpu']"),
        ({"workers": {"a": {"replicas": 0}}}, "workers.a.replicas must be an integer >= 1"),
        ({"nodes": {"lm": "nowhere"}}, "nodes.lm names unknown worker 'nowhere'"),
        ({"workers": {"local": {}}}, "'local' is reserved"),
        ({"control": {"heartbeat_interval": -1}}, "heartbeat_interval must be a positive number"),
        ({"control": {"bnd": "x"}}, "control: unknown key(s) ['bnd']"),
    ],
)
def test_bad_files_name_the_offending_key(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Placement.from_dict(data, "deploy.yaml")


def test_unknown_node_is_named_with_the_model_nodes():
    p = Placement.from_dict({"workers": {"w": {}}, "nodes": {"lmm": "w"}}, "deploy.yaml")
    with pytest.raises(ConfigError, match="unknown node 'lmm' for model 'orpheus'; nodes: lm, snac"):
        p.check_nodes("orpheus", ["lm", "snac"])


def test_load_from_yaml_file(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("workers:\n  codec: {device: cpu}\nnodes:\n  snac: codec\n")
    assert load_placement(path).nodes == {"snac": "codec"}
    path.write_text("workers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_placement(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_placement(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        ({"transport": 7}, "workers.a.transport must be a transport's name"),
        ({"launcher": "k8s"}, "workers.a.launcher: unknown launcher 'k8s'; known: spawn, ray, manual"),
        ({"host": "10.0.0.7", "launcher": "spawn"}, "workers.a: 'host' means the worker joins by hand"),
        ({"num_cpus": 2}, "workers.a.num_cpus is a Ray resource request; it needs launcher: ray"),
        ({"launcher": "ray", "num_cpus": -1}, "workers.a.num_cpus must be a number >= 0"),
    ],
)
def test_launcher_and_transport_are_checked(worker, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Placement.from_dict({"workers": {"a": worker}}, "deploy.yaml")


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        ({"transport": "tcp"}, "workers.a.transport: unknown transport 'tcp'; known: "),
        ({"host": "10.0.0.7", "transport": "shm"}, "shm needs a worker spawned on this host"),
        ({"launcher": "ray", "transport": "shm"}, "shm needs a worker spawned on this host"),
    ],
)
def test_transports_are_checked_against_the_registry(worker, message):
    from mstar_core.cluster.links import check_transports
    from mstar_core.plugins import discover

    placement = Placement.from_dict({"workers": {"a": worker}}, "deploy.yaml")  # any name parses
    with pytest.raises(ConfigError, match=message) as info:
        check_transports(placement, discover())
    if "unknown" in message:
        assert "shm" in str(info.value) and "zmq" in str(info.value)  # the registered names


def test_launchers_and_their_resources():
    p = Placement.from_dict(
        {
            "workers": {
                "here": {},
                "far": {"host": "10.0.0.7"},
                "actor": {"launcher": "ray", "device": "cuda:1", "num_cpus": 4},
                "fast": {"transport": "shm"},
            },
            "control": {"ray_address": "auto"},
        }
    )
    w = p.workers
    assert (w["here"].launcher, w["far"].launcher, w["actor"].launcher) == ("spawn", "manual", "ray")
    assert w["here"].spawned and w["actor"].spawned and not w["far"].spawned
    assert (w["actor"].num_gpus, w["actor"].num_cpus, w["actor"].ray_address) == (1, 4.0, "auto")
    assert w["here"].num_gpus == 0 and w["fast"].transport == "shm"


def test_every_example_file_is_valid():
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[2] / "examples" / "placement").glob("*.yaml"))
    assert len(examples) >= 4
    launchers = {w.launcher for path in examples for w in load_placement(path).workers.values()}
    transports = {w.transport for path in examples for w in load_placement(path).workers.values()}
    assert launchers >= {"spawn", "ray"} and transports == {"zmq", "shm"}

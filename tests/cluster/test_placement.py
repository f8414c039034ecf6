"""Placement files: strict schema, errors that name the key."""

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
        ({"worker": {}}, "unknown key 'worker'; allowed: control, engine_settings, nodes, workers"),
        ({"workers": {"a": {"gpu": 1}}}, "workers.a: unknown key 'gpu'"),
        ({"workers": {"a": {"replicas": 0}}}, "workers.a.replicas must be an integer >= 1"),
        ({"nodes": {"lm": "nowhere"}}, "nodes.lm names unknown worker 'nowhere'"),
        ({"workers": {"local": {}}}, "'local' is reserved"),
        ({"control": {"heartbeat_interval": -1}}, "heartbeat_interval must be a positive number"),
        ({"control": {"bnd": "x"}}, "control: unknown key 'bnd'"),
    ],
)
def test_bad_files_name_the_offending_key(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
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

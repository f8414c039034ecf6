"""Placement of tensor-parallel workers: the strict schema, each rank's device and name, split checks at load."""

from __future__ import annotations

import pytest
import torch

from mstar_core.cluster.rank_groups import RankGroups, check_splits
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.wire import LoadModel


def worker(**spec):
    return Placement.from_dict({"workers": {"tp": spec}}, "tp.yaml").workers["tp"]


def test_a_group_is_n_ranks_on_n_devices_per_replica():
    cpu = worker(tensor_parallel=2, threads=1)
    assert (cpu.group_size, cpu.rank_devices(), cpu.threads) == (2, ["cpu", "cpu"], 1)
    assert cpu.rank_names("tp") == ["tp", "tp.rank1"]
    assert worker(device="cuda:1", tensor_parallel=4).rank_devices() == ["cuda:1", "cuda:2", "cuda:3", "cuda:4"]
    listed = worker(devices=["cuda:0", "cuda:2"], tensor_parallel=2, replicas=2)
    assert listed.rank_devices() == ["cuda:0", "cuda:2"] and listed.device == "cuda:0"
    assert [listed.rank_names(r) for r in listed.replica_names()] == [["tp.0", "tp.0.rank1"], ["tp.1", "tp.1.rank1"]]
    assert worker(expert_parallel=2).group_size == 2
    assert worker().group_size == 1 and worker().rank_names("tp") == ["tp"]


@pytest.mark.parametrize(("spec", "message"), [
    ({"tensor_parallel": 0}, r"workers.tp.tensor_parallel must be an integer >= 1, got 0"),
    ({"tensor_parallel": "2"}, r"workers.tp.tensor_parallel must be an integer >= 1, got '2'"),
    ({"expert_parallel": True}, r"workers.tp.expert_parallel must be an integer >= 1"),
    ({"tensor_parallel": 2, "expert_parallel": 4}, r"give them the same size"),
    ({"tensor_parallel": 2, "devices": ["cuda:0"]}, r"lists 1 devices for a group of 2 ranks"),
    ({"tensor_parallel": 2, "devices": "cuda:0"}, r"devices must be a list of device names"),
    ({"tensor_parallel": 2, "device": "cuda:0", "devices": ["cuda:0", "cuda:1"]}, r"not both"),
    ({"tensor_parallel": 2, "launcher": "ray"}, r"needs launcher: spawn, not ray"),
    ({"tensor_parallel": 2, "host": "10.0.0.7"}, r"needs launcher: spawn, not manual"),
    ({"tensor_paralel": 2}, r"tensor_paralel"),
])
def test_bad_group_settings_are_errors_naming_the_key(spec, message):
    with pytest.raises(ConfigError, match=message):
        worker(**spec)


def test_each_rank_loads_with_its_device_and_a_fresh_rendezvous_per_group_start():
    groups = RankGroups()
    try:
        group = groups.register(["tp", "tp.rank1"])
        msg = LoadModel(model="llama", device="cuda:0", nodes=["lm"])
        first = [groups.load_message(msg, group, i, d) for i, d in enumerate(["cuda:0", "cuda:1"])]
        assert [m.device for m in first] == ["cuda:0", "cuda:1"]
        assert [m.tensor_parallel["rank"] for m in first] == [0, 1]
        assert {m.tensor_parallel["backend"] for m in first} == {"nccl"}
        assert first[0].tensor_parallel["prefix"] == first[1].tensor_parallel["prefix"]
        assert first[0].tensor_parallel["store"].startswith("127.0.0.1:")  # the store listens on loopback only
        groups.renew(group)
        again = groups.load_message(msg, group, 0, "cpu")
        assert again.tensor_parallel["prefix"] != first[0].tensor_parallel["prefix"]
        assert again.tensor_parallel["backend"] == "gloo"
        assert groups.group_of("tp.rank1") == group and groups.group_of("other") is None
    finally:
        groups.close()


def test_a_module_that_cannot_be_split_says_so_naming_the_node():
    with pytest.raises(ConfigError, match=r"node 'vae': module Linear cannot be split across ranks"):
        check_splits("vae", torch.nn.Linear(4, 4), 2)


async def test_a_size_that_does_not_divide_is_a_config_error_at_load_naming_node_dimension_and_sizes():
    engine = placed_engine(discover())
    bad = Placement.from_dict({"workers": {"tp": {"tensor_parallel": 3}}, "nodes": {"lm": "tp"}}, "tp.yaml")
    try:
        with pytest.raises(ConfigError, match=r"node 'lm': tensor_parallel 3 does not divide num_attention_heads "
                                              r"\(4\).*\[1, 2, 4\]"):
            await engine.load_model("llama", LoadOptions(preset="tiny"), placement=bad)
        assert engine.cluster is None or not engine.cluster.workers  # refused before any rank process started
    finally:
        await engine.close()

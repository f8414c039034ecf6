"""Loading the diffusers layout: strict configs that name the offending key, and sharded weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from mstar_wan.checkpoint import ensure_tiny, load_wan
from mstar_wan.config import WanConfig
from safetensors.torch import load_file, save_file

from mstar_core.errors import ConfigError


@pytest.fixture
def copy(tmp_path):
    target = tmp_path / "wan"
    shutil.copytree(ensure_tiny(), target)
    return target


def _edit(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_an_unknown_config_key_is_named(copy):
    _edit(copy / "transformer" / "config.json", num_layerz=3)
    with pytest.raises(ConfigError, match="transformer/config.json: unknown key.*num_layerz"):
        WanConfig.from_dir(copy)


def test_the_two_expert_layout_and_a_non_flow_scheduler_are_refused(copy):
    _edit(copy / "model_index.json", boundary_ratio=0.875)
    with pytest.raises(ConfigError, match="boundary_ratio"):
        WanConfig.from_dir(copy)
    _edit(copy / "model_index.json", boundary_ratio=None)
    _edit(copy / "scheduler" / "scheduler_config.json", prediction_type="epsilon")
    with pytest.raises(ConfigError, match="flow-prediction"):
        WanConfig.from_dir(copy)


def test_sharded_transformer_weights_load_as_the_single_file(copy):
    single = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(single))
    names = sorted(state)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in shards.items():
        save_file({n: state[n] for n in part}, str(copy / "transformer" / shard))
    index = {"metadata": {}, "weight_map": {n: s for s, part in shards.items() for n in part}}
    (copy / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    single.unlink()
    _, dit, _, _ = load_wan(copy, progress=False)
    for name, tensor in dit.state_dict().items():
        assert torch.equal(tensor, state[name])

"""Adapter directories that do not fit are refused up front, with an error naming the directory and the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mstar_core.config.lora import LoraSettings
from mstar_core.errors import ConfigError
from mstar_core.nn import LlamaForCausalLM
from mstar_core.nn.lora import LoraBank, read_peft_adapter
from tests.lora.peft_fixtures import TINY

PREFIX = "base_model.model.model.layers.0."


def _write(directory, config=None, tensors=None, r=4):
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none",
              **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    if tensors is None:
        tensors = {PREFIX + "self_attn.q_proj.lora_A.weight": torch.randn(r, 64),
                   PREFIX + "self_attn.q_proj.lora_B.weight": torch.randn(64, r)}
    if tensors is not False:
        save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def bank():
    return LoraBank(LlamaForCausalLM(TINY), max_loras=2, max_rank=8)


def test_a_good_directory_loads(tmp_path, bank):
    slot = bank.load(read_peft_adapter("ok", _write(tmp_path / "ok"), max_rank=8))
    bank.unload(slot)


def test_rank_over_the_bound_is_named(tmp_path):
    path = _write(tmp_path / "big", r=16)
    with pytest.raises(ConfigError, match=r"'.*big'.*rank 16 of model.layers.0.self_attn.q_proj is over this "
                                          r"server's max_lora_rank 8"):
        read_peft_adapter("big", path, max_rank=8)


def test_missing_files_are_named(tmp_path):
    for path in (tmp_path / "nowhere", "x" * 5000, "a\x00b"):
        with pytest.raises(ConfigError, match="is not a directory"):
            read_peft_adapter("x", path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="missing file adapter_config.json"):
        read_peft_adapter("x", tmp_path / "empty")
    path = _write(tmp_path / "noweights", tensors=False)
    (path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match=r"missing file adapter_model.safetensors \(adapter_model.bin is a pickle"):
        read_peft_adapter("x", path)


def test_unknown_target_module_is_named(tmp_path, bank):
    adapter = read_peft_adapter("t", _write(tmp_path / "t", config={"target_modules": ["q_proj", "c_attn"]}))
    with pytest.raises(ConfigError, match=r"target module 'c_attn' is not a linear of this model; its linears: "
                                          r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', "
                                          r"'v_proj'\]"):
        bank.load(adapter)
    tensors = {"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": torch.randn(4, 64),
               "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight": torch.randn(64, 4)}
    adapter = read_peft_adapter("w", _write(tmp_path / "w", tensors=tensors))
    with pytest.raises(ConfigError, match=r"weights for 'transformer.h.0.attn.c_attn', which is not a linear"):
        bank.load(adapter)
    assert bank.slots == [None, None]  # nothing half-loaded


def test_shapes_of_another_model_are_named(tmp_path, bank):
    tensors = {PREFIX + "self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
               PREFIX + "self_attn.q_proj.lora_B.weight": torch.randn(64, 4)}
    adapter = read_peft_adapter("s", _write(tmp_path / "s", tensors=tensors))
    with pytest.raises(ConfigError, match=r"lora_A \[4, 32\] / lora_B \[64, 4\], this model needs \[4, 64\] / "
                                          r"\[64, 4\] \(an adapter of another model\?\)"):
        bank.load(adapter)


@pytest.mark.parametrize(("config", "message"), [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=.* is not supported"),
    ({"peft_type": "IA3"}, "only LORA adapters load"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_what_this_reader_cannot_apply_is_refused(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        read_peft_adapter("x", _write(tmp_path / "x", config=config))


def test_a_half_pair_and_foreign_tensors_are_named(tmp_path):
    half = {PREFIX + "self_attn.q_proj.lora_A.weight": torch.randn(4, 64)}
    with pytest.raises(ConfigError, match="model.layers.0.self_attn.q_proj has no lora_B weight"):
        read_peft_adapter("x", _write(tmp_path / "half", tensors=half))
    foreign = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 256)}
    with pytest.raises(ConfigError, match="'base_model.model.model.embed_tokens.lora_embedding_A' is not a LoRA"):
        read_peft_adapter("x", _write(tmp_path / "foreign", tensors=foreign))


def test_deploy_keys_are_strict():
    assert LoraSettings.from_deploy({"checkpoint": "x"}, "models.llama") is None
    settings = LoraSettings.from_deploy({"lora_adapters": {"sql": "/a/sql"}, "max_loras": 2}, "models.llama")
    assert (dict(settings.adapters), settings.max_loras, settings.max_lora_rank) == ({"sql": "/a/sql"}, 2, 16)
    with pytest.raises(ConfigError, match=r"models.llama.max_lora_rank must be an integer >= 1, got 0"):
        LoraSettings.from_deploy({"max_lora_rank": 0}, "models.llama")
    with pytest.raises(ConfigError, match=r"models.llama.lora_adapters must map adapter names"):
        LoraSettings.from_deploy({"lora_adapters": ["/a/sql"]}, "models.llama")
    with pytest.raises(ConfigError, match=r"names 3 adapters, over max_loras 2"):
        LoraSettings.from_deploy({"lora_adapters": {"a": "1", "b": "2", "c": "3"}, "max_loras": 2}, "m")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_lora'\]"):
        LoraSettings.from_mapping({"max_lora": 2}, "lora")

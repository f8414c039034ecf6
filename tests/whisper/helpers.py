"""A tiny random Whisper written by transformers' `save_pretrained` (the real ids and geometry, toy widths)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

TINY = dict(d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=80, vocab_size=51865, max_source_positions=1500,
            max_target_positions=448, decoder_start_token_id=50258, pad_token_id=50257, bos_token_id=50257,
            eos_token_id=50257, begin_suppress_tokens=[220, 50257], suppress_tokens=[])
LANGS = {"<|en|>": 50259, "<|de|>": 50261, "<|fr|>": 50265}


def write_reference(directory: Path, seed: int = 0, eot_bias: float = 0.0, **widths):
    """The HF model (eval, fp32) saved to `directory` with its generation config; returns the model. `widths`
    override TINY's (e.g. a head dim of 64, the real models', which M*'s encoder attention kernel takes)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**{**TINY, **widths})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name and "embed_positions" not in name:
                p.normal_(0.0, 0.2)
        if eot_bias:
            eot = model.model.decoder.embed_tokens.weight[50257]
            model.model.decoder.layer_norm.bias.copy_(eot / eot.norm() * eot_bias)
    model.save_pretrained(directory)
    gen = transformers.GenerationConfig(
        decoder_start_token_id=50258, eos_token_id=50257, pad_token_id=50257, bos_token_id=50257, lang_to_id=LANGS,
        task_to_id={"translate": 50358, "transcribe": 50359}, no_timestamps_token_id=50363, prev_sot_token_id=50361,
        is_multilingual=True, max_initial_timestamp_index=50, alignment_heads=[[1, 0], [1, 1]],
        begin_suppress_tokens=[220, 50257], suppress_tokens=[], max_length=448)
    gen.save_pretrained(directory)
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(directory)
    from mstar_whisper.preset import build_tokenizer

    build_tokenizer().save(str(directory / "tokenizer.json"))
    model.generation_config = gen
    return model


def speech(seconds: float, seed: int = 0) -> torch.Tensor:
    """A voiced-looking test signal: harmonics under a slow envelope, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16000)) / 16000
    f0 = 110 + 40 * torch.rand(1, generator=g)
    wave = sum(torch.sin(2 * torch.pi * f0 * k * t) / k for k in range(1, 6))
    env = 0.5 + 0.5 * torch.sin(2 * torch.pi * 3 * t)
    return (0.3 * wave * env + 0.01 * torch.randn(t.shape, generator=g)).float()


async def serve_model(options: LoadOptions, requests: list[dict], settings: dict | None = None):
    """`requests` served together by a fresh engine loading whisper with `options`: (the loaded model, each request's
    generated tokens and final env, the decoder's stats and active requests once all have ended)."""
    engine = AsyncEngine()
    loaded = await engine.load_model("whisper", options, settings=settings)
    try:
        async def one(inputs):
            handle = engine.submit("whisper", inputs)
            tokens = [o.value for o in [o async for o in handle] if o.name == "next_token"]
            return tokens, await handle.result()
        results = await asyncio.gather(*(one(r) for r in requests))
        decoder = engine.node_engines("whisper")["decoder"]
        return loaded, results, decoder.stats(), decoder.active_requests()
    finally:
        await engine.close()


async def serve(directory: Path, requests: list[dict]) -> list[tuple[list[int], dict]]:
    """Each request's generated tokens and final env, served together from `directory` by a fresh engine; every
    decoder page is back in the pool afterwards (asserted)."""
    _, results, stats, active = await serve_model(LoadOptions(checkpoint=str(directory)), requests,
                                                  {"decoder": {"num_pages": 512}})
    assert stats["kv_pages_used"] == 0 and not active
    return results

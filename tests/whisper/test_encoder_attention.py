"""Whisper's encoder through M*'s self-attention kernel (`mstar_core.nn.encoder_attention`, head dim 64 as in every
real Whisper): the same layer output as torch's attention within fp32 rounding, and, against transformers, the same
encoder states and greedy tokens (the module's TINY checkpoint has head dim 4, which the kernel leaves to torch)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from mstar_whisper.modeling import EncoderLayer

from mstar_core.nn import encoder_attention
from mstar_core.nn.packed import pack_linears
from tests.whisper.helpers import serve, speech, write_reference

pytestmark = pytest.mark.skipif(encoder_attention._function(None) is None,
                                reason="the kernel does not run here (no compiler, or a CPU below AVX-512)")
WIDE = dict(d_model=128, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=256,
            decoder_ffn_dim=256)


def _spy(monkeypatch, off: bool = False) -> list[tuple]:
    """The kernel's calls (shapes), recorded; `off`: every call declined, so the layer runs torch's attention."""
    calls, real = [], encoder_attention.attend

    def attend(q, k, v, heads, *args, **kw):
        calls.append((tuple(q.shape), heads))
        return None if off else real(q, k, v, heads, *args, **kw)

    monkeypatch.setattr(encoder_attention, "attend", attend)
    return calls


def test_layer_matches_torch_attention(monkeypatch):
    torch.manual_seed(0)
    layer = EncoderLayer(128, 2, 256).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    pack_linears(layer)
    x = torch.randn(2, 150, 128)
    with torch.inference_mode():
        calls = _spy(monkeypatch)
        got = layer(x)
        assert calls == [((2, 150, 128), 2)]
        _spy(monkeypatch, off=True)
        want = layer(x)
    assert not torch.equal(got, want)  # (the kernel ran: its sums are in another order than torch's)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.slow  # transformers' import and a 51865-token model: tens of seconds on a busy box
def test_states_and_greedy_ids_match_transformers(tmp_path, monkeypatch):
    from mstar_whisper.checkpoint import load_whisper

    transformers = pytest.importorskip("transformers")
    reference = write_reference(tmp_path, seed=3, **WIDE)
    ours, _, _, features = load_whisper(tmp_path, progress=False)
    audio = [speech(6.0, seed=1), speech(17.0, seed=2)]
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    calls = _spy(monkeypatch)
    for clip in audio:
        with torch.inference_mode():
            got = ours.model.encoder(features(clip)[None])
            want = reference.model.encoder(extractor(clip.numpy(), sampling_rate=16000,
                                                     return_tensors="pt").input_features).last_hidden_state
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert len(calls) == 2 * 2  # (two layers a clip)
    results = asyncio.run(serve(tmp_path, [{"audio": a, "max_tokens": 12, "language": "en"} for a in audio]))
    for clip, (tokens, _) in zip(audio, results, strict=True):
        with torch.no_grad():
            want = reference.generate(extractor(clip.numpy(), sampling_rate=16000, return_tensors="pt").input_features,
                                      do_sample=False, num_beams=1, max_new_tokens=12, language="en")[0].tolist()
        assert tokens == want

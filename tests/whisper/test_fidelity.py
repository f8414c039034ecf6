"""Whisper against transformers: log-mel features within 1e-4 of `WhisperFeatureExtractor`; greedy token ids identical
to `WhisperForConditionalGeneration.generate` for a tiny random checkpoint written by `save_pretrained` (with and
without timestamps, given or detected language), served through the stateless and paged engines."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.whisper.helpers import LANGS, serve, speech, write_reference

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers' import and a 51865-token model's init: tens of seconds on a busy box


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("whisper")
    return directory, write_reference(directory)


def _hf_features(audio: torch.Tensor) -> torch.Tensor:
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    return extractor(audio.numpy(), sampling_rate=16000, return_tensors="pt").input_features


@pytest.mark.parametrize("seconds", [0.5, 7.3, 30.0])
def test_features_match_the_feature_extractor(seconds):
    from mstar_whisper.features import WhisperFeatures

    audio = speech(seconds, seed=int(seconds))
    got = WhisperFeatures()(audio)
    want = _hf_features(audio)[0]
    assert got.shape == want.shape == (80, 3000)
    assert (got - want).abs().max().item() < 1e-4


def _hf_generate(model, audio, max_new_tokens, **kw):
    """The generated ids (transformers 5 returns them without the forced prompt)."""
    with torch.no_grad():
        out = model.generate(_hf_features(audio), do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, **kw)
    return out[0].tolist()


def test_greedy_ids_match_generate(reference):
    directory, model = reference
    clips = [speech(3.0, seed=1), speech(11.5, seed=2)]
    cases = [(clips[0], {"language": "en", "timestamps": False}), (clips[1], {"language": "de", "timestamps": False}),
             (clips[0], {"language": "en", "timestamps": True}), (clips[1], {"language": "fr", "timestamps": True}),
             (clips[0], {"language": "en", "timestamps": False, "task": "translate"})]
    requests = [{"audio": a, "max_tokens": 12, **kw} for a, kw in cases]
    results = asyncio.run(serve(directory, requests))
    for (audio, kw), (tokens, env) in zip(cases, results, strict=True):
        want = _hf_generate(model, audio, 12, language=kw["language"], task=kw.get("task", "transcribe"),
                            return_timestamps=kw["timestamps"])
        task = 50358 if kw.get("task") == "translate" else 50359
        assert env["prompt_ids"] == [50258, LANGS[f"<|{kw['language']}|>"], task] + ([] if kw["timestamps"] else [50363])
        assert tokens == want, kw
        assert len(tokens) > 1 and (tokens[0] >= 50364) == kw["timestamps"]  # timestamps first, or none at all


def test_language_detection_matches(reference):
    directory, model = reference
    clips = [speech(4.0, seed=s) for s in (3, 4, 5)]
    results = asyncio.run(serve(directory, [{"audio": a, "max_tokens": 6} for a in clips]))
    for audio, (tokens, env) in zip(clips, results, strict=True):
        with torch.no_grad():
            detected = model.detect_language(_hf_features(audio))
        assert env["detected_language"] == int(detected[0])
        want = _hf_generate(model, audio, 6, task="transcribe")
        assert tokens == want


def test_long_form_matches_generate(reference):
    """Sequential 30-second windows: the same segments (tokens, times) as transformers' long-form generate."""
    directory, model = reference
    audio = torch.cat([speech(20.0, seed=6), speech(25.0, seed=7), speech(9.0, seed=8)])
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    feats = extractor(audio.numpy(), sampling_rate=16000, truncation=False, padding="longest",
                      return_attention_mask=True, return_tensors="pt")
    from mstar_core.nn.whisper_features import LogMelFeatures

    mel = LogMelFeatures(80)(audio)
    assert mel.shape == feats.input_features.shape[1:] and (mel - feats.input_features[0]).abs().max() < 1e-4
    with torch.no_grad():
        out = model.generate(feats.input_features, attention_mask=feats.attention_mask, language="en",
                             task="transcribe", return_timestamps=True, return_segments=True, do_sample=False,
                             num_beams=1, max_new_tokens=20)
    want = [(round(float(s["start"]), 2), round(float(s["end"]), 2), s["tokens"].tolist()) for s in out["segments"][0]]
    (tokens, env), = asyncio.run(serve(directory, [{"audio": audio, "language": "en", "max_tokens": 20}]))
    got = [(round(a, 2), round(b, 2), list(t)) for w in env["windows"] for a, b, t in w["segments"]]
    offsets = [w["offset"] for w in env["windows"]]
    assert len(offsets) >= 2 and offsets[1] % 30 != 0  # (the second window seeks after a timestamp pair)
    assert len(got) == len(want)
    for (a, b, t), (wa, wb, wt) in zip(got, want, strict=True):
        assert t == wt and abs(a - wa) < 1e-6 and abs(b - wb) < 1e-6

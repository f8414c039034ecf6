"""Word timestamps against transformers: the alignment heads' cross-attention of a teacher-forced pass, normalised,
median-filtered and warped, gives each token the start transformers' `generate(..., return_token_timestamps=True)`
gives it (within one 0.02 s position), for a tiny random checkpoint written by `save_pretrained`; the served walks
return those times for every text token (short-form, and long-form offset by each window's seek)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.whisper.helpers import LANGS, serve, speech, write_reference

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers' import and a 51865-token model's init: tens of seconds on a busy box

SOT, TRANSCRIBE, NO_TIMESTAMPS, EOT = 50258, 50359, 50363, 50257


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("whisper")
    return directory, write_reference(directory)


@pytest.fixture(scope="module")
def ours(reference):
    from mstar_whisper.checkpoint import load_whisper

    model, _, tokens, features = load_whisper(reference[0], progress=False)
    return model, tokens, features


def _states(ours, audio):
    model, _, features = ours
    with torch.inference_mode():
        return model.model.encoder(features(audio)[None])[0]


@pytest.mark.parametrize(("seconds", "mask"), [(3.0, True), (11.5, True), (3.0, False)])
def test_token_times_match_generate(reference, ours, seconds, mask):
    from mstar_whisper.alignment import alignment_weights, row_start_times

    _, hf = reference
    audio = speech(seconds, seed=int(seconds))
    feats = transformers.WhisperFeatureExtractor(feature_size=80)(audio.numpy(), sampling_rate=16000,
                                                                   return_attention_mask=True, return_tensors="pt")
    kw = {"attention_mask": feats.attention_mask} if mask else {}
    with torch.no_grad():
        out = hf.generate(feats.input_features, language="en", task="transcribe", return_token_timestamps=True,
                          do_sample=False, num_beams=1, max_new_tokens=12, **kw)
    generated, want = out["sequences"][0].tolist(), out["token_timestamps"][0].numpy()
    model, tokens, _ = ours
    head = [SOT, LANGS["<|en|>"], TRANSCRIBE, NO_TIMESTAMPS]
    weights = alignment_weights(model.model.decoder, _states(ours, audio), head + generated, tokens.alignment_heads)
    # transformers' rows: each generated token as the decoder reads it (the last is never read); the last token's
    # time repeats the one before
    frames = int(feats.attention_mask.sum()) if mask else 3000
    got = row_start_times(weights[:, len(head) : len(head) + len(generated) - 1], frames)
    assert len(got) == len(want) - 1 and want[-1] == want[-2]
    assert np.abs(got - want[:-1]).max() <= 0.02 + 1e-6, (got, want)
    assert want.max() > 0  # (a path that moves: the comparison is not all zeros)


def _openai_rows(ours, audio, text, frames):
    """openai-whisper's reading computed directly: rows <|notimestamps|>, text...; token k spans rows k to k + 1."""
    from mstar_whisper.alignment import alignment_weights, row_start_times

    model, tokens, _ = ours
    head = [SOT, LANGS["<|en|>"], TRANSCRIBE, NO_TIMESTAMPS]
    weights = alignment_weights(model.model.decoder, _states(ours, audio), [*head, *text, EOT], tokens.alignment_heads)
    starts = row_start_times(weights[:, len(head) - 1 : -1], frames)
    return [(t, float(starts[k]), float(starts[k + 1])) for k, t in enumerate(text)]


def test_served_token_times_cover_the_text_in_order(reference, ours):
    directory, _ = reference
    audio = speech(3.0, seed=1)
    requests = [{"audio": audio, "language": "en", "max_tokens": 12, "word_timestamps": True, "timestamps": t}
                for t in (False, True)] + [{"audio": audio, "language": "en", "max_tokens": 12}]
    (plain, env), (stamped, env_ts), (again, env_none) = asyncio.run(serve(directory, requests))
    assert again == plain and "token_times" not in env_none  # asking for times does not change the tokens
    for tokens, e in ((plain, env), (stamped, env_ts)):
        text = [t for t in tokens if t < EOT]
        assert text and [t for t, _, _ in e["token_times"]] == text
        assert e["token_times"] == _openai_rows(ours, audio, text, 300)
        starts = [a for _, a, _ in e["token_times"]]
        assert starts == sorted(starts) and all(0 <= a <= b <= 3.0 for _, a, b in e["token_times"])


def test_long_form_aligns_each_window_kept_text(reference, ours):
    directory, _ = reference
    audio = torch.cat([speech(20.0, seed=6), speech(25.0, seed=7)])
    (_, env), = asyncio.run(serve(directory, [{"audio": audio, "language": "en", "max_tokens": 20,
                                                "word_timestamps": True}]))
    windows, times = env["windows"], env["window_token_times"]
    assert len(windows) == len(times) >= 2 and windows[1]["offset"] > 0
    for window, window_times in zip(windows, times, strict=True):
        kept = [t for _, _, seg in window["segments"] for t in seg if t < EOT]
        assert [t for t, _, _ in window_times] == kept and kept
        assert all(0 <= a <= b <= 30.0 for _, a, b in window_times)

"""`whisper`'s tiny preset served in-process: real tokenizer ids, replies that end, pages given back."""

from __future__ import annotations

import asyncio

import pytest

from mstar_core.model import LoadOptions
from tests.whisper.helpers import serve_model, speech

pytestmark = pytest.mark.slow  # a load, an engine start and ~170 decode steps: ~8 s on a busy 2-core box


def test_the_tiny_preset_transcribes_and_ends():
    requests = [{"audio": speech(2.0 + i, seed=i), "timestamps": bool(i % 2)} for i in range(3)]
    loaded, results, stats, _ = asyncio.run(serve_model(LoadOptions(preset="tiny"), requests))
    tokenizer, tokens = loaded.extras["tokenizer"], loaded.extras["tokens"]
    assert loaded.random_weights
    assert tokenizer.token_to_id("<|startoftranscript|>") == tokens.sot == 50258
    assert tokenizer.token_to_id("<|notimestamps|>") == tokens.no_timestamps == 50363
    for (out, env), inputs in zip(results, requests, strict=True):
        assert out[-1] == tokens.eot and len(out) < 224  # the preset's replies end
        assert env["detected_language"] in tokens.languages.values()
        assert (50363 in env["prompt_ids"]) != inputs["timestamps"]
        assert isinstance(tokenizer.decode([t for t in out if t < tokens.eot]), str)
    assert stats["kv_pages_used"] == 0 and stats["kv_cross_pages"] == 0

"""Whisper's decoding rules (the decoder's `process_logits`) and the transcript formats, without a model."""

from __future__ import annotations

import torch
from mstar_whisper.config import WhisperTokens
from mstar_whisper.preset import generation_config
from mstar_whisper.rules import WhisperLogitsRules

from mstar_core.api.requests.transcripts import Segment, Transcript, compression_ratio, srt, vtt

TOKENS = WhisperTokens.from_generation_config(generation_config())
RULES = WhisperLogitsRules(TOKENS)
SOT, EN, TRANSCRIBE, NOTS, TS = 50258, 50259, 50359, 50363, 50364


def _allowed(history, logits=None):
    logits = torch.zeros(1, 51865) if logits is None else logits
    return set(RULES(logits, [history])[0].isfinite().nonzero().flatten().tolist())


def test_detection_allows_only_languages():
    assert _allowed([SOT]) == set(TOKENS.languages.values())


def test_first_token_rules():
    assert 220 not in _allowed([SOT, EN, TRANSCRIBE, NOTS]) and 50257 not in _allowed([SOT, EN, TRANSCRIBE, NOTS])
    assert _allowed([SOT, EN, TRANSCRIBE]) == set(range(TS, TS + 51))  # a timestamp of at most 1 s first


def test_timestamp_pairs_and_order():
    base = [SOT, EN, TRANSCRIBE]
    after_first = _allowed(base + [TS + 5])
    assert not any(t >= TS for t in after_first)  # the opening timestamp: text next
    lone = _allowed(base + [TS + 5, 1000, TS + 20])
    # its pair, not earlier (flat logits: the timestamps' summed mass then also masks end-of-text, as in transformers)
    assert lone == set(range(TS + 20, 51865))
    closed = _allowed(base + [TS + 5, 1000, TS + 20, TS + 20])
    assert not any(t >= TS for t in closed) and NOTS not in closed
    reopened = _allowed(base + [TS + 5, 1000, TS + 20, TS + 20, 7])
    assert min(t for t in reopened if t >= TS) == TS + 21


def test_timestamp_mass_beats_text():
    logits = torch.full((1, 51865), -30.0)
    logits[0, 100] = 0.0
    logits[0, TS + 10 : TS + 40] = -1.0  # 30 timestamps at e^-1 each outweigh one text token at e^0
    assert _allowed([SOT, EN, TRANSCRIBE, TS + 2, 5], logits) == set(range(TS + 3, 51865))  # end-of-text is text here too


def test_formats():
    segs = (Segment(0, 0.0, 1.5, " Hello.", (1,), -0.2, 1.0, 0.1), Segment(1, 61.25, 3725.0, " World", (2,), -0.2, 1.0, 0.1))
    assert srt(segs) == "1\n00:00:00,000 --> 00:00:01,500\nHello.\n\n2\n00:01:01,250 --> 01:02:05,000\nWorld\n\n"
    assert vtt(segs).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello.\n\n")
    looping = Transcript("the the " * 40, "en", 3.0, segs, -0.2, 0.1)
    assert looping.compression_ratio > 2.4 and looping.needs_fallback()
    assert not Transcript("Hello there.", "en", 3.0, segs, -0.2, 0.1).needs_fallback()
    assert Transcript("Hello there.", "en", 3.0, segs, -1.5, 0.1).needs_fallback()
    assert not Transcript("Hello there.", "en", 3.0, segs, -1.5, 0.9).needs_fallback()  # silence: no retry
    assert compression_ratio("") == 0.0

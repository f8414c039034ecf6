"""Word timestamps' pure parts: dynamic time warping finds the cheapest monotone path, the median filter is a sliding
median, each row's start is the first frame its path reaches, and tokens group into words as openai-whisper groups
them (whole characters, spaces, punctuation merged into its neighbour)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from mstar_whisper.alignment import dtw, median_filter, row_start_times
from mstar_whisper.words import Word, merge_punctuations, split_words, timed_words


def _cheapest(cost: np.ndarray) -> float:
    """The least total cost of a monotone path (right, down or diagonal steps) by plain dynamic programming."""
    rows, cols = cost.shape
    acc = np.full((rows + 1, cols + 1), np.inf)
    acc[0, 0] = 0.0
    for i, j in itertools.product(range(1, rows + 1), range(1, cols + 1)):
        acc[i, j] = cost[i - 1, j - 1] + min(acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
    return float(acc[rows, cols])


@pytest.mark.parametrize("seed", range(6))
def test_dtw_walks_a_cheapest_monotone_path(seed):
    rng = np.random.default_rng(seed)
    cost = rng.standard_normal((int(rng.integers(1, 9)), int(rng.integers(1, 40))))
    text, time = dtw(cost)
    steps = np.stack([np.diff(text), np.diff(time)], axis=1)
    assert (text[0], time[0]) == (0, 0) and (text[-1], time[-1]) == (cost.shape[0] - 1, cost.shape[1] - 1)
    assert all(tuple(s) in {(1, 0), (0, 1), (1, 1)} for s in steps)  # each step right, down or diagonal
    assert abs(cost[text, time].sum() - _cheapest(cost)) < 1e-4


def test_median_filter_is_a_sliding_median_with_mirrored_edges():
    x = torch.randn(2, 3, 20)
    got = median_filter(x, 7)
    padded = torch.cat([x[..., 1:4].flip(-1), x, x[..., -4:-1].flip(-1)], dim=-1)
    want = torch.stack([padded[..., i : i + 7].median(dim=-1).values for i in range(20)], dim=-1)
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        median_filter(x, 4)


def test_rows_start_where_their_attention_peaks():
    # three rows attending frames 0-9, 10-24 and 25-39 in turn: starts 0, 10 and 25 positions (0.02 s each)
    weights = torch.full((2, 3, 60), 0.01)
    for row, (a, b) in enumerate([(0, 10), (10, 25), (25, 40)]):
        weights[:, row, a:b] = 1.0
    starts = row_start_times(weights, frames=80)  # positions past 40 (frames // 2) are padding, left out
    assert np.allclose(starts, [0.0, 0.2, 0.5])


VOCAB = {0: b" Hello", 1: b",", 2: b" w", 3: b"orld", 4: b' "', 5: b"caf", 6: b"\xc3", 7: b"\xa9", 8: b'"', 9: b"!",
         10: b" (", 11: b"yes", 12: b")", 13: b" -", 14: b" no"}


def _decode(tokens):
    return b"".join(VOCAB[t] for t in tokens).decode("utf-8", errors="replace")


def test_tokens_group_into_words_and_punctuation_merges_as_openai_whisper_does():
    tokens = list(range(15))
    assert split_words(tokens, _decode) == [[0], [1], [2, 3], [4, 5, 6, 7], [8], [9], [10, 11], [12], [13], [14]]
    times = [(t, 0.1 * t, 0.1 * (t + 1)) for t in tokens]
    words = timed_words(times, _decode, offset=30.0, limit=31.45)
    assert [w.word for w in words] == [" Hello,", " world", ' "café"!', " (yes)", " - no"]
    assert [w.tokens for w in words] == [[0, 1], [2, 3], [4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14]]
    # a merged word keeps its own times (the marks' are dropped); offset by the window, clamped to the audio's end
    spans = [(round(w.start, 2), round(w.end, 2)) for w in words]
    assert spans == [(30.0, 30.1), (30.2, 30.4), (30.4, 30.8), (31.0, 31.2), (31.4, 31.45)]


def test_unspaced_languages_split_at_every_character():
    tokens = [5, 6, 7]
    assert split_words(tokens, _decode, language="ja") == [[5], [6, 7]]


def test_merging_leaves_words_without_punctuation_alone():
    words = [Word(" a", 0, 1, [1]), Word(" b", 1, 2, [2])]
    assert [w.word for w in merge_punctuations(words)] == [" a", " b"]


def test_median_filter_width_comes_from_config_json_and_must_be_odd():
    from mstar_whisper.config import WhisperConfig

    from mstar_core.errors import ConfigError
    from tests.whisper.helpers import TINY

    assert WhisperConfig.from_mapping(TINY).median_filter_width == 7
    assert WhisperConfig.from_mapping({**TINY, "median_filter_width": 5}).median_filter_width == 5
    with pytest.raises(ConfigError, match="median_filter_width"):
        WhisperConfig.from_mapping({**TINY, "median_filter_width": 4})

"""The resampler's polyphase path (whole-number rates: each phase's taps once) against the filter evaluated at every
output time (`_direct`, the formula it replaced), and a tone kept at its frequency."""

from __future__ import annotations

import numpy as np
import pytest

from mstar_core.api.media.resample import _direct, resample


@pytest.mark.parametrize(("src", "dst", "n"), [(24000, 16000, 65760), (16000, 24000, 12345), (44100, 16000, 44100),
                                               (48000, 24000, 4801), (22050, 24000, 999), (24000, 16000, 1),
                                               (16000, 48000, 7), (8000, 24000, 3)])
def test_polyphase_equals_the_filter_evaluated_at_every_output(src, dst, n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    fast, direct = resample(x, src, dst), _direct(x, src, dst, 16)
    assert fast.dtype == np.float32 and fast.shape == direct.shape == (int(np.ceil(n * dst / src)),)
    np.testing.assert_allclose(fast, direct, rtol=0, atol=1e-6)


def test_a_tone_keeps_its_frequency_and_level():
    t = np.arange(24000 * 2) / 24000
    out = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 24000, 16000)
    spectrum = np.abs(np.fft.rfft(out[2000:-2000]))
    peak = np.argmax(spectrum) * 16000 / (out.size - 4000)
    assert abs(peak - 440) < 1.0
    assert abs(np.sqrt(np.mean(out[2000:-2000] ** 2)) - np.sqrt(0.5)) < 0.01


def test_rates_that_are_not_whole_numbers_and_same_rates():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(resample(x, 24000.5, 16000), _direct(x, 24000.5, 16000, 16))
    assert resample(x, 16000, 16000) is not None and np.array_equal(resample(x, 16000, 16000), x)

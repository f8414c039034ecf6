"""A non-finite output is never sent: NaN / Inf audio samples fail the request instead of being encoded as noise."""

from __future__ import annotations

import numpy as np
import pytest

from mstar_core.api.requests.adapters import to_int16_pcm
from mstar_core.errors import RequestError


def test_non_finite_audio_is_never_encoded():
    assert to_int16_pcm(np.array([0.5, -2.0], dtype=np.float32)).tolist() == [16384, -32767]
    for bad in (np.nan, np.inf):
        with pytest.raises(RequestError, match="non-finite audio") as err:
            to_int16_pcm(np.array([0.1, bad], dtype=np.float32))
        assert err.value.status == 500

"""Token -> SNAC code mapping with Orpheus' real numbers, and the reference windowing."""

import pytest
from mstar_orpheus.codes import AudioTokenMap, reference_windows, tokens_to_codes, window_slice

REAL = AudioTokenMap()  # base 128256, offset 10, codebook 4096


def _frame(codes):
    """Token ids of one frame whose slot s holds code codes[s]."""
    return [128266 + s * 4096 + c for s, c in enumerate(codes)]


def test_slot_layout_matches_the_reference_decoder():
    ids = _frame([10, 11, 12, 13, 14, 15, 16]) + _frame([20, 21, 22, 23, 24, 25, 26])
    level0, level1, level2 = (c.tolist()[0] for c in tokens_to_codes(ids, 0, REAL))
    assert level0 == [10, 20]
    assert level1 == [11, 14, 21, 24]
    assert level2 == [12, 13, 15, 16, 22, 23, 25, 26]


def test_codes_use_the_kept_index_and_config_numbers():
    assert REAL.first == 128266 and REAL.end == 128266 + 7 * 4096
    assert REAL.code(128266 + 3 * 4096 + 99, index=10) == 99  # 10 mod 7 == 3
    tiny = AudioTokenMap(base=322, offset=10, codebook_size=16)
    assert tiny.code(332 + 2 * 16 + 5, index=2) == 5 and tiny.end == 332 + 112
    assert not REAL.is_audio(128258) and REAL.is_audio(128266) and not REAL.is_audio(REAL.end)


def test_out_of_codebook_window_is_rejected_and_misaligned_start_raises():
    ids = _frame([0] * 7)
    ids[4] = 128266  # a slot-0 id in slot 4: code -4 * 4096
    assert tokens_to_codes(ids, 0, REAL) is None
    with pytest.raises(ValueError, match="not frame-aligned"):
        tokens_to_codes(_frame([0] * 7), 3, REAL)


def test_reference_windowing_counts_kept_tokens_only():
    stream = []
    for f in range(6):
        stream += _frame([f] * 7)
        stream.append(128009)  # not an audio token: ignored, does not advance the count
    windows = reference_windows(stream, REAL)
    # after 28, 35 and 42 kept tokens: windows start at kept index 0, 7, 14
    assert [start for start, _ in windows] == [0, 7, 14]
    assert all(len(w) == 28 and all(REAL.is_audio(t) for t in w) for _, w in windows)
    assert window_slice(512) == slice(2048, 4096) and window_slice(4) == slice(16, 32)

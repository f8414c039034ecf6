"""Several messages in one socket message (mstar_core.wire.batch)."""

import orjson
import pytest

from mstar_core.wire import WireError, decode, encode
from mstar_core.wire.batch import BATCH, join_messages, split_messages
from mstar_core.wire.messages import StreamItem


def _item(i):
    return encode(StreamItem(request_id=f"r{i}", stream=0, value=i))


def test_a_lone_message_travels_as_it_is():
    frames = _item(1)
    assert join_messages([frames]) is frames
    assert split_messages(frames) == [frames]


def test_messages_come_back_in_order_with_their_own_frames():
    import torch

    messages = [_item(0), encode(StreamItem(request_id="t", stream=1, value=torch.arange(6.0))), _item(2)]
    joined = join_messages(messages)
    assert joined[0] == BATCH and len(joined) == 2 + sum(map(len, messages))
    parts = split_messages([memoryview(bytes(f)) for f in joined])  # as a socket hands them over
    assert [len(p) for p in parts] == [len(m) for m in messages]
    got = [decode(list(p)) for p in parts]
    assert [m.request_id for m in got] == ["r0", "t", "r2"]
    assert got[1].value.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("counts, frames, why", [
    (b"[1, 1]", 3, "name 2 frames, the message carries 3"),
    (b"[3]", 2, "name 3 frames"),
    (b"[0, 2]", 2, "positive frame counts"),
    (b"[]", 0, "non-empty list"),
    (b"{\"a\": 1}", 1, "non-empty list"),
    (b"[true]", 1, "positive frame counts"),
    (b"not json", 1, "not JSON"),
])
def test_a_batch_whose_counts_do_not_fit_is_refused_naming_why(counts, frames, why):
    with pytest.raises(WireError, match=why):
        split_messages([BATCH, counts, *[b"x"] * frames])


def test_no_wire_header_or_link_tag_reads_as_a_batch():
    assert split_messages([b"mstar-shm-data/1", b"{}"]) == [[b"mstar-shm-data/1", b"{}"]]
    assert split_messages([orjson.dumps({"type": "x"})])[0][0].startswith(b"{")

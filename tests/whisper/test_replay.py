"""Whisper's decode steps replayed from C (issue 47): the decoder's layers recorded once per batch layout (every row in
a decode lane, each sequence cross-attending its own encoder pages through the kernel), then replayed over each step's
embeddings, lanes and cross plan. A replayed step's hidden rows are the eager step's, bit for bit: one request, and
requests of different audio lengths decoding together."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from mstar_core.model import LoadOptions
from mstar_core.nn import tape
from mstar_core.runtime import AsyncEngine
from tests.whisper.helpers import speech, write_reference

pytestmark = pytest.mark.skipif(not tape.available(), reason="no C++ compiler here: tapes do not replay")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("whisper-replay")
    write_reference(directory, seed=3)
    return directory


async def _decode(checkpoint: Path, requests: list[dict], replay: bool, together: bool = True):
    """Each request's tokens; every hidden row the decoder's steps computed, by (request, position); the decoder's
    replay (None when off); each request's cross pages. `together`: submitted at once, else one after another, with
    the pages the last one's cross label held kept from the next (so it replays a recording over other pages)."""
    engine = AsyncEngine()
    await engine.load_model("whisper", LoadOptions(checkpoint=str(checkpoint)),
                            settings={"decoder": {"num_pages": 512, "replay_steps": replay}})
    decoder = engine.node_engines("whisper")["decoder"]
    rows: dict[tuple[str, int], torch.Tensor] = {}
    run = decoder.forward.run

    def keep_rows(work):
        hidden = run(work)
        at = 0
        for seq, n in work:
            for i in range(n):
                rows[seq.request_id, seq.num_computed + i] = hidden[at + i].clone()
            at += n
        return hidden

    decoder.forward.run = keep_rows
    sample = decoder.answers.sample
    head_calls = [0]
    head = decoder.module.compute_logits

    def keep_logits(seqs, last, *step_logits):
        logits, picked = sample(seqs, last, *step_logits)
        for seq, row in zip(seqs, logits, strict=True):
            rows[seq.request_id, -1 - len(seq.generated)] = row.clone()  # (negative: logits, by tokens drawn)
        return logits, picked

    def count_head(hidden):
        head_calls[0] += 1
        return head(hidden)

    decoder.answers.sample = keep_logits
    decoder.module.compute_logits = count_head
    pages: list[list[int]] = []
    store = decoder.cross._store

    def note_pages(request_id, name, kv, states):
        store(request_id, name, kv, states)
        pages.append(decoder.cross.labels[request_id, name].pages)

    decoder.cross._store = note_pages
    try:
        async def one(inputs):
            handle = engine.submit("whisper", inputs)
            tokens = [o.value for o in [o async for o in handle] if o.name == "next_token"]
            await handle.result()
            return tokens

        if together:
            tokens = await asyncio.gather(*(one(r) for r in requests))
        else:
            tokens, held = [], []
            for r in requests:
                tokens.append(await one(r))
                # (the engine is idle between requests: taking pages here keeps the next request off the freed ones)
                held += [decoder.pool.allocate() for _ in pages[-1]]
            for page in held:
                decoder.pool.decref(page)
        if decoder.replay is not None:  # (a replayed step's logits come with it: the head ran for the other steps and
            # each request's no-speech probability alone)
            assert head_calls[0] <= decoder.num_steps - decoder.replay.replayed + len(requests)
        return tokens, rows, decoder.replay, pages
    finally:
        await engine.close()


def _by_position(rows: dict[tuple[str, int], torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """The rows keyed by (request's order of arrival, position): request ids differ from run to run."""
    order = {rid: i for i, rid in enumerate(dict.fromkeys(rid for rid, _ in rows))}
    return {(order[rid], pos): row for (rid, pos), row in rows.items()}


@pytest.mark.parametrize("seconds", [[4.0], [3.0, 11.0, 26.0]], ids=["one row", "three audio lengths"])
def test_replayed_steps_give_the_eager_hidden_rows_bit_for_bit(checkpoint, seconds):
    # (each stops at its own length: the batch shrinks step by step, each row count recorded once)
    requests = [{"audio": speech(s, seed=i), "language": "en", "max_tokens": 12 - 3 * i} for i, s in enumerate(seconds)]
    tokens, rows, replay, _ = asyncio.run(_decode(checkpoint, requests, True))
    eager_tokens, eager_rows, off, _ = asyncio.run(_decode(checkpoint, requests, False))
    assert off is None and replay is not None
    assert tokens == eager_tokens
    got, want = _by_position(rows), _by_position(eager_rows)
    assert got.keys() == want.keys() and len(got) >= 6 * len(seconds)
    assert all(torch.equal(got[key], want[key]) for key in want)
    # the decode steps did replay: recorded once per row count, replayed after (the first request's steps may run
    # alone while the others' prompts run, so a batch records each count it meets)
    assert replay.replayed >= 5 and 1 <= replay.recorded <= len(seconds) + 1
    if len(seconds) > 1:
        assert any(key[1] == len(seconds) for key in replay.programs)  # (a step of every request's rows replayed)
        # one recording per row count, kept side by side: a batch that shrinks and grows again replays, not records
        assert len(replay.programs) == replay.recorded >= 2


def test_a_later_request_replays_the_recording_over_its_own_encoder_pages(checkpoint):
    """The cross plan is among what a replay refreshes: a request decoding after another, over other pages, replays
    the first one's recording and gets its eager rows."""
    requests = [{"audio": speech(s, seed=i), "language": "en", "max_tokens": 8} for i, s in enumerate([5.0, 17.0])]
    tokens, rows, replay, pages = asyncio.run(_decode(checkpoint, requests, True, together=False))
    eager_tokens, eager_rows, _, _ = asyncio.run(_decode(checkpoint, requests, False, together=False))
    assert not set(pages[0]) & set(pages[1])
    assert tokens == eager_tokens
    got, want = _by_position(rows), _by_position(eager_rows)
    assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)
    assert replay.recorded == 1 and replay.replayed >= 12  # (one layout: a row over 1500 frames)


def test_a_decoder_row_gets_the_same_bits_in_a_step_of_any_size():
    """The decoder's norms and GELU run the kernels at any row count (not torch's ops past some size): a decode row
    batched with a long prompt's rows gets the bits it gets alone."""
    from mstar_whisper.modeling import DecoderLayer

    from mstar_core.nn.packed import pack_linears

    torch.manual_seed(0)
    layer = DecoderLayer(64, 4, 256, 0)
    pack_linears(layer, min_out=1)
    x = torch.randn(200, 64)
    with torch.inference_mode():
        together = layer.mlp(x)
        for i in (0, 150):
            assert torch.equal(layer.mlp(x[i : i + 1]), together[i : i + 1])

"""Decode lanes (contiguous per-sequence KV copies in the torch backend) against the page-gather path."""

from __future__ import annotations

import pytest
import torch
from mstar_attn_torch import TorchPagedAttention
from mstar_attn_torch.lanes import DecodeLanes

from mstar_core.runtime.engine import Invocation
from mstar_core.sampling import SamplingParams
from tests.engines.driver import make_engine


def _scenario(engine) -> list[torch.Tensor]:
    """Mixed lengths, chunked prefill, a fork, a 1-token peek that is rolled back, releases and refills."""
    logits: list[torch.Tensor] = []
    prompts = {"a": list(range(1, 23)), "b": list(range(5, 9)), "c": list(range(40, 77)), "d": [3, 1, 4, 1, 5]}
    for rid, ids in prompts.items():
        engine.add(Invocation(rid, "lm", {"input_ids": ids}, {}))
    made = {rid: 0 for rid in prompts}
    queue = ["e", "f"]
    step = 0
    while engine.has_work():
        step += 1
        for inv, out in engine.step():
            if isinstance(out, BaseException):
                raise out
            logits.append(out["logits"])
            rid, label = inv.request_id, inv.options.get("cache_label", "main")
            if label != "main" or not inv.options.get("write_cache", True):
                continue
            made[rid] += 1
            if rid == "a" and made[rid] == 5:  # a branch that shares a's pages copy-on-write
                engine.add(Invocation(rid, "lm", {"input_ids": out["next_token"]}, {"cache_label": "alt", "fork_from": "main"}))
            if rid == "b" and made[rid] == 7:  # attend to one token without keeping it, then continue
                engine.add(Invocation(rid, "lm", {"input_ids": 11}, {"write_cache": False}))
            if made[rid] < 24:
                engine.add(Invocation(rid, "lm", {"input_ids": out["next_token"]}, {}))
            else:
                engine.release(rid)
                if queue:
                    new = queue.pop()
                    made[new] = 0
                    engine.add(Invocation(new, "lm", {"input_ids": list(range(7, 7 + 9 * len(queue) + 3))}, {}))
    return logits


def _engine(model, lanes: bool, **settings):
    engine = make_engine(model, page_size=4, max_num_batched_tokens=24, **{"num_pages": 96, **settings})
    engine.backend = TorchPagedAttention("cpu", decode_lanes=lanes)
    return engine


def test_lanes_give_the_same_logits_as_page_gathers(llama_pair):
    _, ours = llama_pair
    with_lanes = _engine(ours, True)
    got = _scenario(with_lanes)
    ref = _scenario(_engine(ours, False))
    assert len(got) == len(ref) > 100
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-5, rtol=1e-5)
    lanes = with_lanes.backend.lanes
    assert lanes.kv is not None and not lanes.lane_of  # lanes were used, and released with their requests
    assert with_lanes.pool.num_used == 0


def test_lanes_survive_preemption_and_a_tight_budget(llama_pair):
    _, ours = llama_pair
    tight = _engine(ours, True, num_pages=40)  # forces preemptions and recomputes
    got = _scenario(tight)
    assert tight.num_preemptions > 0
    torch.testing.assert_close(torch.stack(got), torch.stack(_scenario(_engine(ours, False, num_pages=40))),
                               atol=1e-5, rtol=1e-5)
    ref = _scenario(_engine(ours, False))
    starved = _engine(ours, True)
    starved.backend.lanes = DecodeLanes(budget_bytes=1)  # no room for any lane: every decode gathers pages
    torch.testing.assert_close(torch.stack(_scenario(starved)), torch.stack(ref), atol=1e-5, rtol=1e-5)
    assert starved.backend.lanes.kv is None


def test_seeded_sampling_is_unchanged_by_lanes(llama_pair):
    _, ours = llama_pair
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=5, max_tokens=30)
    runs = []
    for lanes in (True, False):
        engine = _engine(ours, lanes)
        engine.add(Invocation("r", "lm", {"input_ids": [1, 2, 3], "sampling": params}, {}))
        tokens = []
        while engine.has_work():
            for _, out in engine.step():
                tokens.append(out["next_token"])
                if out["finish_reason"] is None:
                    engine.add(Invocation("r", "lm", {"input_ids": out["next_token"], "sampling": params}, {}))
        runs.append(tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_lane_is_refilled_when_pages_change_under_it():
    pool = torch.randn(1, 2, 8, 2, 1, 3)  # 1 layer, 8 pages of 2 slots
    lanes = DecodeLanes(budget_bytes=1 << 20)
    (lane,) = lanes.assign(pool, ["s"], [[3, 5]], [4])
    torch.testing.assert_close(lanes.kv[0, :, lane, :3], pool[0, :, [3, 5]].flatten(1, 2)[:, :3])
    lanes.kv[0, :, lane, 3] = pool[0, :, 5, 1]  # the caller writes the step's token
    pool[0, :, 6] = torch.randn(2, 2, 1, 3)
    (same,) = lanes.assign(pool, ["s"], [[3, 6, 7]], [5])  # page 5 replaced (copy-on-write): refill
    assert same == lane
    torch.testing.assert_close(lanes.kv[0, :, lane, :4], pool[0, :, [3, 6]].flatten(1, 2)[:, :4])


def test_forget_keeps_lanes_packed():
    pool = torch.randn(1, 2, 16, 2, 1, 3)
    lanes = DecodeLanes(budget_bytes=1 << 20)
    got = lanes.assign(pool, ["a", "b", "c"], [[1, 2], [3, 4], [5, 6]], [4, 3, 4])
    assert got == [0, 1, 2]
    lanes.forget("a")  # "c" moves into lane 0 with its contents; its next step needs no refill
    assert lanes.lane_of == {"c": 0, "b": 1} and lanes.owner[2] is None
    torch.testing.assert_close(lanes.kv[0, :, 0, :3], pool[0, :, [5, 6]].flatten(1, 2)[:, :3])
    lanes.kv[0, :, 0, 3] = 7.0  # the token the caller wrote for "c" last step
    assert lanes.assign(pool, ["c"], [[5, 6, 7]], [5]) == [0]
    assert float(lanes.kv[0, 0, 0, 3, 0, 0]) == 7.0  # kept, not refilled from the pages


def _decode_after_a_release(engine) -> tuple[list[torch.Tensor], list]:
    """Three requests decode together; the oldest finishes, so the youngest's lane moves into its slot."""
    contexts = []
    begin = engine.backend.begin
    engine.backend.begin = lambda batch, kv: contexts.append(begin(batch, kv)) or contexts[-1]
    for rid, ids in {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}.items():
        engine.add(Invocation(rid, "lm", {"input_ids": ids}, {}))
    logits, made = [], {"a": 0, "b": 0, "c": 0}
    while engine.has_work():
        for inv, out in engine.step():
            logits.append(out["logits"])
            made[inv.request_id] += 1
            if inv.request_id == "a" and made["a"] == 3:
                engine.release("a")
            elif made[inv.request_id] < 8:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": out["next_token"]}, {}))
    return logits, contexts


def test_lanes_out_of_batch_order_are_read_through_a_permutation(llama_pair):
    _, ours = llama_pair
    got, contexts = _decode_after_a_release(_engine(ours, True))
    ref, _ = _decode_after_a_release(_engine(ours, False))
    # after "a" leaves, "c" sits in lane 0 and "b" in lane 1 while the batch runs b then c
    assert any(c.in_lanes is not None and c.in_lanes.whole and c.in_lanes.order is not None for c in contexts)
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-5, rtol=1e-5)



def test_bf16_pool_decodes_through_fp32_lanes_like_an_fp32_reference(llama_pair, monkeypatch):
    """Without the lane kernel a bf16 pool on CPU gets fp32 lanes; lanes and page gathers agree, and decode attention equals fp32 math on the bf16 keys."""
    import copy

    from mstar_attn_torch.backend import decode_attention

    from mstar_core.nn import native

    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, length = 3, 6, 2, 16, 21
    keys = torch.randn(b, hkv, length, d, generator=gen).bfloat16()
    vals = torch.randn(b, hkv, length, d, generator=gen).bfloat16()
    q = torch.randn(b, hq, d, generator=gen).bfloat16()
    mask = (torch.arange(length)[None, :] < torch.tensor([21, 9, 14])[:, None])[:, None, None, :]
    got = decode_attention(q, keys, vals, mask, 0.25)
    assert got.dtype == torch.bfloat16
    scores = (q.float().view(b, hkv, hq // hkv, d) @ keys.float().transpose(-1, -2)) * 0.25
    want = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vals.float()).view(b, hq, d)
    torch.testing.assert_close(got.float(), want.bfloat16().float(), atol=0, rtol=0)

    monkeypatch.setenv(native.SWITCH_ENV, "0")
    _, ours = llama_pair
    half = copy.deepcopy(ours).to(torch.bfloat16)
    with_lanes = _engine(half, True)
    got_logits = _scenario(with_lanes)
    assert with_lanes.pool.kv.dtype == torch.bfloat16 and with_lanes.backend.lanes.kv.dtype == torch.float32
    ref = _scenario(_engine(half, False))
    assert len(got_logits) == len(ref) > 100
    torch.testing.assert_close(torch.stack(got_logits).float(), torch.stack(ref).float(), atol=0, rtol=0)


def test_bf16_pool_keeps_bf16_lanes_read_by_the_kernel(llama_pair):
    """With the lane kernel a bf16 pool's lanes stay bf16 (half the bytes per step) and decode like page gathers."""
    import copy

    from mstar_attn_torch import lane_kernel

    if lane_kernel.kernel_for(torch.bfloat16) is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    _, ours = llama_pair
    half = copy.deepcopy(ours).to(torch.bfloat16)
    with_lanes = _engine(half, True)
    calls = []
    real = lane_kernel.LaneCall.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lane_kernel.LaneCall, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
        got = torch.stack(_scenario(with_lanes)).float()
    assert calls and with_lanes.backend.lanes.kv.dtype == torch.bfloat16
    ref = torch.stack(_scenario(_engine(half, False))).float()
    assert got.shape == ref.shape and got.shape[0] > 100
    # two bf16 implementations (summation order): the same argmax nearly everywhere, logits within bf16 noise
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.97
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_lanes_get_shorter_to_make_room_for_more_sequences():
    """One long sequence sized the lanes; sixteen short ones then need more lanes than the budget holds at that length."""
    pool = torch.randn(1, 2, 600, 2, 1, 3)  # 600 pages of 2 slots; a token is 24 bytes of lane
    lanes = DecodeLanes(budget_bytes=1024 * 24)
    assert lanes.assign(pool, ["long"], [list(range(50))], [100]) == [0]
    assert lanes.capacity >= 100
    short = [f"s{i}" for i in range(16)]
    pages = [list(range(100 + 5 * i, 105 + 5 * i)) for i in range(16)]
    got = lanes.assign(pool, short, pages, [10] * 16)
    assert None not in got and lanes.capacity < 100
    for lane, held in zip(got, pages, strict=True):
        torch.testing.assert_close(lanes.kv[0, :, lane, :9], pool[0, :, held].flatten(1, 2)[:, :9])
    # the long sequence lost its lane's contents: it attends through the pages until a lane fits it again
    assert lanes.assign(pool, ["long"], [list(range(51))], [101]) == [None]

"""Frame-at-a-time calls on forked labels (world-model rollouts, CEM samples): batching and label life cycle."""

from __future__ import annotations

import torch

from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import HIDDEN, TinyNode, dense, engine_for, run

FRAME = 4  # tokens per frame = page size: forks never share a partial page


def _frame(seed: int) -> torch.Tensor:
    return torch.randn(FRAME, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _frame_causal(frames: int) -> torch.Tensor:
    f = torch.arange(frames * FRAME) // FRAME
    return f[None, :] <= f[:, None]


def _step_all(engine) -> dict[str, torch.Tensor]:
    """One engine step; each call's hidden rows by cache label."""
    out = {}
    for inv, res in engine.step():
        if isinstance(res, BaseException):
            raise res
        out[inv.options["cache_label"]] = res["hidden"]
    return out


def test_forked_samples_step_in_one_forward_and_drop_their_own_labels():
    module = TinyNode()
    engine = engine_for(module, page_size=FRAME, max_num_batched_tokens=64)
    ctx = torch.cat([_frame(0), _frame(1)])
    run(engine, "r", {"input_embeds": ctx}, cache_label="ctx", frame_size=FRAME)
    assert engine.largest_batch == 1
    for iteration in range(2):  # each iteration forks the context afresh under the same labels
        steps = {f"sample{s}": [_frame(10 * s + k + 100 * iteration) for k in range(3)] for s in range(4)}
        for k in range(3):
            for label, frames in steps.items():
                options = {"cache_label": label, "fork_from": "ctx", "frame_size": FRAME}
                if k == 2:
                    options["drop"] = label  # the label drops itself once its last call is done
                engine.add(Invocation("r", "dit", {"input_embeds": frames[k]}, options))
            before = engine.num_steps
            got = _step_all(engine)
            assert engine.num_steps == before + 1 and not engine.has_work()  # four samples, one forward
            for label, frames in steps.items():
                want = dense(module, input_embeds=torch.cat([ctx, *frames[: k + 1]]), mask=_frame_causal(3 + k))
                torch.testing.assert_close(got[label], want[-FRAME:], atol=1e-5, rtol=0)
        assert engine.largest_batch == 4 and engine.stats()["largest_batch"] == 4
        assert set(engine.seqs) == {("r", "ctx")}  # the samples' own pages went back; the context's stay
        assert engine.pool.num_used == 2 and engine.pool.copies == 0


def test_a_preempted_call_returns_its_own_rows_after_the_recompute():
    module = TinyNode()
    engine = engine_for(module, page_size=4, num_pages=4)
    a, b = list(range(1, 9)), list(range(20, 28))
    run(engine, "a", {"input_ids": a})
    run(engine, "b", {"input_ids": b})  # the pool is full
    got_a = run(engine, "a", {"input_ids": [9, 10, 11]})  # takes b's pages: b is preempted
    got_b = run(engine, "b", {"input_ids": [30, 31, 32]})  # b recomputes its 8 tokens, a is preempted
    assert engine.num_preemptions == 2
    for got, ctx, new in ((got_a, a, [9, 10, 11]), (got_b, b, [30, 31, 32])):
        assert got["hidden"].shape == (3, HIDDEN)  # the call's rows only, not the recomputed context's
        torch.testing.assert_close(got["hidden"], dense(module, ctx + new)[-3:], atol=1e-5, rtol=0)
    got = run(engine, "a", {"input_ids": [12]}, output_rows="last")  # and once more after a's recompute
    torch.testing.assert_close(got["hidden"], dense(module, a + [9, 10, 11, 12])[-1:], atol=1e-5, rtol=0)


def test_frames_on_consecutive_and_on_interleaved_pages_equal_dense():
    module = TinyNode()
    frames = {rid: [_frame(10 * i + k) for k in range(4)] for i, rid in enumerate(("a", "b"))}
    alone = engine_for(module, page_size=FRAME)
    mixed = engine_for(module, page_size=FRAME)
    for k in range(4):
        for rid in ("a", "b"):  # two requests taking turns: their pages interleave (attention gathers them)
            want = dense(module, input_embeds=torch.cat(frames[rid][: k + 1]), mask=_frame_causal(k + 1))[-FRAME:]
            got = run(mixed, rid, {"input_embeds": frames[rid][k]}, frame_size=FRAME)["hidden"]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            if rid == "a":  # one request alone: lowest pages first, so consecutive (attention reads a view)
                got = run(alone, rid, {"input_embeds": frames[rid][k]}, frame_size=FRAME)["hidden"]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert alone.seqs[("a", "main")].pages == [0, 1, 2, 3]
    assert mixed.seqs[("a", "main")].pages == [0, 2, 4, 6] and mixed.seqs[("b", "main")].pages == [1, 3, 5, 7]
    # frame-causal sequences are never shared through the prefix cache, so their pages get no digests
    assert not alone.seqs[("a", "main")].hashes
    run(alone, "c", {"input_ids": list(range(1, 10))})
    assert len(alone.seqs[("c", "main")].hashes) == 2
    alone.release("a")
    assert alone.pool.allocate() == 0  # freed pages are handed out lowest first again

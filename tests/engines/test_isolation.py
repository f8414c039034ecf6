"""Fault isolation in engine steps: one poisoned invocation fails alone, its batch-mates finish untouched.

Each poison is submitted in the same tick as four healthy streams (two greedy, two seeded), so
all five share every batch the engine forms. The healthy ones must give exactly the tokens they
give without the poison, and every KV page must come back once the requests are gone.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from mstar_kvcache import ar_walks

from mstar_core.errors import NodeExecutionError, RequestError
from mstar_core.graph import Graph, GraphNode
from mstar_core.model import LoadedModel
from mstar_core.runtime import AsyncEngine
from mstar_core.runtime.engine import Invocation
from mstar_core.sampling import SamplingParams
from tests.engines.driver import make_engine

MAX_TOKENS = 10
HEALTHY = {
    "greedy-a": ([1, 2, 3], SamplingParams(max_tokens=MAX_TOKENS)),
    "greedy-b": (list(range(10, 31)), SamplingParams(max_tokens=MAX_TOKENS)),
    "seeded-a": ([7] * 9, SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=MAX_TOKENS)),
    "seeded-b": ([5, 4, 3, 2], SamplingParams(temperature=1.2, top_k=20, seed=2, max_tokens=MAX_TOKENS)),
}


def _forced(**fields) -> SamplingParams:
    """SamplingParams carrying values its own validation would refuse (as a buggy or hostile caller could)."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def _loaded(model) -> LoadedModel:
    node = GraphNode("lm", inputs=("input_ids",), outputs=("next_token", "finish_reason"), engine="kvcache",
                     optional_inputs=("sampling",), module=lambda: model)
    graph = Graph.build("tinyllm", [node], ar_walks("lm"), plan=lambda inputs: ["prefill", "decode"])
    return LoadedModel("tinyllm", graph, random_weights=True)


async def _collect(handle) -> list[int] | BaseException:
    try:
        tokens = [o.value async for o in handle if o.name == "next_token"]
        await handle.result()
        return tokens
    except RequestError as exc:
        return exc


async def _serve(model, poison) -> tuple[dict[str, list[int]], list[int] | BaseException | None, int]:
    """Run the healthy streams (and the poison, if any) together; their tokens, the poison's outcome, pages left."""
    engine = AsyncEngine()
    await engine.add_model(_loaded(model), settings={"lm": {"num_pages": 96, "page_size": 4}})
    try:
        handles = {rid: engine.submit("tinyllm", {"input_ids": p, "sampling": s}) for rid, (p, s) in HEALTHY.items()}
        bad = None if poison is None else engine.submit("tinyllm", {"input_ids": [9, 8, 7], "sampling": poison})
        outcomes = await asyncio.wait_for(asyncio.gather(*(_collect(h) for h in handles.values()),
                                                         *([] if bad is None else [_collect(bad)])), timeout=60)
        kv = engine.node_engines("tinyllm")["lm"]
        for _ in range(100):  # releases are applied between steps
            if kv.pool.num_used == 0 and not kv.active_requests():
                break
            await asyncio.sleep(0.01)
        healthy = dict(zip(handles, outcomes, strict=False))
        return healthy, (None if bad is None else outcomes[-1]), kv.pool.num_used
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def unpoisoned(llama_pair):
    healthy, _, leaked = asyncio.run(_serve(llama_pair[1], None))
    assert leaked == 0 and all(len(t) == MAX_TOKENS for t in healthy.values())
    return healthy


SEEDS = {"float": 1.5, "too-large": 2**64, "too-small": -(2**63) - 1, "infinite": float("inf"), "string": "abc",
         "bool": True}


@pytest.mark.parametrize("seed", SEEDS.values(), ids=SEEDS.keys())
@pytest.mark.parametrize("carrier", ["params", "dict"])
def test_a_bad_seed_fails_its_request_alone_with_a_400(llama_pair, unpoisoned, seed, carrier):
    poison = _forced(seed=seed, temperature=0.8) if carrier == "params" else {"seed": seed, "temperature": 0.8}
    healthy, bad, leaked = asyncio.run(_serve(llama_pair[1], poison))
    assert healthy == unpoisoned and leaked == 0
    assert isinstance(bad, RequestError) and bad.status == 400 and "seed" in str(bad)


# values whose arithmetic used to break the batch (the edge refuses them now; the engine must not rely on it):
# a temperature whose scaled logits overflow (NaN log-probabilities), more top log-probabilities than the vocabulary
SURVIVABLE = {
    "denormal-temperature-top-p": _forced(temperature=1e-320, top_p=0.5),
    "denormal-temperature": _forced(temperature=1e-320),
    "logprobs-beyond-vocab": _forced(logprobs=10**9),
    "sampled-logprobs-beyond-vocab": _forced(temperature=0.7, logprobs=10**9, seed=3),
}


@pytest.mark.parametrize("poison", SURVIVABLE.values(), ids=SURVIVABLE.keys())
def test_extreme_sampling_values_neither_fail_nor_disturb_the_batch(llama_pair, unpoisoned, poison):
    healthy, bad, leaked = asyncio.run(_serve(llama_pair[1], poison))
    assert healthy == unpoisoned and leaked == 0
    assert not isinstance(bad, BaseException), bad
    assert len(bad) == MAX_TOKENS and all(0 <= t < 256 for t in bad)


# values that still make sampling raise: the batch is retried row by row, so only this row fails
UNSAMPLEABLE = {
    "logprobs-string": _forced(logprobs="many"),
    "top-k-string": _forced(temperature=0.5, top_k="x"),
    "stop-ids-none": _forced(stop_token_ids=None),
}


@pytest.mark.parametrize("poison", UNSAMPLEABLE.values(), ids=UNSAMPLEABLE.keys())
def test_a_row_that_cannot_be_sampled_fails_alone(llama_pair, unpoisoned, poison):
    healthy, bad, leaked = asyncio.run(_serve(llama_pair[1], poison))
    assert healthy == unpoisoned and leaked == 0
    assert isinstance(bad, NodeExecutionError) and "node 'lm' failed" in str(bad)


POISON_TOKEN = 255


class _PoisonedForward:
    """The model, except that a forward pass whose batch holds POISON_TOKEN raises (a per-input model fault)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, ids, *args, **kwargs):
        self.calls += 1
        if ids is not None and bool((ids == POISON_TOKEN).any()):
            raise ValueError("the model cannot take this input")
        return self.inner(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _drive(engine, prompts: dict[str, list[int]], steps: int, late: dict[str, list[int]] | None = None
           ) -> dict[str, list[int] | BaseException]:
    """Like driver.generate, but an error ends only its own request; `late` prompts join at the third step."""
    out: dict[str, list[int] | BaseException] = {rid: [] for rid in [*prompts, *(late or {})]}
    for rid, prompt in prompts.items():
        engine.add(Invocation(rid, "lm", {"input_ids": prompt}, {}))
    step = 0
    while engine.has_work():
        step += 1
        if step == 3:
            for rid, prompt in (late or {}).items():
                engine.add(Invocation(rid, "lm", {"input_ids": prompt}, {}))
        for inv, res in engine.step():
            rid = inv.request_id
            if isinstance(res, BaseException):
                out[rid] = res
                engine.release(rid)
                continue
            out[rid].append(res["next_token"])
            if len(out[rid]) < steps:
                engine.add(Invocation(rid, "lm", {"input_ids": res["next_token"]}, {}))
            else:
                engine.release(rid)
    return out


@pytest.mark.parametrize("joins", ["with-the-prefills", "mid-decode"])
def test_a_failed_forward_is_retried_per_sequence_and_fails_only_the_culprit(llama_pair, joins):
    prompts = {f"ok-{i}": [1 + i, 2, 3, 4 + i] for i in range(4)}
    alone = _drive(make_engine(llama_pair[1], num_pages=64, page_size=4), prompts, 8)
    engine = make_engine(_PoisonedForward(llama_pair[1]), num_pages=64, page_size=4)
    poison = {"poisoned": [1, POISON_TOKEN, 2]}
    if joins == "mid-decode":  # the failed batch holds decoding rows (decode lanes on this backend)
        got = _drive(engine, prompts, 8, late=poison)
    else:
        got = _drive(engine, {**prompts, **poison}, 8)
    assert isinstance(got.pop("poisoned"), ValueError)
    assert got == alone
    assert engine.pool.num_used == 0 and not engine.active_requests()


def test_a_forward_that_fails_for_everyone_fails_everyone_and_frees_pages(llama_pair):
    engine = make_engine(_PoisonedForward(llama_pair[1]), num_pages=64, page_size=4)
    got = _drive(engine, {f"bad-{i}": [POISON_TOKEN, i + 1] for i in range(3)}, 4)
    assert all(isinstance(v, ValueError) for v in got.values())
    assert engine.module.calls == 4  # the batch, then each sequence alone once
    assert engine.pool.num_used == 0 and not engine.active_requests()


def test_sampling_survives_non_finite_logits_row_by_row():
    from mstar_kvcache.sampler import sample

    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    params = [SamplingParams(temperature=0.8, top_p=0.5, seed=1)] * 4
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    picked = sample(logits, params, gens, [[]] * 4)
    assert all(0 <= t < 32 for t in picked.tokens)
    clean = sample(logits[[0, 3]], [params[0], params[3]], [torch.Generator().manual_seed(i) for i in (0, 3)], [[]] * 2)
    assert [picked.tokens[0], picked.tokens[3]] == clean.tokens  # the bad rows changed nothing for the others


class _Codec(torch.nn.Module):
    """Doubles the last axis (a codec's hop); a NaN anywhere in its batch makes it raise."""

    def forward(self, x):
        if bool(x.isnan().any()):
            raise ValueError("NaN in the codes")
        return torch.repeat_interleave(x * 2, 2, dim=-1)


class _BatchedCodec:
    """Batches itself; a call with a negative input makes the whole batch raise."""

    def forward_batch(self, calls):
        if any(bool((c["x"] < 0).any()) for c in calls):
            raise ValueError("negative codes")
        return [{"y": torch.repeat_interleave(c["x"] * 2, 2, dim=-1)} for c in calls]


@pytest.mark.parametrize("module, options, poison", [
    (_Codec(), {}, torch.full((2, 5), float("nan"))),
    (_Codec(), {"pad_dim": -1}, torch.full((2, 9), float("nan"))),
    (_BatchedCodec(), {}, -torch.ones(2, 5)),
], ids=["stacked", "padded", "forward_batch"])
async def test_stateless_batch_mates_of_a_bad_input_still_get_their_outputs(module, options, poison):
    from mstar_stateless import StatelessEngine

    from mstar_core.runtime.engine import EngineContext
    from mstar_core.runtime.scheduler import NodeScheduler

    node = GraphNode("codec", inputs=("x",), outputs=("y",), engine="stateless", options=options)
    engine = StatelessEngine(node, module, EngineContext("t", torch.device("cpu"), {}))
    sched = NodeScheduler(engine, None)
    widths = (5, 5, 5, 5) if "pad_dim" not in options else (3, 7, 5, 4)
    xs = [torch.rand(2, n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(widths)]
    futures = [sched.submit(Invocation(f"ok-{i}", "codec", {"x": x}, {})) for i, x in enumerate(xs)]
    futures.insert(2, sched.submit(Invocation("poisoned", "codec", {"x": poison}, {})))
    outs = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
    bad = outs.pop(2)
    assert isinstance(bad, NodeExecutionError) and isinstance(bad.cause, ValueError)
    for out, x in zip(outs, xs, strict=True):
        torch.testing.assert_close(out["y"], torch.repeat_interleave(x * 2, 2, dim=-1))
    await sched.close()

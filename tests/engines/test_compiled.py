"""Compiled steps (`compile: true`): the same logits as eager within 1e-5 (fp32), one graph per token bucket."""

from __future__ import annotations

import warnings

import pytest
import torch

from mstar_core.errors import ConfigError
from mstar_core.runtime.engine import Invocation
from tests.engines.driver import make_engine

STEPS = 12


def _tiny_llama():
    from mstar_llm.preset import ensure_tiny

    from mstar_core.nn.llama import load_llama

    return load_llama(ensure_tiny(), progress=False)


def _run(engine, prompts):
    """Greedy decode; every step's logits per request."""
    logits = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add(Invocation(rid, "lm", {"input_ids": prompt}, {}))
    while engine.has_work():
        for inv, res in engine.step():
            if isinstance(res, BaseException):
                raise res
            logits[inv.request_id].append(res["logits"])
            if len(logits[inv.request_id]) < STEPS:
                engine.add(Invocation(inv.request_id, "lm", {"input_ids": res["next_token"]}, {}))
            else:
                engine.release(inv.request_id)
    return {rid: torch.stack([torch.as_tensor(x).reshape(-1) for x in rows]) for rid, rows in logits.items()}


def test_compiled_decode_equals_eager():
    model = _tiny_llama()
    prompts = {f"r{i}": [(5 * i + 3 * j + 1) % 200 for j in range(n)] for i, n in enumerate([5, 11, 3])}
    settings = dict(num_pages=64, page_size=4, max_num_batched_tokens=32)
    want = _run(make_engine(model, **settings), prompts)
    compiled = make_engine(model, **settings, compile=True, compile_buckets=[32])  # one compile: decode rows pad up to 32
    got = _run(compiled, prompts)
    for rid in prompts:
        torch.testing.assert_close(got[rid], want[rid], atol=1e-5, rtol=1e-5)
        assert got[rid].argmax(-1).tolist() == want[rid].argmax(-1).tolist()
    forward = compiled.forward_fn
    if forward.eager_reason is None:  # with a C++ compiler: the bucket compiled once
        assert forward.compiled_buckets == {32}
        assert compiled.stats()["compile_seconds"] > 0


def test_settings_are_checked():
    from mstar_kvcache.config import KVCacheSettings

    assert KVCacheSettings.from_mapping({}).compile is False  # off by default
    assert KVCacheSettings.from_mapping({"compile_buckets": [1, 8]}).compile_buckets == (1, 8)
    with pytest.raises(ConfigError, match="compile_buckets"):
        KVCacheSettings.from_mapping({"compile_buckets": [0]})
    with pytest.raises(ConfigError, match="'compile'"):
        KVCacheSettings.from_mapping({"compile": "yes"})


def test_no_compiler_warns_once_and_runs_eager(monkeypatch):
    from mstar_kvcache import compiled

    monkeypatch.setattr(compiled, "compiler_missing", lambda device: "no C++ compiler found (test)")
    model = _tiny_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine(model, num_pages=16, page_size=4, compile=True)
        _run(engine, {"a": [1, 2, 3]})
    said = [w for w in caught if "compile is on but no C++ compiler" in str(w.message)]
    assert len(said) == 1
    assert engine.forward_fn.compiled_buckets == set()


def test_buckets():
    from mstar_kvcache.compiled import default_buckets

    assert default_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert default_buckets(48) == [1, 2, 4, 8, 16, 32, 64]


def _broken(forward):
    """`forward` with a compiler that always fails (as inductor can on an odd graph)."""

    def broken(*args):
        raise RuntimeError("inductor fell over")

    forward._compiled = broken
    return forward


def test_a_failing_compile_falls_back_to_eager_with_a_warning():
    from mstar_kvcache.compiled import CompiledForward

    from mstar_core.nn.attention import DenseAttention

    model = _tiny_llama()
    forward = _broken(CompiledForward(model, torch.device("cpu"), [8]))
    ids = torch.arange(1, 6)
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="compiling the 8-token step failed"):
        got = forward(ids, torch.arange(5), DenseAttention())
        want = model(ids, torch.arange(5), DenseAttention())
    assert torch.equal(got, want) and forward.eager_reason.startswith("compile failed")


def test_a_split_nodes_fallback_stays_padded_so_its_collectives_keep_the_compiled_shapes():
    from mstar_kvcache.compiled import CompiledForward

    from mstar_core.nn.attention import DenseAttention

    model = _tiny_llama()
    rows = []

    def recording(ids, positions, context, input_embeds=None):
        rows.append(positions.shape[-1])
        return model(ids, positions, context, input_embeds=input_embeds)

    forward = _broken(CompiledForward(recording, torch.device("cpu"), [8], split=True))
    ids = torch.arange(1, 6)
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="compiling the 8-token step failed"):
        got = forward(ids, torch.arange(5), DenseAttention())
        want = model(ids, torch.arange(5), DenseAttention())
        again = forward(ids, torch.arange(5), DenseAttention())
    # other ranks may still run the 8-row graph: this rank's forward (and its all-reduces) stays 8 rows too
    assert rows == [8, 8] and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)
    assert forward.eager_reason.startswith("compile failed") and forward.compiled_buckets == set()


@pytest.mark.slow  # a second compile (~10-20 s on 2 shared cores)
def test_an_attention_error_is_the_steps_not_the_compilers():
    from mstar_kvcache.compiled import CompiledForward

    class Refusing:
        def attend(self, layer, q, k, v, scale):
            raise ValueError("bad request input")

    forward = CompiledForward(_tiny_llama(), torch.device("cpu"), [8])
    if forward.eager_reason is not None:
        pytest.skip(forward.eager_reason)
    with torch.inference_mode(), pytest.raises(ValueError, match="bad request input"):
        forward(torch.arange(1, 6), torch.arange(5), Refusing())
    assert forward.eager_reason is None and forward._compiled is not None  # still compiling
